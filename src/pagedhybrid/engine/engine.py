"""The request-level engine: add / abort / step / stream over one Qwen3.5 model.

One ``step()``:

1. ``Scheduler.schedule()`` picks this step's chunks (decodes and prefill chunks mixed) under
   the token budget, admitting into KV pages and state slots atomically, preempting by recompute
   when pages run out.
2. ``build_batch`` packs them into the model's ``PackedBatch`` -- exactly the packed ABI
   (``input_ids[N]``, ``position_ids[3, N]``, ``cu_seqlens[B+1]``, ``past_seqlens[B]``,
   ``block_table[B, M]`` (``-1`` padded), ``state_slots[B]``, ``attention_metadata[3]``) -- and
   the logits rows: the last row of every chunk that reaches its request's last known token,
   and, for requests that asked for ``prompt_logprobs``, the rows of the prompt positions in the
   chunk that predict a prompt token.
3. ``model.forward_packed`` writes the KV pages and state slots in place and returns those rows'
   logits. A sequence with ``past_seqlens == 0`` (first admission, or re-admission after
   preemption) starts from zero conv/recurrent state whatever its slot holds; pages are never
   zeroed (attention reads only ``past + new`` positions of a sequence's own table).
4. ``sample`` picks the tokens (per-request generators); a row with non-finite logits finishes
   its request with reason ``error`` and leaves the others alone; ``Scheduler.update`` advances
   cursors, appends tokens and finishes requests on stop token / EOS / max_tokens /
   max_model_len, returning their pages and slots at once.

``step`` returns one ``RequestOutput`` per request that got a token or finished (aborts are
reported by the next ``step``). ``stats`` splits wall time into scheduling, batch building,
forward, sampling and bookkeeping.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedhybrid.engine.config import EngineConfig, size_pools, slot_bytes
from pagedhybrid.engine.pages import BlockPool
from pagedhybrid.engine.request import InvalidRequest, Request, RequestOutput, RequestStatus
from pagedhybrid.engine.sampling import (
    SampledToken,
    SamplingParams,
    bad_word_bans,
    bad_words_token_ids,
    logprob_dicts,
    sample,
)
from pagedhybrid.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedhybrid.engine.states import CheckpointPool, StatePool
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.backend import Selection, select
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.kvquant import (
    KVScales,
    default_scales_path,
    dtype_name,
    is_quantized,
    load_scales,
)
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, Qwen35ForCausalLM


@dataclass
class EngineStats:
    """Cumulative counters; times in seconds."""

    steps: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of requests that finished
    generated_tokens: int = 0
    computed_tokens: int = 0  # tokens fed to the model (prefill chunks, recompute, decodes)
    preemptions: int = 0
    step_failures: int = 0  # steps that raised (their requests failed, serving went on)
    pool_rebuilds: int = 0  # of those, the ones whose pools had to be rebuilt
    peak_running: int = 0
    peak_blocks: int = 0
    # per step: (sequences, tokens, scheduling + batch building s, whole step s)
    step_log: list[tuple[int, int, float, float]] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.build_s + self.forward_s + self.sample_s + self.update_s

    @property
    def overhead_fraction(self) -> float:
        """(scheduling + batch building) / step time."""
        return (self.schedule_s + self.build_s) / self.total_s if self.total_s else 0.0

    def overhead_at(self, min_seqs: int) -> tuple[float, int]:
        """Overhead fraction over the steps that ran at least ``min_seqs`` sequences, and how
        many such steps there were."""
        rows = [(o, t) for n, _, o, t in self.step_log if n >= min_seqs]
        total = sum(t for _, t in rows)
        return (sum(o for o, _ in rows) / total if total else 0.0), len(rows)


class PromptSpan(NamedTuple):
    """Logits rows ``[row, row + count)`` score prompt tokens ``first + 1 ... first + count`` of
    sequence ``seq`` of the step."""

    seq: int
    first: int
    row: int
    count: int


class StepBatch(NamedTuple):
    """A scheduled step as the model sees it, and what its logits rows are for."""

    batch: PackedBatch
    meta: StepMetadata  # validated once here; every layer's kernels read it
    rows: torch.Tensor  # int64 [R]: token rows whose logits are computed
    sampling: list[int]  # sequences that sample this step
    sample_rows: list[int]  # their positions in ``rows``
    prompt_spans: list[PromptSpan]  # prompt-logprob rows


def build_batch(output: SchedulerOutput, cache: PagedHybridCache, device: str = "cpu"
                ) -> StepBatch:
    """The packed ABI batch of a scheduled step, its step metadata and its logits rows."""
    seqs = output.sequences
    tables = [s.block_table for s in seqs]
    batch = PackedBatch.from_sequences(
        [s.request.token_ids[s.start:s.start + s.num_new_tokens] for s in seqs],
        [s.start for s in seqs], tables, [s.slot for s in seqs], device=device)
    meta = StepMetadata.build([s.num_new_tokens for s in seqs], [s.start for s in seqs],
                              batch.block_table, [s.slot for s in seqs],
                              block_size=cache.block_size, num_pages=cache.num_pages,
                              num_slots=cache.num_slots, device=device,
                              checkpoints=[(i, off, row) for i, s in enumerate(seqs)
                                           for off, row in s.checkpoints],
                              num_checkpoints=cache.num_checkpoints)
    rows: list[int] = []
    sampling, sample_rows, spans = [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        req = s.request
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_done:
            hi = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)  # last scored + 1
            if hi > s.start:
                spans.append(PromptSpan(i, s.start, len(rows), hi - s.start))
                rows.extend(range(offset, offset + hi - s.start))
        if s.samples:
            sampling.append(i)
            sample_rows.append(len(rows))
            rows.append(offset + s.num_new_tokens - 1)
        offset += s.num_new_tokens
    return StepBatch(batch, meta, torch.tensor(rows, dtype=torch.int64, device=device),
                     sampling, sample_rows, spans)


class Engine:
    """Continuous-batching engine over a loaded ``Qwen35ForCausalLM``."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig | None = None,
                 tokenizer: object | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        mc = model.config
        self.kernels: Selection = select(self.config.backend, mc, model.dtype,
                                         batch_invariant=self.config.batch_invariant)
        model.backend = self.kernels.backend
        if self.kernels.backend.name not in ("native", "native_batch_invariant") and \
                self.config.backend == "auto":
            print(f"pagedhybrid: {self.kernels.reason}", file=sys.stderr)
        sizes = size_pools(mc, self.config, model.dtype)
        self.sizes = sizes
        gen = torch.Generator().manual_seed(self.config.seed)
        if self.config.enable_prefix_caching and \
                "state_checkpoints" not in self.kernels.backend.features:
            raise UnsupportedConfiguration(
                f"EngineConfig.enable_prefix_caching: the {self.kernels.backend.name!r} kernels "
                "cannot emit the linear layers' intermediate states (state checkpoints); use "
                "backend native or torch, or enable_prefix_caching=False")
        kvd = self.config.page_dtype(model.dtype)
        self.cache = PagedHybridCache.allocate(
            mc, num_pages=sizes.num_blocks, block_size=self.config.block_size,
            num_slots=sizes.num_slots, dtype=model.dtype, device=self.config.device,
            fill=self.config.cache_fill, generator=gen, num_checkpoints=sizes.num_checkpoints,
            kv_dtype=kvd, kv_scales=self._kv_scales(kvd) if is_quantized(kvd) else None)
        self.eos_token_ids = tuple(mc.eos_token_id) or tuple(
            getattr(tokenizer, "eos_token_ids", ()) or ())
        self._make_pools()
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._arrivals = 0
        self._pending: list[RequestOutput] = []
        self.stats = EngineStats()

    def _make_pools(self) -> None:
        """Fresh page, slot and checkpoint pools and a scheduler over them."""
        sizes, caching = self.sizes, self.config.enable_prefix_caching
        self.blocks = BlockPool(sizes.num_blocks, self.config.block_size, caching=caching)
        self.states = StatePool(sizes.num_slots)
        self.checkpoints = CheckpointPool(sizes.num_checkpoints) if caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                            sizes.max_model_len),
            self.blocks, self.states, self.eos_token_ids, self.checkpoints,
            self.config.checkpoint_interval, self.config.prefix_cache_key)

    def _kv_scales(self, kvd: torch.dtype) -> dict[int, KVScales]:
        cfg, mc = self.config, self.model.config
        path = cfg.kv_scales
        if path is None:
            src = self.model.source_dir
            default = None if src is None else default_scales_path(src, kvd, cfg.kv_quant)
            if default is None or not default.is_file():
                raise ContractViolation(
                    "EngineConfig", "kv_scales",
                    f"is required for kv_cache_dtype={cfg.kv_cache_dtype!r}: no scale file "
                    f"given and none beside the checkpoint ({default}); run `pagedhybrid "
                    f"calibrate-kv --dtype {dtype_name(kvd)} --quant {cfg.kv_quant}`", None)
            path = str(default)
        scales, _ = load_scales(path, mc.full_attention_layers, mc.num_key_value_heads,
                                mc.head_dim, kvd, cfg.kv_quant)
        return {i: KVScales(s.k.to(cfg.device), s.v.to(cfg.device)) for i, s in scales.items()}

    def score(self, prompts: Sequence[str | Sequence[int]],
              completions: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """Each completion token's fp32 log-probability after its prompt, from one full forward
        per sequence (``engine/score.py``): the training-side recompute."""
        from pagedhybrid.engine.score import score

        return score(self, prompts, completions)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a request. ``prompt``: text (tokenised with the model's tokenizer) or token ids.

        Raises ``InvalidRequest`` (empty prompt, bad token ids, duplicate id, text without a
        tokenizer) or ``CapacityError`` (the prompt can never fit); nothing is queued then.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(str(request_id), "request_id", "must be a non-empty str",
                                 type(request_id).__name__)
        if request_id in self.scheduler.requests:
            raise InvalidRequest(request_id, "request_id", "is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(request_id, "params", "must be SamplingParams",
                                 type(params).__name__)
        ids = self._token_ids(request_id, prompt)
        try:
            params.check_vocab(self.model.config.vocab_size)
        except ContractViolation as exc:
            raise InvalidRequest(request_id, exc.where, exc.rule, exc.got) from None
        bad_words: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequest(request_id, "bad_words", "needs the model's tokenizer")
            enc = self.tokenizer.encode  # type: ignore[attr-defined]
            bad_words = bad_words_token_ids(params.bad_words,
                                            lambda t: list(enc(t, add_special_tokens=False)))
        gen = (torch.Generator().manual_seed(params.seed) if params.seed is not None
               else self._generator)
        req = Request(request_id, tuple(ids), params, self._arrivals, gen,
                      bad_word_ids=bad_words)
        self.scheduler.add(req)  # CapacityError when it can never fit
        self._arrivals += 1

    def _token_ids(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(request_id, "prompt", "is text but the model has no "
                                     "tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(prompt))  # type: ignore[attr-defined]
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.reshape(-1).tolist()
            try:
                ids = list(prompt)
            except TypeError:
                raise InvalidRequest(request_id, "prompt", "must be text or a sequence of "
                                     "token ids", type(prompt).__name__) from None
        if not ids:
            raise InvalidRequest(request_id, "prompt", "is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(request_id, "prompt_token_ids",
                                 f"must be ints in [0, {vocab})", bad[:5])
        return ids

    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        """Abort requests now (pages and slots freed at once); returns the ids found."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        done = []
        for rid in ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                self._pending.append(self._output(req))
                done.append(rid)
        return done

    def fail_requests(self, requests: Iterable[Request], why: str) -> list[RequestOutput]:
        """Finish ``requests`` now with reason ``error`` and message ``why``."""
        outputs = []
        for req in requests:
            if not req.finished:
                self.scheduler.finish(req, "error", why)
                outputs.append(self._output(req))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step (see the module docstring). A step that raises (a bug, never a
        request's input) does not stop the engine: that step's requests finish with reason
        ``error``, the pools are checked (and rebuilt if they do not add up) and the next
        step serves the others."""
        outputs, self._pending = self._pending, []
        sched: SchedulerOutput | None = None
        try:
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            self.stats.schedule_s += time.perf_counter() - t0
            self.stats.preemptions += len(sched.preempted)
            if sched.sequences:
                self._run(sched, t0, outputs)
        except Exception as exc:  # the engine must outlive a faulty step
            outputs.extend(self._fail_step(sched, exc))
        outputs.extend(self._output(r) for r in self.scheduler.take_failed())
        return outputs

    def _run(self, sched: SchedulerOutput, t0: float, outputs: list[RequestOutput]) -> None:
        st = self.stats
        t1 = time.perf_counter()
        step = build_batch(sched, self.cache, self.config.device)
        for s in sched.sequences:  # prefix hits start from their checkpointed state
            if s.restore is not None:
                self.cache.restore_checkpoint(s.restore, s.slot)
        t2 = time.perf_counter()
        logits = self.model.forward_packed(step.batch, self.cache, step.rows,
                                           step.meta)  # [R, V]
        t3 = time.perf_counter()
        for span in step.prompt_spans:
            req = sched.sequences[span.seq].request
            targets = req.token_ids[span.first + 1:span.first + 1 + span.count]
            req.record_prompt_logprobs(span.first, logprob_dicts(
                logits[span.row:span.row + span.count], targets, req.params.prompt_logprobs or 0))
        sampled: dict[str, SampledToken] = {}
        failed: list[tuple[Request, str]] = []
        if step.sampling:
            seqs = [sched.sequences[i] for i in step.sampling]
            logits = logits[step.sample_rows]  # [S, V]
            finite = torch.isfinite(logits).all(dim=-1).tolist()  # [S]
            ok = [j for j, f in enumerate(finite) if f]
            failed = [(seqs[j].request, "non-finite logits") for j, f in enumerate(finite)
                      if not f]
            if ok:
                sampled, errors = self._sample(logits[ok], [seqs[j].request for j in ok])
                failed.extend(errors)
        t4 = time.perf_counter()
        for req, why in failed:
            self.scheduler.finish(req, "error", why)
            if self.checkpoints is not None:  # never keep states of a failed computation
                seq = next(s for s in sched.sequences if s.request is req)
                self.checkpoints.discard(row for _, row in seq.checkpoints)
        self.scheduler.update(sched, sampled)
        for s in sched.sequences:
            req = s.request
            if req.finished or req.num_output_tokens > req.num_emitted:
                outputs.append(self._output(req))
                if req.finished:
                    st.prompt_tokens += req.num_prompt_tokens
        st.steps += 1
        st.computed_tokens += sched.num_batched_tokens
        st.generated_tokens += len(sampled)
        st.peak_running = max(st.peak_running, len(sched.sequences))
        st.peak_blocks = max(st.peak_blocks, self.blocks.num_owned)
        t5 = time.perf_counter()
        st.step_log.append((len(sched.sequences), sched.num_batched_tokens, t2 - t0, t5 - t0))
        st.build_s += t2 - t1
        st.forward_s += t3 - t2
        st.sample_s += t4 - t3
        st.update_s += t5 - t4

    def _sample(self, rows: torch.Tensor, reqs: list[Request]
                ) -> tuple[dict[str, SampledToken], list[tuple[Request, str]]]:
        """Tokens of ``reqs`` from their logits ``rows [S, V]``; a request whose sampling raises
        fails alone (the rows are then sampled one by one)."""
        vocab = rows.shape[1]
        eos = [t for t in self.eos_token_ids if 0 <= t < vocab]
        banned = [([*r.params.stop_token_ids, *(() if r.params.ignore_eos else eos)]
                   if r.num_output_tokens < r.params.min_tokens else [])
                  + (bad_word_bans(r.bad_word_ids, r.output_token_ids) if r.bad_word_ids
                     else []) for r in reqs]
        params = [r.params for r in reqs]
        gens = [r.generator for r in reqs]
        try:
            toks = sample(rows, params, gens, reqs, banned if any(banned) else None)
            return {r.request_id: t for r, t in zip(reqs, toks, strict=True)}, []
        except Exception:  # find the row that fails, keep the others
            sampled, failed = {}, []
            for j, r in enumerate(reqs):
                try:
                    (tok,) = sample(rows[j:j + 1], params[j:j + 1], gens[j:j + 1], reqs[j:j + 1],
                                    banned[j:j + 1])
                    sampled[r.request_id] = tok
                except Exception as exc:
                    failed.append((r, f"sampling failed: {type(exc).__name__}: {exc}"))
            return sampled, failed

    def _fail_step(self, sched: SchedulerOutput | None, exc: Exception) -> list[RequestOutput]:
        """A step raised: fail its requests (all running ones when scheduling itself raised),
        drop the step's checkpoint writes, check the pools; rebuild them if they do not add up
        (every request then fails: nothing else can be trusted)."""
        why = f"internal error in an engine step: {type(exc).__name__}: {exc}"
        print(f"pagedhybrid: {why}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        self.stats.step_failures += 1
        victims = ([s.request for s in sched.sequences] if sched is not None
                   else list(self.scheduler.running))
        if self.checkpoints is not None:
            self.checkpoints.abandon()
        outputs = self.fail_requests(victims, why)
        try:
            self.check_invariants()
        except Exception as broken:
            print(f"pagedhybrid: pools inconsistent after the failed step ({broken}); "
                  "failing every request and rebuilding them", file=sys.stderr)
            everyone = list(self.scheduler.requests.values())
            for req in everyone:
                req.status, req.finish_reason, req.error = (RequestStatus.FINISHED, "error",
                                                            why)
                outputs.append(self._output(req))
            self._make_pools()
            self.stats.pool_rebuilds += 1
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request is finished, yielding outputs as they come (requests may be
        added or aborted between yields)."""
        while self.has_unfinished_requests():
            yield from self.step()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def prefix_cache_stats(self) -> dict[str, float | int]:
        """Prefix-cache counters: lookups, hits, tokens looked up / served, evictions, and the
        memory of the checkpoint pool (all zero when prefix caching is off)."""
        st = self.scheduler.alloc.stats
        ck = self.checkpoints
        return {
            "queries": st.queries, "hits": st.hits, "query_tokens": st.query_tokens,
            "hit_tokens": st.hit_tokens,
            "hit_rate": st.hits / st.queries if st.queries else 0.0,
            "cached_token_fraction": st.hit_tokens / st.query_tokens if st.query_tokens else 0.0,
            "page_evictions": self.blocks.evictions, "cached_pages": self.blocks.num_cached,
            "checkpoints_written": st.checkpoints_written,
            "checkpoint_evictions": ck.evictions if ck is not None else 0,
            "cached_checkpoints": ck.num_cached if ck is not None else 0,
            "checkpoint_bytes": (ck.capacity if ck is not None else 0) * slot_bytes(
                self.model.config, self.model.dtype),
        }

    # -- outputs ---------------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        out = req.output_token_ids
        new = out[req.num_emitted:]
        req.num_emitted = len(out)
        text = None
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(out)  # type: ignore[attr-defined]
            except Exception:  # text stays None; the token ids are reported all the same
                text = None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=tuple(new),
            token_ids=tuple(out),
            finished=req.finished,
            finish_reason=req.finish_reason,
            text=text,
            logprobs=tuple(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=(tuple(req.prompt_logprobs) if req.params.prompt_logprobs is not None
                             and req.prompt_logprobs_done else None),
            error=req.error,
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
        )
