"""The model runner: owns the model, its kernel bundle and the cache, and runs one step.

``ModelRunner.run(scheduled)`` is the whole step on the model side (nano-vllm's
``ModelRunner.run``):

1. prepare -- ``build_batch`` turns the ``SchedulerOutput`` into the step's packed ABI batch
   (``input_ids[N]``, ``position_ids[3, N]``, ``cu_seqlens[B+1]``, ``past_seqlens[B]``,
   ``block_table[B, M]`` (``-1`` padded), ``state_slots[B]``, ``attention_metadata[3]``), its
   ``StepMetadata`` (validated once; every layer's kernels read it) and the logits rows: the last
   row of every chunk that reaches its request's last known token, and, for requests that asked
   for ``prompt_logprobs``, the rows of the prompt positions in the chunk that predict a prompt
   token, and every row of a speculative verify chunk (its last token and its drafts). A decode
   step of the same requests as the last one, one token further on the same
   pages, is the last step advanced (``StepMetadata.advance``: the new values written into the
   persistent ``DecodeInputs`` buffers) rather than built again from the lists -- vLLM's
   persistent batch;
2. prefix-cache hits start from their checkpointed state (``restore_checkpoint``);
3. ``model.forward_packed`` writes the KV pages and state slots in place and returns those rows'
   logits; a sequence with ``past_seqlens == 0`` starts from zero conv/recurrent state whatever
   its slot holds (pages are never zeroed: attention reads only a sequence's own positions);
4. prompt logprobs are recorded, and the sampler (``step_sampling.sample_requests``) picks the
   tokens (tensor in, tensor out, one host copy; the finite check rides in the greedy pick's
   pass): a row with non-finite logits, or whose sampling raises, fails its request alone; a
   constrained row is masked by its grammar before it picks, or -- greedy, or a draw from the
   whole distribution -- only after, where the grammar refuses its pick (then picked again
   under the mask: the same token, or the same odds); verify chunks keep their accepted
   drafts and one sampled token (``speculative.verify``).

It returns a ``StepResult`` (the tokens each request keeps, failed requests with a reason); the
engine applies it to the scheduler, whose update hands the verify chunks' accepted states back
to ``commit`` (``PagedHybridCache.commit_verified``: replayed from the step's capsules).

``score(pairs)`` is the training-side recompute: each
``prompt + completion`` as one whole sequence (packed back to back, each from zero state, no
prefix reuse, no chunking, no scheduler) over transient buffers sized exactly for them --
contiguous pages of the runner's block size and element type (and KV scales, so quantized pages
are quantized alike) and one state row per sequence; the step's pools are not touched. Groups of
up to ``SCORE_TOKENS`` tokens go in one forward. Completion token ``j`` is scored from the logits
row of the token before it, with the very function the sampler uses for ``logprobs=0`` on a
one-row slice, in float32; with ``batch_invariant=True`` these equal, bitwise, the logprobs the
engine returned while generating the same tokens.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from pagedhybrid import openmp
from pagedhybrid.engine.core.config import EngineConfig, PoolSizes
from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.core.scheduler import Commit, SchedulerOutput
from pagedhybrid.engine.core.stats import EngineStats
from pagedhybrid.engine.sample.sampler import SampledToken, logprob_dicts
from pagedhybrid.engine.sample.structured import draft_masks
from pagedhybrid.engine.spec_decode.mtp import MtpCall
from pagedhybrid.engine.spec_decode.proposer import proposer_spec
from pagedhybrid.engine.spec_decode.verify import verify
from pagedhybrid.engine.worker.contention import ThreadGovernor
from pagedhybrid.engine.worker.sampling import advance, sample_requests
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.backend import Needs, Selection, select
from pagedhybrid.kernels.native import cpu_form, dense, set_pool_threads
from pagedhybrid.kernels.native import quant as native_quant
from pagedhybrid.kernels.step import DecodeInputs, StepMetadata, int_tensor
from pagedhybrid.kvquant import (
    KVScales,
    default_scales_path,
    dtype_name,
    is_quantized,
    load_scales,
)
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, Qwen35ForCausalLM
from pagedhybrid.models.qwen35.weights import residence

_NO_ROWS = torch.empty(0, dtype=torch.int64)  # a rank other than 0 computes no logits
SCORE_TOKENS = 8192  # tokens per scoring forward (whole sequences; a longer one goes alone)


class Peers(Protocol):
    """The other tensor-parallel ranks as rank 0's runner drives them
    (``distributed.TensorParallelGroup``)."""

    dead: str | None  # why they are gone (None: serving)

    def send(self, kind: str, payload: Any) -> None: ...

    def allocate(self, sizes: PoolSizes) -> None: ...

    def collective(self) -> contextlib.AbstractContextManager[None]: ...

    def close(self, timeout: float = ...) -> None: ...


class PromptSpan(NamedTuple):
    """Logits rows ``[row, row + count)`` score prompt tokens ``first + 1 ... first + count`` of
    sequence ``seq`` of the step."""

    seq: int
    first: int
    row: int
    count: int


class StepPlan(NamedTuple):
    """The step object: everything a tensor-parallel rank needs to run a step's forward, made
    once by rank 0 from the ``SchedulerOutput`` and sent to the other ranks as it is (plain
    ints; ``materialize`` turns it into the same batch and metadata on every rank).

    A decode successor (``write_slots`` given) is the last step's metadata advanced one token,
    writing those flat cache slots; any other step is built from its lists."""

    token_ids: Sequence[int]  # the step's input tokens, packed
    write_slots: Sequence[int] | None = None  # a decode successor's cache slots, one per sequence
    q_lens: Sequence[int] = ()
    starts: Sequence[int] = ()
    tables: Sequence[Sequence[int]] = ()
    slots: Sequence[int] = ()
    checkpoints: Sequence[tuple[int, int, int]] = ()
    verify: Sequence[int] = ()
    rows: Sequence[int] | None = None  # token rows whose logits are computed (None: all)
    restores: Sequence[tuple[int, int]] = ()  # (checkpoint row, state slot) before the forward


class StepBatch(NamedTuple):
    """A scheduled step as the model sees it, and what its logits rows are for."""

    batch: PackedBatch
    meta: StepMetadata  # validated once here; every layer's kernels read it
    rows: torch.Tensor | None  # int64 [R]: token rows whose logits are computed (None: all)
    sampling: list[int]  # sequences that sample this step (verify chunks aside)
    sample_rows: list[int]  # their positions in ``rows``
    prompt_spans: list[PromptSpan]  # prompt-logprob rows
    requests: tuple[Request, ...]  # the step's requests, in batch order
    verify: tuple[tuple[int, int], ...] = ()  # verify chunks: (sequence, first row in ``rows``)
    plan: StepPlan | None = None  # the step object the other tensor-parallel ranks run


class StepResult(NamedTuple):
    sampled: dict[str, list[SampledToken]]  # the tokens each request keeps, in order
    failed: list[tuple[Request, str]]  # requests that fail alone, with the reason
    prepare_s: float  # batch building and checkpoint restores (host work before the model)


def _successor_writes(output: SchedulerOutput, prev: StepBatch | None) -> list[int] | None:
    """The flat cache slot each sequence writes when ``output`` is the next decode step of
    exactly ``prev``'s requests, in the same order, each sampling its next token with nothing
    else to do (no restore, no checkpoint, no prompt logprobs: a one-token chunk that samples is
    past its prompt); else None."""
    if (prev is None or len(output.sequences) != len(prev.requests)
            or len(prev.sampling) != len(prev.requests) or prev.prompt_spans):
        return None  # (a prompt chunk of one token did not sample: its rows differ now)
    bs = prev.meta.block_size
    write = []
    for s, r, p in zip(output.sequences, prev.requests, prev.meta.past_lens, strict=True):
        if (s.request is not r or s.num_new_tokens != 1 or s.start != p + 1 or not s.samples
                or s.restore is not None or s.checkpoints
                or s.start // bs >= len(s.block_table)):
            return None
        write.append(s.block_table[s.start // bs] * bs + s.start % bs)
    return write


def _advanced_batch(prev: PackedBatch, meta: StepMetadata, ids: Sequence[int],
                    inputs: DecodeInputs | None, device: str) -> PackedBatch:
    """``prev``'s packed batch moved to the advanced ``meta`` with the new token ``ids``."""
    top = max(meta.past_lens) + 1
    if inputs is not None and len(ids) <= inputs.capacity:
        ids_t, attention, position_ids = inputs.tokens(ids, 1, top)
    else:
        ids_t = int_tensor(ids, torch.int64, device)
        attention = int_tensor((1, top, top), torch.int32, device)
        position_ids = meta.positions.view(1, -1).expand(3, -1)
    return prev._replace(input_ids=ids_t, position_ids=position_ids, past_seqlens=meta.past_t,
                         attention_metadata=attention)


