"""What ``LLM.generate`` / ``LLM.chat`` return: vLLM's ``RequestOutput`` and ``CompletionOutput``.

The engine runs one sequence per engine request and reports ``SequenceOutput`` each step
(``request.py``). A prompt with ``n`` (or ``best_of``) sequences is that many engine requests
(``SamplingParams.sequences``); ``gather`` makes vLLM's shape of them: ``RequestOutput`` with the
prompt (text, or None for token ids), ``prompt_token_ids``, ``prompt_logprobs``, ``outputs`` (one
``CompletionOutput`` a returned sequence: ``index``, ``text``, ``token_ids``,
``cumulative_logprob``, ``logprobs``, ``finish_reason``, ``stop_reason``), ``finished`` and
``num_cached_tokens``. With ``best_of > n`` the ``n`` sequences of the highest cumulative logprob
are kept (vLLM's rule), and their logprobs are dropped again when the caller asked for none.

For code written against this project's earlier flat output, a ``RequestOutput`` of one sequence
also answers ``token_ids``, ``text``, ``logprobs``, ``finish_reason`` and ``stop_reason`` (those of
``outputs[0]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedhybrid.engine.core.request import SequenceOutput
from pagedhybrid.engine.sample.sampler import Logprob, SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (vLLM's fields); ``message``: with ``LLM.chat``, OpenAI's
    assistant message parsed from ``text`` (``content``, ``reasoning_content``,
    ``tool_calls``), and ``finish_reason`` is then the chat's (``"tool_calls"``)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[dict[int, Logprob], ...] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    message: dict[str, Any] | None = None
    error: str | None = None  # why the sequence failed (finish_reason "error")

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    sequences: tuple[SequenceOutput, ...] = field(default=(), repr=False, compare=False)

    def _one(self) -> CompletionOutput:
        return self.outputs[0]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self._one().token_ids

    @property
    def text(self) -> str:
        return self._one().text

    @property
    def logprobs(self) -> tuple[dict[int, Logprob], ...] | None:
        return self._one().logprobs

    @property
    def finish_reason(self) -> str | None:
        return self._one().finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self._one().stop_reason


def cumulative_logprob(out: SequenceOutput) -> float | None:
    """The sum of the sampled tokens' logprobs (None without logprobs)."""
    lps = out.logprobs
    if lps is None:
        return None
    return float(sum(d[t].logprob for d, t in zip(lps, out.token_ids, strict=False)))


def gather(request_id: str, prompt: str | None, params: SamplingParams,
           outs: Sequence[SequenceOutput]) -> RequestOutput:
    """vLLM's ``RequestOutput`` of one prompt's sequences (``params.sequences()``, in order)."""
    ranked = list(enumerate(outs))
    if len(outs) > params.n:  # best_of: the n best by cumulative logprob, in that order
        ranked.sort(key=lambda io: -(cumulative_logprob(io[1]) or 0.0))
        ranked = ranked[:params.n]
    keep_lps = params.logprobs is not None
    completions = [CompletionOutput(
        index=i, text=o.text or "", token_ids=o.token_ids,
        cumulative_logprob=cumulative_logprob(o) if keep_lps else None,
        logprobs=o.logprobs if keep_lps else None, finish_reason=o.finish_reason,
        stop_reason=o.stop_reason, error=o.error)
        for i, (_, o) in enumerate(ranked)]
    first = outs[0]
    return RequestOutput(request_id, prompt, first.prompt_token_ids, first.prompt_logprobs,
                         completions, all(o.finished for o in outs),
                         first.num_cached_tokens, tuple(outs))
