"""The answers' shapes: each choice's text, its entries, logprobs and usage.

``Choice`` follows one engine request: the text is the engine's (its incremental detokeniser,
O(new tokens) a step), which also ends it at a stop string (``SamplingParams.stop``, the same
code as ``LLM``'s: the text never shows the string unless ``include_stop_str_in_output``, and
the tail that could still begin one is held back while it runs); ``stop_reason`` is vLLM's (the
stop string or stop token id that ended the choice). ``Responses`` (one a request) builds every
choice entry, of the final JSON and of each streamed chunk alike; of ``best_of`` candidates it
returns the ``n`` with the best mean token logprob (OpenAI's "highest log probability per
token"; ``LLM`` ranks by vLLM's cumulative logprob). Usage counts the exact prompt and
generated tokens.

Logprobs as vLLM and lm-eval expect them: ``logprobs`` k (completions) gives each returned
token's logprob and OpenAI's ``top_logprobs`` dicts (top k plus the token itself); with ``echo``
the prompt's tokens come first, the first with ``null`` (the engine computes them as
``prompt_logprobs``), and ``max_tokens: 0`` + ``echo`` returns the prompt and its logprobs only.
Streamed completions carry the logprobs of each chunk's tokens. vLLM's ``prompt_logprobs`` k
returns ``[null, {id: {logprob, rank, decoded_token}}, ...]`` per choice (completions) or per
response (chat).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedhybrid.engine import SequenceDelta
from pagedhybrid.engine.sample.sampler import Logprob
from pagedhybrid.engine.sample.structured import StructuredOutputs
from pagedhybrid.serve.chat.format import Tools
from pagedhybrid.serve.chat.parser import ChatParser


@dataclass
class Job:
    """What ``generate`` needs of a parsed request."""

    prompts: list[list[int]]
    max_tokens: int
    logprobs: int | None  # k of the returned tokens' logprobs (None: not asked)
    chat: bool
    echo_texts: list[str] = field(default_factory=list)
    echo_logprobs: bool = False  # completions: prompt tokens' logprobs with the echo
    echo_only: bool = False  # max_tokens 0 + echo
    structured: StructuredOutputs | None = None  # the answer's grammar
    structured_field: str = ""  # the request field it came from (named by a 400)
    tools: Tools | None = None  # chat: the request's tools
    thinking: bool = False  # chat: the prompt opened <think>

    def parser(self) -> ChatParser | None:
        """A choice's reasoning / tool-call parser (chat answers)."""
        return ChatParser(self.thinking, self.tools) if self.chat else None


# -- one choice: incremental text, stop strings, logprobs ------------------------------------------
@dataclass
class Choice:
    index: int
    request_id: str
    tokenizer: Any
    echo_only: bool = False  # max_tokens 0 + echo: the generated token is not returned
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already returned
    sent_logprobs: int = 0  # streaming: tokens whose logprobs went out
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None = None
    prompt_ids: tuple[int, ...] = ()
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None
    echoed: bool = False  # streaming: the echo chunk went out
    parser: ChatParser | None = None  # chat: reasoning, content and tool calls of the text
    parts: dict[str, Any] = field(default_factory=dict)  # chat: the delta not yet streamed

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def mean_logprob(self) -> float:
        lps = [d[t].logprob for t, d in zip(self.token_ids, self.logprobs, strict=False)]
        return sum(lps) / len(lps) if lps else 0.0

    def update(self, d: SequenceDelta) -> tuple[str, bool]:
        """Apply one of the engine's deltas -> (text that is safe to return now, whether the
        choice ended before its engine request did: its one tool call is complete)."""
        if d.prompt_token_ids is not None:
            self.prompt_ids = d.prompt_token_ids  # the first delta's
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs  # once: it is complete when present
        if d.finished and d.finish_reason == "error":
            self.error = d.error or "the computation failed"
            self.finish_reason = "error"
            return "", False
        if self.echo_only:
            if d.finished:
                self.finish_reason = "length"
            return "", False
        self.token_ids.extend(d.new_token_ids)  # O(new tokens) a step
        if d.new_logprobs is not None:
            self.logprobs.extend(d.new_logprobs)
        # the engine's incremental detokeniser made the new text (O(new tokens) a step)
        text = self.text + d.new_text if d.new_text is not None else \
            self.tokenizer.decode(self.token_ids)
        stopped = False
        if d.finished:
            self.finish_reason = "stop" if d.finish_reason in ("stop", "abort") else \
                str(d.finish_reason)
            self.stop_reason = d.stop_reason
        self.text = text
        safe = len(text)
        if not self.done:
            while safe > self.sent and text[safe - 1] == "\ufffd":  # a partial character
                safe -= 1
        delta = text[self.sent:safe]
        self.sent = safe
        if self.parser is not None:
            _merge(self.parts, self.parser.feed(delta, final=self.done))
            if self.parser.done and not self.done:  # parallel_tool_calls false: one call
                self.finish_reason, stopped = "tool_calls", True
            self.finish_reason = self.parser.finish_reason(self.finish_reason)
        return delta, stopped