def materialize(plan: StepPlan, cache: PagedHybridCache, device: str = "cpu",
                prev: tuple[PackedBatch, StepMetadata] | None = None,
                inputs: DecodeInputs | None = None
                ) -> tuple[PackedBatch, StepMetadata, torch.Tensor | None]:
    """The packed batch, metadata and logits rows of ``plan`` (a successor advances ``prev``,
    the last step's batch and metadata, as rank 0 advanced its own)."""
    if plan.write_slots is not None:
        if prev is None:
            raise ContractViolation("pagedhybrid.engine.StepPlan", "write_slots",
                                    "a decode successor needs the last step", None)
        meta = prev[1].advance(plan.write_slots, inputs)
        if meta is None:
            raise ContractViolation("pagedhybrid.engine.StepPlan", "write_slots",
                                    "must continue the last step's decodes", plan.write_slots)
        return _advanced_batch(prev[0], meta, plan.token_ids, inputs, device), meta, None
    meta = StepMetadata.build(plan.q_lens, plan.starts, plan.tables, plan.slots,
                              block_size=cache.block_size, num_pages=cache.num_pages,
                              num_slots=cache.num_slots, device=device,
                              checkpoints=plan.checkpoints,
                              num_checkpoints=cache.num_checkpoints, verify=plan.verify)
    rows = None if plan.rows is None else int_tensor(plan.rows, torch.int64, device)
    return PackedBatch.from_metadata(meta, plan.token_ids, device), meta, rows


