"""``LLM``: offline batch generation on top of ``Engine`` (the vLLM ``LLM.generate`` habit).

``LLM(model=None)`` loads the built-in default model (``default_model_dir()``), or an HF Qwen3.5
checkpoint folder, with its tokenizer. As vLLM's ``LLM``: ``generate(prompts, params)`` takes a
str, token ids, ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` or a list of them (anything
else: ``ContractViolation`` naming the argument), queues every prompt's sequences
(``SamplingParams.sequences``: ``n`` / ``best_of``) at once, steps the engine until all are
finished (a progress bar on stderr), prints one throughput line (prompt tok/s, generated tok/s)
and returns vLLM's ``RequestOutput`` of each prompt in input order (``engine/core/outputs.py``).
``stream`` yields the engine's per-sequence outputs of every step instead. ``chat(messages,
tools=...)`` renders each conversation with the checkpoint's chat template and returns the same
``RequestOutput``, each sequence's answer parsed as the server parses it (``serve/chat/format.py``:
``reasoning_content``, ``content``, ``tool_calls``; ``tool_choice`` ``required`` or a named
function forced by a grammar).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedhybrid.engine.core.outputs import RequestOutput, gather
from pagedhybrid.engine.core.request import InvalidRequest, SequenceOutput
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.loader import load_engine
from pagedhybrid.engine.sample.sampler import SamplingParams
from pagedhybrid.engine.sample.structured import check
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.serve.chat.format import Tools, constraint, template_message, thinking
from pagedhybrid.serve.chat.parser import ChatParser

Prompt = str | Sequence[int]
PromptInput = Prompt | Mapping[str, Any] | Sequence[Prompt | Mapping[str, Any]]
Conversation = Sequence[Mapping[str, object]]
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt


def _is_ids(x: object) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompt(p: object, where: str, op: str) -> tuple[str | None, str | list[int]]:
    """One prompt as (its text or None, what the engine takes: text or token ids)."""
    if isinstance(p, str):
        return p, p
    if _is_ids(p):
        return None, list(p)  # type: ignore[arg-type]
    if isinstance(p, Mapping):
        keys = set(p)
        if len(keys & set(PROMPT_KEYS)) != 1 or keys - set(PROMPT_KEYS):
            raise ContractViolation(op, where, "a prompt dict must have exactly one of "
                                    "'prompt' (text) or 'prompt_token_ids' (vLLM's "
                                    "TextPrompt / TokensPrompt) and no other key", sorted(keys))
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise ContractViolation(op, f"{where}['prompt']", "must be a str",
                                        type(p["prompt"]).__name__)
            return p["prompt"], p["prompt"]
        if not _is_ids(p["prompt_token_ids"]):
            raise ContractViolation(op, f"{where}['prompt_token_ids']",
                                    "must be a non-empty list of ints", p["prompt_token_ids"])
        return None, list(p["prompt_token_ids"])
    raise ContractViolation(op, where, "must be a str, a non-empty list of token ids, or a "
                            "{'prompt': str} / {'prompt_token_ids': [...]} dict",
                            type(p).__name__)


def parse_prompts(prompts: object, op: str) -> list[tuple[str | None, str | list[int]]]:
    """``prompts`` as one or many prompts (``parse_prompt`` each); a list of ints is one
    prompt, as in vLLM."""
    if isinstance(prompts, str | Mapping) or _is_ids(prompts):
        return [parse_prompt(prompts, "prompts", op)]
    if isinstance(prompts, Sequence) and prompts:
        return [parse_prompt(p, f"prompts[{i}]", op) for i, p in enumerate(prompts)]
    raise ContractViolation(op, "prompts", "must be a prompt or a non-empty list of prompts",
                            prompts if isinstance(prompts, Sequence) else type(prompts).__name__)


@dataclass(frozen=True)
class _Queued:
    """One prompt of a call: its engine requests are ``sequence_ids``."""

    request_id: str
    prompt: str | None
    prompt_ids: str | list[int]
    params: SamplingParams

    @property
    def sequence_ids(self) -> list[str]:
        k = self.params.num_sequences
        return [self.request_id] if k == 1 else [f"{self.request_id}-{j}" for j in range(k)]

@dataclass(frozen=True)
class Throughput:
    requests: int
    prompt_tokens: int
    generated_tokens: int
    elapsed_s: float

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def generated_tps(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def line(self) -> str:
        return (f"{self.requests} requests in {self.elapsed_s:.2f} s: "
                f"prompt {self.prompt_tps:.1f} tok/s, generated {self.generated_tps:.1f} tok/s")


class LLM:
    """Offline generation. Keyword options are ``EngineConfig`` fields (block_size, num_blocks,
    cache_memory_bytes, num_state_slots, max_num_seqs, max_num_batched_tokens, max_model_len,
    seed, batch_invariant, kv_cache_dtype, ...) plus ``dtype`` (default ``"auto"``: the
    checkpoint's own)."""

    def __init__(self, model: str | Path | None = None, *, dtype: str | torch.dtype = "auto",
                 engine: Engine | None = None, **config: object) -> None:
        self.engine = engine if engine is not None else load_engine(model, dtype=dtype, **config)
        self.last_throughput: Throughput | None = None
        self._batch = 0

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (``with LLM(...) as llm:`` does)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _queue(self, prompts: PromptInput, params: SamplingParams | Sequence[SamplingParams]
               | None, op: str = "LLM.generate") -> list[_Queued]:
        """Queue every prompt's sequences (``SamplingParams.sequences``), all or none."""
        plain = parse_prompts(prompts, op)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(plain)
        elif isinstance(params, Sequence) and all(isinstance(p, SamplingParams)
                                                  for p in params):
            plist = list(params)
            if len(plist) != len(plain):
                raise ContractViolation(op, "sampling_params",
                                        "must be one SamplingParams or one per prompt",
                                        (len(plist), len(plain)))
        else:
            raise ContractViolation(op, "sampling_params",
                                    "must be a SamplingParams or a list of them",
                                    type(params).__name__)
        self._batch += 1
        jobs = [_Queued(f"{self._batch}-{i}", text, ids, p)
                for i, ((text, ids), p) in enumerate(zip(plain, plist, strict=True))]
        for job in jobs:  # a bad grammar is refused here, as vLLM's front end does
            if job.params.structured_outputs is not None:  # (the engine compiles it)
                try:
                    check(job.params.structured_outputs)
                except ContractViolation as exc:
                    raise InvalidRequest(job.request_id, exc.where, exc.rule) from None
        queued: list[str] = []
        try:
            for job in jobs:
                for rid, p in zip(job.sequence_ids, job.params.sequences(), strict=True):
                    self.engine.add_request(rid, job.prompt_ids, p)
                    queued.append(rid)
        except Exception:
            self.engine.abort_request(queued)
            list(self.engine.stream())  # drain the abort outputs
            raise
        return jobs

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Prompt]
              ) -> list[list[float]]:
        """The training-side recompute: each completion token's fp32 log-probability after its
        prompt (one full-sequence forward each; ``ModelRunner.score``). With
        ``batch_invariant=True`` they equal the engine's sampled-token logprobs bitwise."""
        return self.engine.score(prompts, completions)

    def stream(self, prompts: PromptInput,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[SequenceOutput]:
        """Queue ``prompts`` and yield every step's per-sequence outputs until all are
        finished (``request_id`` ``"<batch>-<prompt>"``, ``"-<sequence>"`` appended with
        ``n`` > 1)."""
        self._queue(prompts, sampling_params)
        yield from self.engine.stream()

    def generate(self, prompts: PromptInput,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_progress: bool = True) -> list[RequestOutput]:
        """vLLM's ``LLM.generate``: one ``RequestOutput`` per prompt, in prompt order.
        ``prompts``: a str, a list of token ids, vLLM's ``{"prompt": str}`` /
        ``{"prompt_token_ids": [...]}``, or a list of those; ``sampling_params``: one for all
        or one per prompt. Prints a progress bar and a throughput line."""
        jobs = self._queue(prompts, sampling_params)
        final: dict[str, SequenceOutput] = {}
        start = time.perf_counter()
        progress = None
        if use_progress:
            from rich.console import Console
            from rich.progress import Progress

            progress = Progress(console=Console(stderr=True), transient=False)
            progress.start()
            task = progress.add_task("generate", total=sum(len(j.sequence_ids) for j in jobs))
        try:
            for out in self.engine.stream():
                if out.finished:
                    final[out.request_id] = out
                    if progress is not None:
                        progress.advance(task)
        finally:
            if progress is not None:
                progress.stop()
        elapsed = time.perf_counter() - start
        results = [gather(j.request_id, j.prompt, j.params,
                          [final[r] for r in j.sequence_ids]) for j in jobs]
        self.last_throughput = Throughput(
            len(results), sum(len(r.prompt_token_ids) for r in results),
            sum(len(s.token_ids) for r in results for s in r.sequences), elapsed)
        if use_progress:
            print(self.last_throughput.line(), file=sys.stderr)
        return results

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | None = None, *,
             tools: Sequence[Mapping[str, object]] | None = None, tool_choice: object = None,
             parallel_tool_calls: bool | None = None,
             chat_template_kwargs: Mapping[str, object] | None = None,
             use_progress: bool = True) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: answer one conversation (a list of OpenAI messages) or several,
        each rendered by the chat template with ``tools`` (``RequestOutput.prompt``: the
        rendered text), generated with ``sampling_params`` (its structured output, or the
        forced tool call of ``tool_choice``, applies after any reasoning); each sequence's
        ``CompletionOutput.message`` is its assistant message (module docstring) and its
        ``finish_reason`` the chat's (``"tool_calls"``)."""
        tok = self.engine.tokenizer
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise UnsupportedConfiguration("LLM.chat needs a checkpoint with a tokenizer and "
                                           "a chat template")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        spec = Tools.of(tools, tool_choice, parallel_tool_calls)
        params = sampling_params or SamplingParams()
        texts, prompts, plist, openings = [], [], [], []
        for c, conv in enumerate(convs):
            rendered = [template_message(m, f"messages[{c}][{i}]")  # type: ignore[arg-type]
                        for i, m in enumerate(conv)]
            text = tok.apply_chat_template(
                rendered, add_generation_prompt=True, **(chat_template_kwargs or {}),
                **({"tools": spec.for_template()} if spec is not None else {}))
            opened = thinking(text)
            texts.append(text)
            prompts.append(tok.encode(text, add_special_tokens=False))
            plist.append(dataclasses.replace(params, structured_outputs=constraint(
                params.structured_outputs, spec, opened)))
            openings.append(opened)
        results = []
        for res, text, opened in zip(self.generate(prompts, plist, use_progress=use_progress),
                                     texts, openings, strict=True):
            outs = []
            for o in res.outputs:
                parser = ChatParser(opened, spec)
                parser.feed(o.text, final=True)
                outs.append(dataclasses.replace(o, message=parser.message(),
                                                finish_reason=parser.finish_reason(
                                                    o.finish_reason)))
            results.append(dataclasses.replace(res, prompt=text, outputs=outs))
        return results
