"""One request's life in the engine, and what the engine reports back about it.

A ``Request`` holds its prompt and generated tokens in one list (``token_ids``) and one cursor,
``num_computed_tokens``: how many leading tokens are already in its KV pages and state slot.
There are no phases (the vLLM v1 habit): each step computes ``token_ids[num_computed :
num_computed + n]``; when that reaches the end of the known tokens, the last row's logits give
the next token. Preemption resets the cursor to 0 and keeps the generated tokens, so recompute is
just a longer prefill.

Lifecycle: WAITING -> RUNNING (holds pages and a state slot) -> FINISHED; RUNNING -> WAITING on
preemption (gives both back). ``finish_reason`` is ``stop`` (stop token / EOS), ``length``
(max_tokens or max_model_len), ``abort`` or ``error`` (``error`` carries a message).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import torch

from pagedhybrid.engine.core.detokenizer import IncrementalDetokenizer
from pagedhybrid.engine.sample.sampler import Logprob, SampledToken, SamplingParams
from pagedhybrid.errors import PagedHybridError

FinishReason = Literal["stop", "length", "abort", "error"]


class InvalidRequest(PagedHybridError, ValueError):
    """A request rejected at ``add_request``: ``request_id``, ``what`` was wrong, the ``rule``."""

    def __init__(self, request_id: str, what: str, rule: str, got: object = None) -> None:
        self.request_id, self.what, self.rule, self.got = request_id, what, rule, got
        msg = f"request {request_id!r}: '{what}' {rule}"
        if got is not None:
            msg += f" (got {got})"
        super().__init__(msg)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable engine-side state of one request (owned by the scheduler)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    num_preemptions: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])
    num_emitted: int = 0  # output tokens already reported by step()
    num_reports: int = 0  # outputs reported by step() (the first carries the prompt)
    text_emitted: int = 0  # characters of the output's text already reported
    prompt_logprobs_emitted: bool = False  # reported with an output already
    page_hashes: list[int] = field(default_factory=list)  # chain hashes of the full pages
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False  # admitted at least once (num_cached_tokens is then final)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
    detokenizer: IncrementalDetokenizer | None = None  # the output's text, grown per step
    draft_ids: tuple[int, ...] = ()  # speculative drafts for the next step (the drafter's)
    spec_accepted: int = 0  # draft tokens accepted so far
    spec_rejections: int = 0  # verify steps that ended at a rejected draft
    spec_cut: int = 0  # steps in a row the draft budget cut every draft of (DraftBudget)
    matcher: Any = None  # structured outputs: the request's llguidance matcher (structured.py)
    grammar: Any = None  # the future of ``matcher`` while it compiles (not admitted until done)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def match_stop(self, text: str, checked: int) -> tuple[str, int] | None:
        """The earliest of ``params.stop`` in ``text`` that ends past ``checked`` (the length
        already searched): (the string, where the output's text ends -- before it, or after
        it with ``include_stop_str_in_output``); None when none is there."""
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = text.find(s, max(0, checked - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return s, i + len(s) if self.params.include_stop_str_in_output else i

    def record_prompt_logprobs(self, first: int, dicts: list[dict[int, Logprob]]) -> None:
        """Logprobs of prompt tokens ``first + 1 ...`` (given the tokens before each); entries
        already recorded (a recompute after preemption) are kept."""
        have = len(self.prompt_logprobs)  # entries 0 .. have-1 are known
        if first + 1 <= have:
            self.prompt_logprobs.extend(dicts[have - first - 1:])

    @property
    def prompt_logprobs_done(self) -> bool:
        return len(self.prompt_logprobs) >= self.num_prompt_tokens

    def append(self, tok: SampledToken, eos_token_ids: Collection[int],
               max_model_len: int) -> FinishReason | None:
        """Record a sampled token; return the finish reason if the request is now done."""
        self.token_ids.append(tok.token_id)
        if tok.logprobs is not None:
            self.logprobs.append(tok.logprobs)
        if tok.grammar_end:
            return "stop"  # the grammar is complete (its EOS consumed, or nothing can follow)
        p = self.params
        if self.num_output_tokens > p.min_tokens or p.min_tokens == 0:
            if tok.token_id in p.stop_token_ids:
                self.stop_reason = tok.token_id
                return "stop"
            if not p.ignore_eos and tok.token_id in eos_token_ids:
                return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one report of a request adds to the ones before it -- the engine's output as the
    server carries it to the HTTP client (the core process pickles it, ``Choice.update`` applies
    it, a stream sends it on): the new token ids, the new text (None without a detokeniser),
    the new tokens' logprobs (when asked), the prompt's ids with the first report only and its
    logprobs once (when asked, once computed), and the request's state."""

    request_id: str
    num_prompt_tokens: int
    new_token_ids: tuple[int, ...]
    new_text: str | None
    new_logprobs: tuple[dict[int, Logprob], ...] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    error: str | None
    num_preemptions: int
    num_cached_tokens: int
    prompt_token_ids: tuple[int, ...] | None  # the first report's only
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None  # once


