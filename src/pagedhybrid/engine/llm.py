"""``LLM``: offline batch generation on top of ``Engine`` (the vLLM ``LLM.generate`` habit).

``LLM(model=None)`` loads the built-in default model (``default_model_dir()``), or an HF Qwen3.5
checkpoint folder, with its tokenizer; ``generate(prompts, params)`` queues every prompt at once,
steps the engine until all are finished (a progress bar on stderr), prints one throughput line
(prompt tok/s, generated tok/s) and returns the final ``RequestOutput`` of each prompt in input
order. ``stream`` yields the outputs of every step instead. ``chat(messages, tools=...)`` renders
each conversation with the checkpoint's chat template and returns its answer parsed as the server
parses it (``engine/chat.py``: ``reasoning_content``, ``content``, ``tool_calls``; ``tool_choice``
``required`` or a named function forced by a grammar).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedhybrid import dtypes
from pagedhybrid.engine.chat import Tools, constraint, template_message, thinking
from pagedhybrid.engine.chat_parser import ChatParser
from pagedhybrid.engine.config import EngineConfig
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.request import InvalidRequest, RequestOutput
from pagedhybrid.engine.sampling import SamplingParams
from pagedhybrid.engine.structured import check
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, object]]

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a model may be loaded in
# their accepted names (--dtype choices): "auto" (the checkpoint's dtype), logical ("float32")
# and short ("fp32") spellings
DTYPE_SPELLINGS = ("auto", *dtypes.spellings(MODEL_DTYPES, kinds=("logical", "cli")))


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"`` is the dtype the checkpoint records
    (``config.json`` ``dtype``/``torch_dtype``: a bf16 checkpoint stays bf16, as vLLM and
    transformers load it), float32 when it records none the engine serves."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_SPELLINGS:
        raise ContractViolation("LLM", "dtype", f"must be one of {list(DTYPE_SPELLINGS)}", dtype)
    if dtype == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPE_SPELLINGS else "float32"
    return dtypes.to_torch(dtype)


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


@dataclass(frozen=True)
class ChatOutput:
    """One conversation's answer: the engine's output (token ids, raw text, logprobs) and
    OpenAI's assistant message of it (``content``, ``reasoning_content``, ``tool_calls``)."""

    output: RequestOutput
    message: dict[str, object]
    finish_reason: str | None