def build_batch(output: SchedulerOutput, cache: PagedHybridCache, device: str = "cpu",
                prev: StepBatch | None = None, inputs: DecodeInputs | None = None
                ) -> StepBatch:
    """The step object of a scheduled step (``StepPlan``), its packed ABI batch, step metadata
    and logits rows. When the step is ``prev``'s decode successor, its metadata is ``prev``'s
    advanced one token (vLLM's persistent batch: no lists are walked and nothing is validated
    again), its new tensors written into ``inputs`` when given (CPU)."""
    seqs = output.sequences
    reqs = tuple(s.request for s in seqs)
    write = _successor_writes(output, prev)
    meta = None if write is None or prev is None else prev.meta.advance(write, inputs)
    if meta is not None:
        assert prev is not None and write is not None
        ids = [r.token_ids[p] for r, p in zip(reqs, meta.past_lens, strict=True)]
        return StepBatch(_advanced_batch(prev.batch, meta, ids, inputs, device), meta, None,
                         prev.sampling, prev.sample_rows, [], reqs, (), StepPlan(ids, write))
    rows: list[int] = []
    sampling, sample_rows, spans, verify = [], [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        req = s.request
        if s.drafts:  # every row of a verify chunk
            verify.append((i, len(rows)))
            rows.extend(range(offset, offset + s.num_new_tokens))
            offset += s.num_new_tokens
            continue
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
    every = len(rows) == offset and rows == list(range(offset))  # a decode step: all rows
    # the step's metadata is built (and validated) once from the scheduler's lists; the packed
    # ABI batch is a view of its tensors plus the token ids
    plan = StepPlan(
        [t for s in seqs for t in (
            *s.request.token_ids[s.start:s.start + s.num_new_tokens - len(s.drafts)],
            *s.drafts)],
        None, [s.num_new_tokens for s in seqs], [s.start for s in seqs],
        [s.block_table for s in seqs], [s.slot for s in seqs],
        [(i, off, row) for i, s in enumerate(seqs) for off, row in s.checkpoints],
        [i for i, s in enumerate(seqs) if s.drafts], None if every else rows,
        [(s.restore, s.slot) for s in seqs if s.restore is not None])
    batch, meta, rows_t = materialize(plan, cache, device)
    return StepBatch(batch, meta, rows_t, sampling, sample_rows, spans, reqs, tuple(verify),
                     plan)


class ModelRunner:
    """The model, its selected kernel bundle (the model's weights held as it multiplies) and,
    from ``allocate(sizes)`` on, the cache of KV pages, state slots and state checkpoints;
    ``run`` one step, ``score`` whole sequences."""

    cache: PagedHybridCache

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig, stats: EngineStats,
                 eos_token_ids: Sequence[int] = (), peers: Peers | None = None
                 ) -> None:
        self.model, self.config, self.stats = model, config, stats
        self.peers = peers  # rank 0 of a tensor-parallel group: the other ranks (distributed.py)
        self.eos_token_ids = tuple(eos_token_ids)
        # the EOS ids inside the logits' vocabulary (the grammars' and min_tokens' EOS)
        self._eos = [t for t in self.eos_token_ids if 0 <= t < model.config.vocab_size]
        self._last: StepBatch | None = None  # the last step (its successor reuses its tensors)
        spec = config.speculative
        self._mtp = spec is not None and proposer_spec(spec).model_head
        # the last step's metadata and requests, and its final-norm hidden [N, hidden]: the
        # MTP drafter's input (``forward_mtp``)
        self._hidden: tuple[StepMetadata, tuple[Request, ...]] | None = None
        self._head_in: torch.Tensor | None = None
        self._inputs = (DecodeInputs(config.max_num_seqs)
                        if torch.device(config.device).type == "cpu" else None)
        mc = model.config
        kvd = config.page_dtype(model.dtype)
        # what the engine needs goes into the choice: auto never picks a bundle that cannot
        # serve prefix caching, the KV page dtype or batch invariance, and says why
        fmt = config.weight_format or model.weight_format
        self.kernels: Selection = select(needs=Needs(
            backend=config.backend, dtype=model.dtype, config=mc,
            prefix_caching=config.enable_prefix_caching, kv_page_dtype=kvd,
            batch_invariant=config.batch_invariant,
            speculative=config.speculative is not None,
            weight_format=None if fmt is None else fmt.name))
        model.backend = self.kernels.backend
        huge = config.huge_pages and torch.device(config.device).type == "cpu"
        if config.weight_format is not None:
            model.quantize(config.weight_format, huge_pages=huge)
        if huge:
            model.hold_projections()  # (models/qwen35/weights.py)
        if self.kernels.backend.name not in ("native", "native_batch_invariant") and \
                config.backend == "auto":
            print(f"pagedhybrid: {self.kernels.reason}", file=sys.stderr)
        self.governor: ThreadGovernor | None = None
        if config.adaptive_threads and not config.batch_invariant and \
                config.tensor_parallel_size == 1:
            self.governor = ThreadGovernor(torch.get_num_threads(), self._set_threads)

    def allocate(self, sizes: PoolSizes) -> None:
        """The cache of ``sizes`` (the engine's memory plan), checked against the model once."""
        config, model = self.config, self.model
        mc, kvd = model.config, config.page_dtype(model.dtype)
        self.cache = PagedHybridCache.allocate(
            mc, num_pages=sizes.num_blocks, block_size=config.block_size,
            num_slots=sizes.num_slots, dtype=model.dtype, device=config.device,
            fill=config.cache_fill, generator=torch.Generator().manual_seed(config.seed),
            num_checkpoints=sizes.num_checkpoints, kv_dtype=kvd,
            kv_scales=self._kv_scales(kvd) if is_quantized(kvd) else None,
            capsule_capacity=config.speculative.capacity if config.speculative else 0,
            mtp=self._mtp)
        model.check_cache(self.cache)  # once: steps pass their validated metadata
        if self.peers is not None:  # every rank's pools have the same sizes
            self.peers.allocate(sizes)

    @property
    def _native(self) -> bool:
        return self.kernels.backend.name.startswith("native")

    def kernel_choice(self) -> str:
        """The bundle and why, and the native kernels' CPU form (measures nothing)."""
        return self.kernels.reason + (f"; CPU form {cpu_form()}" if self._native else "")

    def kernel_summary(self) -> str:
        """What runs: the bundle and why, the native kernels' CPU form, the projections."""
        parts = [self.kernel_choice()]
        mm = self.kernels.backend.linear_for(self.model.dtype)
        parts.append("projections: " + ("torch" if mm is None else
                                        f"{mm.__module__.rsplit('.', 1)[-1]}.{mm.__name__}"))
        if self._native and self.model.dtype == torch.float32:
            small, mid, large = dense.fp32_gemm_timing()
            parts[-1] += (f" (timed at start: torch's fp32 GEMM {small:.2f}x the native "
                          f"kernel's time at 4 rows, {mid:.2f}x at 32, {large:.2f}x at 256)")
        elif mm is not None and self._native and dense.bf16_dot():
            parts[-1] += (f" (timed at start: torch's bf16 GEMM {dense.bf16_gemm_timing():.2f}x"
                          " the widened fp32 GEMM's time at 256 rows)")
        fmt, qm = self.model.weight_format, self.kernels.backend.quantized_linear
        if fmt is not None and qm is not None:
            parts.append(f"{fmt.name} weights: {qm.__module__.rsplit('.', 1)[-1]}.{qm.__name__}"
                         + (f" ({native_quant.int_dot()})" if self._native else ""))
        parts.append(residence(self.model.arenas, self.config.huge_pages))
        if self._native:
            parts.append(openmp.summary())
        return "; ".join(parts)

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
                    f"given and none in the checkpoint's kv_scales/ ({default}); run "
                    f"`pagedhybrid calibrate-kv --dtype {dtype_name(kvd)} --quant "
                    f"{cfg.kv_quant}`", None)
            path = str(default)
        full = self.model.checkpoint_config.num_key_value_heads  # the file has every head's
        scales, _ = load_scales(path, mc.full_attention_layers, full, mc.head_dim, kvd,
                                cfg.kv_quant)
        # a tensor-parallel rank keeps its own KV heads' (per-channel scales are per head)
        first, count = self.model.parallel.owned(full, "num_key_value_heads", shared=True)

        def mine(t: torch.Tensor) -> torch.Tensor:
            return (t if t.numel() == 1 else t[first:first + count]).to(cfg.device)

        return {i: KVScales(mine(s.k), mine(s.v)) for i, s in scales.items()}

    def _set_threads(self, n: int) -> None:
        """torch's OpenMP team follows the governor; the native pool keeps the engine's threads
        (its helpers claim items as they get a core, so a descheduled one holds up only the item
        it runs: beside two busy processes a 16-request batch slowed 1.67x with the pool on two
        threads and 2.08x on one)."""
        assert self.governor is not None
        torch.set_num_threads(n)
        if self._native:
            set_pool_threads(self.governor.threads)

    # -- one step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, scheduled: SchedulerOutput) -> StepResult:
        st = self.stats
        t0 = time.perf_counter()
        if self.governor is not None:
            self.governor.tick()
        step = self._last = build_batch(scheduled, self.cache, self.config.device, self._last,
                                        self._inputs)
        assert step.plan is not None
        if self.peers is not None:  # the step object, once, to the other ranks
            self.peers.send("step", step.plan)
        for row, slot in step.plan.restores:  # prefix hits start from their checkpointed state
            self.cache.restore_checkpoint(row, slot)
        t1 = time.perf_counter()
        hidden: list[torch.Tensor] | None = [] if self._mtp else None
        self._hidden = None
        with self._collective():
            logits = self.model.forward_packed(step.batch, self.cache, step.rows,
                                               step.meta, hidden)  # [R, V]
        if hidden:
            self._hidden, self._head_in = (step.meta, step.requests), hidden[0]
        t2 = time.perf_counter()
        for span in step.prompt_spans:
            req = scheduled.sequences[span.seq].request
            targets = req.token_ids[span.first + 1:span.first + 1 + span.count]
            req.record_prompt_logprobs(span.first, logprob_dicts(
                logits[span.row:span.row + span.count], targets, req.params.prompt_logprobs or 0))
        sampled: dict[str, list[SampledToken]] = {}
        failed: list[tuple[Request, str]] = []
        if step.sampling:
            reqs = [scheduled.sequences[i].request for i in step.sampling]
            rows = logits
            if len(step.sample_rows) != logits.shape[0]:  # (distinct rows, ascending)
                rows = logits[step.sample_rows]  # [S, V] (rows of prompt logprobs left out)
            sampled, failed = sample_requests(rows, reqs, self._eos, st)
        if step.verify:
            seqs = [scheduled.sequences[i] for i, _ in step.verify]
            eos = self._eos
            masks = [None if s.request.matcher is None else draft_masks(
                s.request.matcher, s.drafts, logits.shape[1], eos) for s in seqs]
            for s, kept in zip(seqs, verify(logits, [s.request for s in seqs],
                                            [s.drafts for s in seqs],
                                            [r for _, r in step.verify], masks),
                               strict=True):
                if not isinstance(kept, str) and s.request.matcher is not None:
                    kept = advance(s.request.matcher, kept, eos)
                if isinstance(kept, str):
                    failed.append((s.request, kept))
                else:
                    sampled[s.request.request_id] = kept
        t3 = time.perf_counter()
        st.build_s += t1 - t0
        st.forward_s += t2 - t1
        st.sample_s += t3 - t2
        return StepResult(sampled, failed, t1 - t0)

    def _collective(self) -> contextlib.AbstractContextManager[None]:
        """Work the other ranks take part in: under tensor parallelism an exception in it
        leaves them inside a collective, so the group fails (``TensorParallelGroup.fail``)."""
        return contextlib.nullcontext() if self.peers is None else self.peers.collective()

    @torch.no_grad()
    def replay(self, plan: StepPlan) -> None:
        """A step on a tensor-parallel rank other than 0 (``distributed.py``): the same batch
        and metadata as rank 0's (``materialize``), the forward over this rank's shard of the
        pages and state slots, no logits (rank 0 samples)."""
        prev = None if self._last is None else (self._last.batch, self._last.meta)
        batch, meta, _ = materialize(plan, self.cache, self.config.device, prev, self._inputs)
        self._last = StepBatch(batch, meta, None, [], [], [], ())
        for row, slot in plan.restores:
            self.cache.restore_checkpoint(row, slot)
        hidden: list[torch.Tensor] | None = [] if self._mtp else None
        self.model.forward_packed(batch, self.cache, _NO_ROWS, meta, hidden)
        if hidden:
            self._head_in = hidden[0]

    @torch.no_grad()
    def forward_mtp(self, call: MtpCall) -> torch.Tensor:
        """The MTP head's catch-up and chains (``mtp.py``) on every rank: the greedy drafts,
        int64 ``[D, 1 + max(steps)]`` (a row's first maximum each; -1 where its logits are not
        finite, and past its chain's end) -- one native call where the bundle fuses it
        (``Qwen35ForCausalLM.mtp_draft``), else the catch-up (``forward_mtp``) and the chains
        (``mtp_chain``)."""
        if self.peers is not None:
            self.peers.send("mtp", call)
        with self._collective():
            cache, model = self.cache, self.model
            assert self._head_in is not None
            ids = int_tensor(call.token_ids, torch.int64)
            hidden = self._head_in.index_select(0, int_tensor(call.rows, torch.int64))
            fused = model.mtp_draft(ids, hidden, call.q_lens, call.past_lens, call.tables,
                                    call.picks, call.positions, call.steps, call.chain_tables,
                                    cache)
            if fused is not None:
                return fused[0]
            meta = StepMetadata.build(call.q_lens, call.past_lens, call.tables, call.slots,
                                      block_size=cache.block_size, num_pages=cache.num_pages,
                                      num_slots=call.num_slots, verify=call.verify)
            picks = int_tensor(call.picks, torch.int64)
            first, out = model.forward_mtp(ids, hidden, meta, cache, picks, greedy=True)
            chains, _ = model.mtp_chain(first, out.index_select(0, picks), call.positions,
                                        call.steps, call.chain_tables, cache)
            return torch.cat([first[:, None], chains], dim=1)

    def rank_state(self) -> dict[str, Any]:
        """This rank's cache geometry and last step's lengths (the group's invariants: every
        rank has the same pools and ran the same steps)."""
        c, last = self.cache, self._last
        return {"num_pages": c.num_pages, "num_slots": c.num_slots,
                "num_checkpoints": c.num_checkpoints,
                "last_step": None if last is None else (last.meta.q_lens, last.meta.past_lens)}

    def take_step(self) -> tuple[StepMetadata, tuple[Request, ...]] | None:
        """The last step's metadata and requests, once (the MTP drafter's input; None when
        there is no new step or the drafter is not MTP). Its hidden stays here
        (``forward_mtp``)."""
        out, self._hidden = self._hidden, None
        return out

    def commit(self, commits: Sequence[Commit]) -> None:
        """Verify chunks' accepted tokens into their state slots (``Scheduler.update``'s
        ``commit``), counted in the speculative-decoding stats."""
        self.commit_states([c.slot for c in commits], [c.count for c in commits],
                           [c.checkpoints for c in commits])
        for c in commits:
            self.stats.spec.record(c.proposed, c.accepted)
            c.request.spec_accepted += c.accepted
            c.request.spec_rejections += c.accepted < c.proposed

    def commit_states(self, slots: Sequence[int], counts: Sequence[int],
                      checkpoints: Sequence[Any]) -> None:
        """Replay each slot's first ``count`` verified tokens' state updates (every rank)."""
        if self.peers is not None:
            self.peers.send("commit", (list(slots), list(counts), list(checkpoints)))
        assert self.kernels.backend.capture is not None
        self.cache.commit_verified(self.kernels.backend.capture, slots, counts, checkpoints)

    # -- the training-side recompute ---------------------------------------------------------------
    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per (prompt ids, completion ids) pair, the completion tokens' log-probabilities
        (every tensor-parallel rank runs the same forwards; rank 0's logits are returned)."""
        if self.peers is not None:
            self.peers.send("score", [(list(p), list(c)) for p, c in pairs])
            with self._collective():
                return self._score(pairs)
        return self._score(pairs)

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in pairs]
        group: list[int] = []
        tokens = 0
        for i, (p, c) in enumerate(pairs):
            if group and tokens + len(p) + len(c) > SCORE_TOKENS:
                self._score_group(pairs, group, out)
                group, tokens = [], 0
            group.append(i)
            tokens += len(p) + len(c)
        if group:
            self._score_group(pairs, group, out)
        return out

    def _score_group(self, pairs: Sequence[tuple[list[int], list[int]]], group: list[int],
                     out: list[list[float]]) -> None:
        cfg, bs = self.model.config, self.config.block_size
        seqs = [pairs[i][0] + pairs[i][1] for i in group]
        tables, first = [], 0
        for n in (-(-len(s) // bs) for s in seqs):
            tables.append(list(range(first, first + n)))
            first += n
        cache = PagedHybridCache.allocate(
            cfg, num_pages=max(first, 1), block_size=bs, num_slots=len(seqs),
            dtype=self.model.dtype, kv_dtype=self.cache.kv_dtype,
            kv_scales=self.cache.kv_scales)
        batch = PackedBatch.from_sequences(seqs, [0] * len(seqs), tables, list(range(len(seqs))))
        rows, offset = [], 0
        for i, s in zip(group, seqs, strict=True):
            rows.extend(range(offset + len(pairs[i][0]) - 1, offset + len(s) - 1))
            offset += len(s)
        logits = self.model.forward_packed(batch, cache, torch.tensor(rows, dtype=torch.int64))
        r = 0
        for i in group:
            for tok in pairs[i][1]:
                out[i].append(logprob_dicts(logits[r:r + 1], [tok], 0)[0][tok].logprob)
                r += 1
