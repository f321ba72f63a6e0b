"""Chat answers split into OpenAI's assistant message (the Qwen3.5 format of
``serve/chat/format.py``).

``ChatParser(thinking, tools)`` -- the answer's text, fed as it grows, split into OpenAI's message
parts: ``reasoning_content`` (vLLM's field), ``content`` and ``tool_calls`` (ids,
``function.name``, ``function.arguments`` as JSON text: each argument converted by its schema,
laid out as ``json.dumps``). ``feed`` returns the stream delta of the new text (the arguments
stream per completed argument); the final message is the sum of the deltas, so a streamed answer
and the same answer whole parse identically. Cases: reasoning opened by the prompt or by the
model's first token, never closed (all of it is reasoning, ``content`` null), no reasoning; a
``<tool_call>`` inside reasoning ends the reasoning (the call is kept, not lost in
``reasoning_content``); Qwen3's JSON calls are read too; with ``parallel_tool_calls`` false the
answer ends after its first call (``done``).

Markup never reaches ``content``: text that could still begin ``<tool_call>`` is held back while
the answer grows, and at its end a tag cut short (``<tool_c``, ``<tool_call>\n<f``) is dropped,
not returned as text. A call cut by the answer's end (``max_tokens``) keeps the arguments
generated so far, as OpenAI returns them: the JSON text up to the cut (``{"city": "Par``: an
argument's value as far as it was written, a string argument's without its closing quote), never
closed into a complete-looking object; a call whose ``<function=NAME>`` was cut is dropped (it
names no function). Only a ``<tool_call>`` followed by text that cannot begin a call (no
``<function=NAME>``, no JSON call) is returned as content: what the model wrote is not a call
(vLLM's parsers do the same).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedhybrid.serve.chat.format import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNCTION_RE,
    PARAMETER_RE,
    THINK_CLOSE,
    THINK_OPEN,
    Tools,
    json_or_text,
)

FUNCTION_END, VALUE_END = "</function>", "\n</parameter>\n"
CUT_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>\Z")  # a header cut before its newline
CUT_PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)(>\n?)?(.*)\Z", re.S)  # name, value cut
JSON_CALL_RE = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)\Z',
                          re.S)  # Qwen3's JSON call, cut in its arguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, complete when the call is


@dataclass
class ChatParser:
    """Splits an answer's text into reasoning, content and tool calls (module docstring).

    Every decision depends only on the text seen so far, never on how it was chunked: text that
    could still begin a marker (``</think>``, ``<tool_call>``) or is a newline that may precede
    one is held back until the next text decides it."""

    thinking: bool = False  # the prompt opened <think>: the answer starts inside it
    tools: Tools | None = None
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    done: bool = False  # parallel_tool_calls false and the first call is complete
    _buf: str = ""
    _mode: str = "start"  # start | reasoning | content | call | args | closing
    _lead: bool = True  # strip the leading newlines / blanks of the next part

    def __post_init__(self) -> None:
        if self.thinking:
            self._mode = "reasoning"

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The stream delta of ``text`` appended to the answer (``final``: the answer ended,
        held-back text goes out but markup cut short, an unfinished call with the arguments
        generated so far). Keys: ``reasoning_content``, ``content``, ``tool_calls``."""
        self._buf += text
        delta: dict[str, Any] = {}
        while not self.done and self._step(delta, final):
            pass
        if final and not self.done:
            self._flush(delta)
        return delta

    def message(self) -> dict[str, Any]:
        """OpenAI's assistant message of everything fed so far."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (
            None if self.calls or self.reasoning else "")}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the answer ended normally with calls."""
        if self.calls and (engine_reason == "stop" or self.done):
            return "tool_calls"
        return engine_reason

    @property
    def _calls_parsed(self) -> bool:
        return self.tools is not None and self.tools.parsed

    def _step(self, delta: dict[str, Any], final: bool) -> bool:
        """Consume what the buffer decides; True when something changed."""
        buf, mode = self._buf, self._mode
        if mode == "start":  # the model may open <think> itself
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._take(len(buf) - len(head) + len(THINK_OPEN))
                self._mode, self._lead = "reasoning", True
                return True
            if THINK_OPEN.startswith(head) and not final:
                return False  # it could still be <think>
            self._mode, self._lead = "content", False
            return True
        if mode in ("reasoning", "content"):
            key = "reasoning_content" if mode == "reasoning" else "content"
            marks = ([THINK_CLOSE] if mode == "reasoning" else []) + (
                [CALL_OPEN] if self._calls_parsed else [])
            at, mark = _first(buf, marks)
            if at < 0:
                self._emit(delta, key, _safe(buf, marks, final))
                return False
            self._emit(delta, key, at, strip_tail=True)
            self._take(len(mark))
            self._mode, self._lead = ("content" if mark == THINK_CLOSE else "call"), True
            return True
        return self._call_step(delta)

    def _call_step(self, delta: dict[str, Any]) -> bool:
        buf = self._buf.lstrip("\n")
        if self._mode == "call":  # <function=NAME>, or Qwen3's JSON call
            m = FUNCTION_RE.match(buf)
            if m is not None:
                self._open_call(delta, m.group(1).strip())
                self._buf, self._mode = buf[m.end():], "args"
                return True
            if buf.startswith("{"):
                at = buf.find(CALL_CLOSE)
                parsed = json_or_text(buf[:at]) if at >= 0 else None
                if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
                    self._open_call(delta, parsed["name"])
                    self._arguments(delta, json.dumps(parsed.get("arguments", {}),
                                                      ensure_ascii=False))
                    self._buf, self._mode = buf[at:], "closing"
                    return True
                if at < 0:
                    return False
            elif "<function=".startswith(buf) or (buf.startswith("<function=")
                                                  and "\n" not in buf):
                return False
            self._not_a_call(delta)
            return True
        if self._mode == "args":
            call = self.calls[-1]
            m = PARAMETER_RE.match(buf)
            if m is not None:
                name, raw = m.group(1).strip(), m.group(2)
                tool = self.tools.tool(call.name) if self.tools is not None else None
                value = tool.value(name, raw) if tool is not None else json_or_text(raw)
                self._arguments(delta, ("{" if not call.arguments else ", ")
                                + json.dumps(name, ensure_ascii=False) + ": "
                                + json.dumps(value, ensure_ascii=False))
                self._buf = buf[m.end():]
                return True
            end = buf.find(CALL_CLOSE)  # </function>, or a call closed without it
            if buf.startswith("</function>") or (end >= 0 and "<parameter=" not in buf[:end]):
                self._close_call(delta)
                self._buf = buf[len("</function>"):] if buf.startswith("</function>") else buf
                return True
            return False
        at = buf.find(CALL_CLOSE)  # closing: </tool_call>
        if at < 0:
            return False
        self._buf, self._mode, self._lead = buf[at + len(CALL_CLOSE):], "content", True
        if self.tools is not None and not self.tools.parallel:
            self.done = True
        return True

    def _not_a_call(self, delta: dict[str, Any]) -> None:
        """A ``<tool_call>`` that names no function: its text is content after all."""
        self._mode, self._lead = "content", False
        self.content += CALL_OPEN
        delta["content"] = delta.get("content", "") + CALL_OPEN

    def _open_call(self, delta: dict[str, Any], name: str) -> None:
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        delta.setdefault("tool_calls", []).append(
            {"index": len(self.calls) - 1, "id": call.id, "type": "function",
             "function": {"name": name, "arguments": ""}})

    def _arguments(self, delta: dict[str, Any], piece: str) -> None:
        self.calls[-1].arguments += piece
        delta.setdefault("tool_calls", []).append(
            {"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def _close_call(self, delta: dict[str, Any]) -> None:
        self._arguments(delta, "}" if self.calls[-1].arguments else "{}")
        self._mode = "closing"

    def _flush(self, delta: dict[str, Any]) -> None:
        """The answer ended: what ``_step`` held back is markup cut short (a partial
        ``<tool_call>``; ``_safe`` let the rest out), or an unfinished call, which keeps the
        arguments generated so far (module docstring)."""
        buf = self._buf.lstrip("\n")
        if self._mode == "args":
            self._cut_arguments(delta, buf)
        elif self._mode == "call":
            self._cut_call(delta, buf)
        self._buf = ""

    def _cut_call(self, delta: dict[str, Any], buf: str) -> None:
        """A call cut before its first argument: kept when its function is named."""
        m = CUT_FUNCTION_RE.match(buf)
        if m is not None:
            self._open_call(delta, m.group(1).strip())
            return
        text = buf[:len(buf) - _tail(buf, CALL_CLOSE)].strip()  # Qwen3's JSON call
        parsed = json_or_text(text)
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):  # whole
            self._open_call(delta, parsed["name"])
            self._arguments(delta, json.dumps(parsed.get("arguments", {}), ensure_ascii=False))
            return
        m = JSON_CALL_RE.match(text)
        if m is not None and isinstance(name := json_or_text(m.group(1)), str):
            self._open_call(delta, name)
            if m.group(2):
                self._arguments(delta, m.group(2))

    def _cut_arguments(self, delta: dict[str, Any], buf: str) -> None:
        """The JSON text of the arguments up to the cut (``buf``: the call's text after its
        complete arguments)."""
        call = self.calls[-1]
        if len(buf) > 1 and FUNCTION_END.startswith(buf):  # the model was closing the call
            self._close_call(delta)
            return
        m = CUT_PARAMETER_RE.match(buf)
        if m is None:  # nothing of an argument (or "<", "<param"): what was complete
            return
        name, raw = m.group(1).strip(), m.group(3)
        piece = "{" if not call.arguments else ", "
        if not m.group(2):  # the name was cut
            self._arguments(delta, piece + json.dumps(name, ensure_ascii=False)[:-1])
            return
        tool = self.tools.tool(call.name) if self.tools is not None else None
        end = raw.find(VALUE_END[:-1])
        if end >= 0:  # the value is complete, only the line after it was cut
            value = tool.value(name, raw[:end]) if tool is not None else json_or_text(
                raw[:end])
            text = json.dumps(value, ensure_ascii=False)
        else:
            raw = raw[:len(raw) - _tail(raw, VALUE_END)]  # the closing tag's start is markup
            as_text = tool.is_text(name) if tool is not None else not _json_start(raw)
            text = json.dumps(raw, ensure_ascii=False)[:-1] if as_text else raw
        self._arguments(delta, piece + json.dumps(name, ensure_ascii=False) + ": " + text)

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        return text

    def _emit(self, delta: dict[str, Any], key: str, n: int, strip_tail: bool = False) -> None:
        """Move the buffer's first ``n`` characters to ``key``'s part (leading blanks of a part
        dropped, and trailing blanks before a marker)."""
        text = self._take(n)
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if strip_tail:
            text = text.rstrip()
        if not text:
            return
        if key == "reasoning_content":
            self.reasoning += text
        else:
            self.content += text
        delta[key] = delta.get(key, "") + text


def _first(text: str, marks: Sequence[str]) -> tuple[int, str]:
    found = [(i, m) for m in marks if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _tail(text: str, mark: str) -> int:
    """The length of the longest end of ``text`` that begins ``mark`` (shorter than it)."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return k
    return 0


def _json_start(raw: str) -> bool:
    """Whether ``raw`` (a value of an unknown function's argument, cut) begins like JSON."""
    head = raw.lstrip()
    return head[:1] in tuple('{["-0123456789') or head[:4] in ("true", "fals", "null")


def _safe(text: str, marks: Sequence[str], final: bool) -> int:
    """How much of ``text`` can go out now: all but trailing blanks and a tail that could
    begin one of ``marks`` (either may still turn out to precede a marker); at the answer's
    end (``final``) all but a ``<tool_call>`` cut short (and the blanks before it): markup,
    never text."""
    end = len(text)
    for mark in marks:
        if not final or mark == CALL_OPEN:
            end -= _tail(text[:end], mark)
    if final and end == len(text):
        return end
    return len(text[:end].rstrip()) if marks else end