def load_engine(model: str | Path | None = None, *, dtype: str | torch.dtype = "auto",
                **config: object) -> Engine:
    """An ``Engine`` over a checkpoint folder (None = the built-in default model)."""
    from pagedhybrid.models.qwen35 import Qwen35Config, default_model_dir, load, load_tokenizer

    model_dir = default_model_dir() if model is None else Path(model)
    cfg = EngineConfig(**config)  # type: ignore[arg-type]
    checkpoint = Qwen35Config.from_model_dir(model_dir)
    mtp = cfg.speculative is not None and cfg.speculative.method == "mtp"
    if mtp and checkpoint.mtp_num_hidden_layers != 1:
        raise ContractViolation("speculative_config", "method",
                                f"'mtp' needs a checkpoint with an MTP head "
                                f"(mtp_num_hidden_layers=1 and mtp.* tensors); {model_dir} has "
                                f"mtp_num_hidden_layers={checkpoint.mtp_num_hidden_layers}",
                                "mtp")
    torch_dtype = resolve_dtype(dtype, checkpoint.checkpoint_dtype)
    peers = None
    if cfg.tensor_parallel_size > 1:  # the other ranks start and load while this one loads
        from pagedhybrid.engine.distributed import start_ranks

        peers = start_ranks(cfg, model_dir, torch_dtype)
    try:
        net = load(model_dir, dtype=torch_dtype, mtp=mtp,
                   parallel=None if peers is None else peers.parallel)
        try:
            tokenizer = load_tokenizer(model_dir, net.config.vocab_size)
        except UnsupportedConfiguration:
            tokenizer = None  # token-id prompts still work
        return Engine(net, cfg, tokenizer, peers)
    except BaseException:
        if peers is not None:
            peers.close(0.0)
        raise


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

    def _queue(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, str) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ContractViolation("LLM.generate", "sampling_params",
                                        "must be one SamplingParams or one per prompt",
                                        (len(plist), len(prompts)))
        self._batch += 1
        ids = [f"b{self._batch}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, plist, strict=True):  # a bad grammar is refused here, as vLLM's
            if p.structured_outputs is not None:     # front end does (the engine compiles it)
                try:
                    check(p.structured_outputs)
                except ContractViolation as exc:
                    raise InvalidRequest(rid, exc.where, exc.rule) from None
        queued: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, plist, strict=True):
                self.engine.add_request(rid, prompt, p)
                queued.append(rid)
        except Exception:
            self.engine.abort_request(queued)
            list(self.engine.stream())  # drain the abort outputs
            raise
        return ids

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Prompt]
              ) -> list[list[float]]:
        """The training-side recompute: each completion token's fp32 log-probability after its
        prompt (one full-sequence forward each; ``ModelRunner.score``). With
        ``batch_invariant=True`` they equal the engine's sampled-token logprobs bitwise."""
        return self.engine.score(prompts, completions)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Queue ``prompts`` and yield every step's outputs until all are finished."""
        self._queue(prompts, sampling_params)
        yield from self.engine.stream()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_progress: bool = True) -> list[RequestOutput]:
        """Final outputs in prompt order; prints a progress bar and a throughput line."""
        ids = self._queue(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        progress = None
        if use_progress:
            from rich.console import Console
            from rich.progress import Progress

            progress = Progress(console=Console(stderr=True), transient=False)
            progress.start()
            task = progress.add_task("generate", total=len(ids))
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
        results = [final[i] for i in ids]
        self.last_throughput = Throughput(
            len(results), sum(len(r.prompt_token_ids) for r in results),
            sum(len(r.token_ids) for r in results), elapsed)
        if use_progress:
            print(self.last_throughput.line(), file=sys.stderr)
        return results

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | None = None, *,
             tools: Sequence[Mapping[str, object]] | None = None, tool_choice: object = None,
             parallel_tool_calls: bool | None = None,
             chat_template_kwargs: Mapping[str, object] | None = None,
             use_progress: bool = True) -> list[ChatOutput]:
        """Answer one conversation (a list of OpenAI messages) or several: each rendered by
        the chat template with ``tools``, generated with ``sampling_params`` (its structured
        output, or the forced tool call of ``tool_choice``, applies after any reasoning), and
        parsed into an assistant message (module docstring)."""
        tok = self.engine.tokenizer
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise UnsupportedConfiguration("LLM.chat needs a checkpoint with a tokenizer and "
                                           "a chat template")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        spec = Tools.of(tools, tool_choice, parallel_tool_calls)
        params = sampling_params or SamplingParams()
        prompts, plist, parsers = [], [], []
        for c, conv in enumerate(convs):
            rendered = [template_message(m, f"messages[{c}][{i}]")  # type: ignore[arg-type]
                        for i, m in enumerate(conv)]
            text = tok.apply_chat_template(
                rendered, add_generation_prompt=True, **(chat_template_kwargs or {}),
                **({"tools": spec.for_template()} if spec is not None else {}))
            opened = thinking(text)
            prompts.append(tok.encode(text, add_special_tokens=False))
            plist.append(dataclasses.replace(params, structured_outputs=constraint(
                params.structured_outputs, spec, opened)))
            parsers.append(ChatParser(opened, spec))
        results = []
        for out, parser in zip(self.generate(prompts, plist, use_progress=use_progress),
                               parsers, strict=True):
            parser.feed(out.text or "", final=True)
            results.append(ChatOutput(out, parser.message(),
                                      parser.finish_reason(out.finish_reason)))
        return results
