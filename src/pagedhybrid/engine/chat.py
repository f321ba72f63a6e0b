"""Chat turns in the Qwen3.5 format: reasoning, tool calls, and the grammars that force them.

The Qwen3.5 chat format (``models/qwen35/chat_template.jinja``; vLLM's ``qwen3`` reasoning parser
and ``qwen3_coder`` tool parser read the same text) writes reasoning as
``<think>\\n...\\n</think>\\n\\n`` before the answer, and a function call as XML::

    <tool_call>
    <function=NAME>
    <parameter=ARGUMENT>
    VALUE
    </parameter>
    </function>
    </tool_call>

where a ``string`` argument's VALUE is its raw text and any other argument's VALUE is JSON.

* ``Tools.of(tools, tool_choice, parallel_tool_calls)`` -- OpenAI's ``tools`` list (function
  definitions, ``parameters`` an object schema of named properties) and ``tool_choice``
  (``none`` | ``auto`` | ``required`` | a named function), checked field by field
  (``ContractViolation`` naming the field: ``tools[1].function.parameters``, ``tool_choice``).
* ``thinking(prompt)`` -- whether the rendered prompt leaves a ``<think>`` open (the Qwen3.5
  template opens it in the generation prompt unless ``enable_thinking`` is false, when it writes
  an empty, closed one): the answer then starts inside the reasoning.
* ``constraint(structured, tools, thinking)`` -- the grammar of the answer: the structured
  output's (``StructuredOutputs.lark_body``) or, for ``tool_choice`` ``required`` or a named
  function, the tool calls' (every argument of the function's schema, required ones always,
  values valid for their property schema, arguments in schema order); when the prompt opened
  ``<think>``, free reasoning up to ``</think>`` comes first: grammars apply after the
  reasoning ends.
* ``ChatParser(thinking, tools)`` -- the answer's text, fed as it grows, split into OpenAI's
  message parts: ``reasoning_content`` (vLLM's field), ``content`` and ``tool_calls`` (ids,
  ``function.name``, ``function.arguments`` as JSON text: each argument converted by its
  schema, laid out as ``json.dumps``). ``feed`` returns the stream delta of the new text (the
  arguments stream per completed argument); the final message is the sum of the deltas, so a
  streamed answer and the same answer whole parse identically. Cases: reasoning opened by the
  prompt or by the model's first token, never closed (all of it is reasoning, ``content``
  null), no reasoning; a ``<tool_call>`` inside reasoning ends the reasoning (the call is
  kept, not lost in ``reasoning_content``); with ``parallel_tool_calls`` false the answer ends
  after its first call (``done``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedhybrid.engine.structured import JSON_LAYOUT, StructuredOutputs
from pagedhybrid.errors import ContractViolation

OP = "chat"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_RE = re.compile(r"<function=([^>\n]*)>\n")
PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>\n(.*?)\n</parameter>\n", re.S)
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
# string arguments are raw text in the call; these keywords would need a regex over it
TEXT_KEYWORDS = ("pattern", "format")
MAX_TEXT = 1 << 16  # the longest minLength / maxLength a string argument may ask for


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: Mapping[str, Any]  # an object schema ({"type": "object"} when none was given)
    description: str | None = None

    def properties(self) -> dict[str, Mapping[str, Any]]:
        return dict(self.parameters.get("properties") or {})

    def is_text(self, argument: str) -> bool:
        """Whether ``argument`` is written as raw text (a ``string`` property)."""
        return self.properties().get(argument, {}).get("type") == "string"

    def value(self, argument: str, raw: str) -> Any:
        """An argument's value from its text in the call: raw text for a ``string``
        property, else JSON (the raw text when it does not parse, as vLLM's parser does)."""
        if self.is_text(argument):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw


@dataclass(frozen=True)
class Tools:
    """A request's tools and ``tool_choice`` (module docstring)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # none | auto | required | the name of one function
    parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[Any] | None, tool_choice: Any = None,
           parallel_tool_calls: bool | None = None) -> Tools | None:
        """OpenAI's fields checked (``ContractViolation`` naming the field); ``None`` when
        there are no tools."""
        choice = _choice(tool_choice)
        if not tools:
            if tools is not None and not isinstance(tools, Sequence):
                raise ContractViolation(OP, "tools", "must be a list of function tools", tools)
            if choice not in ("none", "auto"):
                raise ContractViolation(OP, "tool_choice", f"{choice!r} needs tools")
            return None
        parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
        names = [t.name for t in parsed]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ContractViolation(OP, f"tools[{i}].function.name",
                                        "names a function twice", name)
        if choice not in CHOICES and choice not in names:
            raise ContractViolation(OP, "tool_choice", f"names no function of tools "
                                    f"({names})", choice)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ContractViolation(OP, "parallel_tool_calls", "must be a bool",
                                    parallel_tool_calls)
        return cls(parsed, choice, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def parsed(self) -> bool:
        """Whether the answer's tool calls are parsed (not for ``tool_choice`` ``none``)."""
        return self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The functions a grammar makes the model call (none unless ``required`` or named)."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def for_template(self) -> list[dict[str, Any]]:
        """The tools as the chat template reads them (OpenAI's shape)."""
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = dict(t.parameters)
            out.append({"type": "function", "function": fn})
        return out


def _choice(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise ContractViolation(OP, "tool_choice", f"must be one of {list(CHOICES)} or "
                                    "{'type': 'function', 'function': {'name': ...}}", value)
        return value
    fn = value.get("function") if isinstance(value, Mapping) else None
    if not (isinstance(value, Mapping) and value.get("type") == "function"
            and isinstance(fn, Mapping) and isinstance(fn.get("name"), str)
            and set(value) <= {"type", "function"}):
        raise ContractViolation(OP, "tool_choice", "must be one of "
                                f"{list(CHOICES)} or {{'type': 'function', 'function': "
                                "{'name': ...}}", value)
    return str(fn["name"])


def _tool(item: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, Mapping) or item.get("type") != "function":
        raise ContractViolation(OP, f"{where}.type", "must be 'function' (the only tool "
                                "type)", item.get("type") if isinstance(item, Mapping) else item)
    extra = sorted(set(item) - {"type", "function"})
    if extra:
        raise ContractViolation(OP, f"{where}.{extra[0]}", "is not a field of a function tool")
    fn = item.get("function")
    if not isinstance(fn, Mapping):
        raise ContractViolation(OP, f"{where}.function", "must be an object with a name")
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise ContractViolation(OP, f"{where}.function.{extra[0]}", "is not a field of a "
                                "function (name, description, parameters, strict)")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ContractViolation(OP, f"{where}.function.name", "must be 1-64 letters, digits, "
                                "'_', '.' or '-'", name)
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ContractViolation(OP, f"{where}.function.description", "must be a string", desc)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(params, f"{where}.function.parameters")
    return Tool(name, params, desc)


def _check_parameters(params: Any, where: str) -> None:
    """``parameters`` must be an object schema whose arguments the XML format can write."""
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ContractViolation(OP, where, "must be a JSON schema of type 'object' (the "
                                "function's named arguments)", params)
    props = params.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping)
                                                 for v in props.values()):
        raise ContractViolation(OP, f"{where}.properties", "must map argument names to "
                                "schemas", props)
    for name, schema in props.items():
        if not NAME_RE.match(name):
            raise ContractViolation(OP, f"{where}.properties", "argument names must be 1-64 "
                                    "letters, digits, '_', '.' or '-'", name)
        if schema.get("type") == "string":
            bad = [k for k in TEXT_KEYWORDS if k in schema]
            if bad:
                raise ContractViolation(OP, f"{where}.properties.{name}.{bad[0]}",
                                        "is not supported on a string argument (Qwen3.5 "
                                        "writes string arguments as raw text; use enum or "
                                        "minLength / maxLength)")
            for key in ("minLength", "maxLength"):
                n = schema.get(key, 0)
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TEXT:
                    raise ContractViolation(OP, f"{where}.properties.{name}.{key}",
                                            f"must be an integer in [0, {MAX_TEXT}]", n)
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in props
                                                 for r in required):
        raise ContractViolation(OP, f"{where}.required", "must list names of properties",
                                required)
    if params.get("additionalProperties") not in (None, False):
        raise ContractViolation(OP, f"{where}.additionalProperties", "must be false or "
                                "absent: a forced call writes only the declared arguments")