@dataclass(frozen=True)
class SequenceOutput:
    """What ``Engine.step`` reports for one request (one sequence: ``LLM`` and the server
    gather a prompt's sequences into vLLM's ``RequestOutput``, ``engine/core/outputs.py``).

    ``new_token_ids`` are the tokens generated since the previous report, ``token_ids`` all
    generated tokens so far; ``text`` decodes ``token_ids`` when the engine has a tokenizer
    (and ``detokenize``); with stop strings, the text that could still begin one is held back
    until it cannot (so text only ever grows), and the final text ends at the stop string.
    ``logprobs`` (when asked) has one dict per generated token; ``prompt_logprobs`` (when asked)
    one per prompt token, ``None`` for the first (vLLM's layout), once the prompt is computed.
    ``num_cached_tokens``: prompt tokens whose KV pages and linear-layer state came from the
    prefix cache at admission (not recomputed). ``token_ids``, ``logprobs`` and
    ``prompt_logprobs`` are copied out of the request on first read (a step's report costs
    O(new tokens), not O(all tokens)); the request's lists only grow, so each output keeps
    the first ``num_generated`` entries it was made with. ``delta()``: what this report adds
    to the request's earlier ones (``SequenceDelta``, what the server streams).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    text: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits (vLLM's field)
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    num_generated: int = 0
    sequence: Sequence[int] = field(default=(), repr=False, compare=False)  # prompt + output
    generated_logprobs: Sequence[dict[int, Logprob]] | None = field(default=None, repr=False,
                                                                    compare=False)
    prompt_logprob_list: Sequence[dict[int, Logprob] | None] | None = field(
        default=None, repr=False, compare=False)
    new_text: str | None = field(default=None, repr=False, compare=False)  # text's new end
    first: bool = field(default=False, repr=False, compare=False)  # the request's first report
    prompt_logprobs_new: bool = field(default=False, repr=False, compare=False)  # first with them

    def delta(self) -> SequenceDelta:
        """What this report adds to the request's earlier ones (O(new tokens))."""
        n, lp = self.num_generated, self.generated_logprobs
        return SequenceDelta(
            self.request_id, len(self.prompt_token_ids), self.new_token_ids, self.new_text,
            None if lp is None else tuple(lp[n - len(self.new_token_ids):n]), self.finished,
            self.finish_reason, self.stop_reason, self.error, self.num_preemptions,
            self.num_cached_tokens, self.prompt_token_ids if self.first else None,
            self.prompt_logprobs if self.prompt_logprobs_new else None)

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        p = len(self.prompt_token_ids)
        return tuple(self.sequence[p:p + self.num_generated])

    @cached_property
    def logprobs(self) -> tuple[dict[int, Logprob], ...] | None:
        lp = self.generated_logprobs
        return None if lp is None else tuple(lp[:self.num_generated])

    @cached_property
    def prompt_logprobs(self) -> tuple[dict[int, Logprob] | None, ...] | None:
        lp = self.prompt_logprob_list
        return None if lp is None else tuple(lp)