def _merge(parts: dict[str, Any], delta: dict[str, Any]) -> None:
    """Add a parser delta to the parts not yet streamed (a call's pieces joined)."""
    for key, value in delta.items():
        if key != "tool_calls":
            parts[key] = parts.get(key, "") + value
            continue
        calls = parts.setdefault("tool_calls", [])
        for item in value:
            if calls and calls[-1]["index"] == item["index"]:
                calls[-1]["function"]["arguments"] += item["function"]["arguments"]
            else:
                calls.append({**item, "function": dict(item["function"])})


# -- logprobs -----------------------------------------------------------------------------------
def token_text(tok: Any, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def _top(d: dict[int, Logprob], k: int, tid: int) -> dict[int, Logprob]:
    """The top ``k`` entries of a logprob dict and ``tid``'s own."""
    return {t: lp for t, lp in d.items() if lp.rank <= k or t == tid}


def completion_logprobs(tok: Any, ids: Sequence[int],
                        dicts: Sequence[dict[int, Logprob] | None], k: int, start: int
                        ) -> dict[str, Any]:
    """OpenAI's completions logprobs of tokens ``ids`` (a ``None`` dict: no logprob, as the
    first prompt token), text offsets from ``start``."""
    tokens, token_lp, top, offsets = [], [], [], []
    pos = start
    for tid, d in zip(ids, dicts, strict=True):
        piece = token_text(tok, tid)
        tokens.append(piece)
        token_lp.append(None if d is None else d[tid].logprob)
        top.append(None if d is None else {token_text(tok, t): lp.logprob
                                           for t, lp in _top(d, k, tid).items()})
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(c: Choice, tok: Any, k: int, first: int = 0) -> dict[str, Any]:
    content = []
    for tid, d in list(zip(c.token_ids, c.logprobs, strict=False))[first:]:
        piece = token_text(tok, tid)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank <= k)
        content.append({"token": piece, "logprob": d[tid].logprob,
                        "bytes": list(piece.encode("utf-8")),
                        "top_logprobs": [{"token": token_text(tok, t), "logprob": lp,
                                          "bytes": list(token_text(tok, t).encode("utf-8"))}
                                         for _, t, lp in ranked[:k]]})
    return {"content": content}