def template_message(message: Mapping[str, Any], where: str = "messages") -> dict[str, Any]:
    """An OpenAI chat message as chat templates read it: each tool call's ``arguments`` (JSON
    text in OpenAI's messages) parsed into a mapping, as the Qwen3.5 template writes them one
    argument at a time (``ContractViolation`` naming the call when it is not an object)."""
    out = dict(message)
    calls = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ContractViolation(OP, f"{where}.tool_calls[{j}].function", "must name the "
                                    "function called", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ContractViolation(OP, f"{where}.tool_calls[{j}].function.arguments",
                                        f"must be the JSON text of an object ({exc})") from None
        if not isinstance(args, Mapping):
            raise ContractViolation(OP, f"{where}.tool_calls[{j}].function.arguments",
                                    "must be a JSON object", args)
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": dict(args)}})
    if calls:
        out["tool_calls"] = calls
    return out


def thinking(prompt: str) -> bool:
    """Whether ``prompt`` ends inside an opened ``<think>`` (the answer starts reasoning)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# -- grammars -----------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)


def _value_rule(tool: Tool, name: str, schema: Mapping[str, Any], rule: str) -> list[str]:
    """Rule ``rule``: argument ``name``'s value and the line that closes it."""
    end = "\n</parameter>\n"
    if not tool.is_text(name):
        sub = dict(schema)
        for key in ("$defs", "definitions"):  # references inside a property resolve at the root
            if key in tool.parameters:
                sub[key] = tool.parameters[key]
        sub["x-guidance"] = JSON_LAYOUT
        return [f"{rule}: %json {json.dumps(sub)} {_lit(end)}"]
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return [f"{rule}: " + " | ".join(_lit(f"{v}{end}") for v in values)]
    low, high = schema.get("minLength", 0), schema.get("maxLength", "")
    return [f"{rule}[suffix={_lit(end)}]: /(?s:.{{{low},{high}}})/"]


def _tool_rules(tools: Tools) -> list[str]:
    """Lark rules ``calls`` of the forced functions (module docstring)."""
    rules, fns = [], []
    for i, tool in enumerate(tools.forced):
        required = set(tool.parameters.get("required", ()))
        parts = []
        for j, (name, schema) in enumerate(tool.properties().items()):
            rule = f"f{i}_a{j}"
            rules.append(f"{rule}: {_lit(f'<parameter={name}>' + chr(10))} {rule}_v")
            rules += _value_rule(tool, name, schema, f"{rule}_v")
            parts.append(rule if name in required else f"{rule}?")
        rules.append(f"f{i}: {_lit(f'<function={tool.name}>' + chr(10))} {' '.join(parts)} "
                     f"{_lit('</function>' + chr(10))}")
        fns.append(f"f{i}")
    rules.append(f"call: {_lit(CALL_OPEN + chr(10))} ({' | '.join(fns)}) {_lit(CALL_CLOSE)}")
    rules.append('calls: call ("\\n\\n" call)*' if tools.parallel else "calls: call")
    return rules


def constraint(structured: StructuredOutputs | None, tools: Tools | None,
               thinking: bool) -> StructuredOutputs | None:
    """The answer's grammar (module docstring); ``None`` when nothing constrains it."""
    if tools is not None and tools.parsed and tools.forced:
        if structured is not None:
            raise ContractViolation(OP, "tool_choice", f"{tools.choice!r} forces a tool call; "
                                    "it cannot be combined with a structured output")
        rules, body = _tool_rules(tools), "calls"
    elif structured is None or not thinking:
        return structured
    else:
        rules, body = [], structured.lark_body()
    if thinking:
        rules.append(f'reasoning[suffix={_lit(THINK_CLOSE)}]: /(?s:.*)/')
        body = f'reasoning "\\n\\n" {body}'
    return StructuredOutputs(grammar="\n".join([f"start: {body}", *rules]))


# -- parsing ------------------------------------------------------------------------------------
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
        held-back text goes out). Keys: ``reasoning_content``, ``content``, ``tool_calls``."""
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
                parsed = _loose(buf[:at]) if at >= 0 else None
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
                value = tool.value(name, raw) if tool is not None else _loose(raw)
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
        """The answer ended: held-back text goes out; an unfinished call is closed with the
        arguments that were complete."""
        if self._mode == "args":
            self._close_call(delta)
        if self._mode == "call":
            self._not_a_call(delta)
        if self._mode == "closing":
            self._buf = ""
            return
        self._emit(delta, "reasoning_content" if self._mode == "reasoning" else "content",
                   len(self._buf))

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


def _safe(text: str, marks: Sequence[str], final: bool) -> int:
    """How much of ``text`` can go out now: all but trailing blanks and a tail that could
    begin one of ``marks`` (either may still turn out to precede a marker)."""
    if final:
        return len(text)
    end = len(text)
    for mark in marks:
        for k in range(min(len(mark) - 1, end), 0, -1):
            if mark.startswith(text[end - k:end]):
                end -= k
                break
    return len(text[:end].rstrip()) if marks else end


def _loose(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