def vllm_prompt_logprobs(tok: Any, c: Choice, k: int) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` layout: ``None`` first, then ``{id: {...}}`` per token."""
    if c.prompt_logprobs is None:
        return None
    out: list[Any] = []
    for tid, d in zip(c.prompt_ids, c.prompt_logprobs, strict=True):
        out.append(None if d is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank,
                     "decoded_token": token_text(tok, t)}
            for t, lp in _top(d, k, tid).items()})
    return out


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


# -- one request's answer -----------------------------------------------------------------------
@dataclass
class Responses:
    """The entries of one request, the same for its final JSON and its streamed chunks."""

    rid: str
    model: str
    tok: Any
    job: Job
    choices: dict[str, Choice]
    best_of: int
    prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs`` k
    continuous_usage: bool = False  # streaming: usage in every chunk
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, returned: Sequence[Choice]) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        gen = sum(len(c.token_ids) for c in returned)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}

    def pick(self, n: int) -> list[Choice]:
        """Per prompt, the first ``n`` choices, or the ``n`` best of ``best_of``."""
        picked: list[Choice] = []
        for p_i in range(len(self.job.prompts)):
            group = [c for c in self.choices.values() if c.index // self.best_of == p_i]
            if self.best_of > n:
                group = sorted(group, key=lambda c: -c.mean_logprob())[:n]
            picked.extend(sorted(group, key=lambda c: c.index)[:n])
        return picked

    def echo_part(self, c: Choice) -> tuple[str, dict[str, Any] | None]:
        """Completions' echoed prompt of ``c`` and, when asked, its tokens' logprobs."""
        job = self.job
        text = job.echo_texts[c.index // self.best_of] if job.echo_texts else ""
        if not (text and job.echo_logprobs and job.logprobs is not None):
            return text, None
        dicts = c.prompt_logprobs or (None,) * len(c.prompt_ids)
        return text, completion_logprobs(self.tok, c.prompt_ids, dicts, job.logprobs, 0)

    def logprobs(self, c: Choice, first: int = 0, offset: int = 0) -> dict[str, Any] | None:
        """``c``'s tokens' logprobs from token ``first``, text offsets from ``offset``."""
        k = self.job.logprobs
        if k is None:
            return None
        if self.job.chat:
            return chat_logprobs(c, self.tok, k, first)
        return completion_logprobs(self.tok, c.token_ids[first:],
                                   c.logprobs[first:len(c.token_ids)], k, offset)

    def entry(self, index: int, text: str | dict[str, Any], logprobs: dict[str, Any] | None,
              finish: str | None, *, final: bool = False, role: bool = False,
              stop_reason: int | str | None = None) -> dict[str, Any]:
        """A choice entry: completions' ``text``; chat's ``message`` (``final``: the parser's
        message) or ``delta`` (the parser's parts; ``role``: the first chunk, naming the
        assistant)."""
        if not self.job.chat:
            shaped: dict[str, Any] = {"text": text}
        elif role:
            shaped = {"delta": {"role": "assistant", "content": ""}}
        elif isinstance(text, str):  # no parser: an error chunk
            shaped = {"delta": {"content": text} if text else {}}
        else:
            shaped = {"message" if final else "delta": text}
        return {"index": index, **shaped, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}

    def stream_entry(self, c: Choice, delta: str) -> dict[str, Any] | None:
        """The chunk entry of ``c``'s new text and tokens; ``None`` when nothing is new."""
        lp = None
        if len(c.token_ids) > c.sent_logprobs and len(c.logprobs) >= len(c.token_ids):
            lp = self.logprobs(c, c.sent_logprobs)
            c.sent_logprobs = len(c.token_ids)
        new: str | dict[str, Any] = delta
        if c.parser is not None:
            new, c.parts = c.parts, {}
        return self.entry(c.index, new, lp, c.finish_reason, stop_reason=c.stop_reason) \
            if new or c.done or lp else None

    def _envelope(self, kind: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": entries}

    def final_response(self, picked: Sequence[Choice]) -> dict[str, Any]:
        job, k, out = self.job, self.prompt_logprobs, []
        for j, c in enumerate(picked):
            echo, lp = self.echo_part(c)  # chat: no echo
            gen_lp = self.logprobs(c, offset=len(echo))
            if lp is not None and gen_lp is not None:
                lp = {key: lp[key] + gen_lp[key] for key in lp}
            text = c.parser.message() if c.parser is not None else echo + c.text
            out.append(self.entry(j, text, lp or gen_lp, c.finish_reason, final=True,
                                  stop_reason=c.stop_reason))
            if k is not None and not job.chat:
                out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, c, k)
        resp = self._envelope("chat.completion" if job.chat else "text_completion", out)
        resp["usage"] = self.usage(picked)
        if job.chat and k is not None and picked:
            resp["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, picked[0], k)
        return resp

    def chunk(self, *entries: dict[str, Any], usage: bool = False) -> str:
        """One server-sent event of ``entries`` (none and ``usage``: the last, usage chunk)."""
        data = self._envelope("chat.completion.chunk" if self.job.chat else "text_completion",
                              list(entries))
        if usage or self.continuous_usage:
            data["usage"] = self.usage(list(self.choices.values()))
        return sse(data)
