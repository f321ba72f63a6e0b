"""The model runner: owns the model, its kernel bundle and the cache, and runs one step.

``ModelRunner.run(scheduled)`` is the whole step on the model side (nano-vllm's
``ModelRunner.run``):

1. prepare -- the persistent ``InputBatch`` (``input_batch.py``) takes the ``SchedulerOutput``:
   the step's ``StepPlan`` (plain ints, sent once to the other tensor-parallel ranks), its
   ``StepMetadata`` (validated once; every layer's kernels read it), the packed ABI batch and the
   logits rows -- a decode successor advanced from the last step, anything else built from the
   scheduler's lists;
2. prefix-cache hits start from their checkpointed state (``restore_checkpoint``);
3. the executor the runner chose for the step by capability (``executors.py``: the whole decode
   step in one native call, fused decoder layers, or the model's modules) writes the KV pages and
   state slots in place and returns those rows' logits; a sequence with ``past_seqlens == 0`` starts
   from zero conv/recurrent state whatever its slot holds (pages are never zeroed: attention reads
   only a sequence's own positions);
4. prompt logprobs are recorded, and the sampler (``sampling.sample_requests``) picks the
   tokens (tensor in, tensor out, one host copy; the finite check rides in the greedy pick's
   pass): a row with non-finite logits, or whose sampling raises, fails its request alone; a
   constrained row is masked by its grammar before it picks, or -- greedy, or a draw from the
   whole distribution -- only after, where the grammar refuses its pick (then picked again
   under the mask: the same token, or the same odds); verify chunks keep their accepted
   drafts and one sampled token (``spec_decode/verify.py``).

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
from pathlib import Path
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
from pagedhybrid.engine.worker.executors import Executors
from pagedhybrid.engine.worker.input_batch import InputBatch, StepPlan
from pagedhybrid.engine.worker.sampling import advance, sample_requests
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.backend import Selection, select
from pagedhybrid.kernels.native import cpu_form, dense, set_pool_threads
from pagedhybrid.kernels.native import quant as native_quant
from pagedhybrid.kernels.step import StepMetadata, int_tensor
from pagedhybrid.kvquant import (
    KVScales,
    default_scales_path,
    dtype_name,
    is_quantized,
    load_scales,
)
from pagedhybrid.models.qwen35 import (
    PackedBatch,
    PagedHybridCache,
    Qwen35Config,
    Qwen35ForCausalLM,
    load,
)
from pagedhybrid.models.qwen35.weights import residence
from pagedhybrid.parallel import ParallelConfig

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


def load_model(model_dir: str | Path, dtype: torch.dtype, config: EngineConfig,
               parallel: ParallelConfig | None = None) -> Qwen35ForCausalLM:
    """This rank's model of the checkpoint in ``model_dir``, built with the kernel bundle the
    engine's needs choose (``EngineConfig.kernel_needs``: selected before a weight is read, a
    refusal names every bundle's reasons) and with its MTP head when the proposer drafts with
    it."""
    checkpoint = Qwen35Config.from_model_dir(model_dir)
    bundle = select(needs=config.kernel_needs(
        checkpoint.rank_local(parallel or ParallelConfig()), dtype)).backend
    spec = config.speculative
    return load(model_dir, dtype=dtype, backend=bundle, parallel=parallel,
                mtp=spec is not None and proposer_spec(spec).model_head)


class StepResult(NamedTuple):
    sampled: dict[str, list[SampledToken]]  # the tokens each request keeps, in order
    failed: list[tuple[Request, str]]  # requests that fail alone, with the reason
    prepare_s: float  # batch building and checkpoint restores (host work before the model)


class ModelRunner:
    """The model, its selected kernel bundle (the model's weights held as it multiplies) and,
    from ``allocate(sizes)`` on, the cache of KV pages, state slots and state checkpoints;
    ``run`` one step, ``score`` whole sequences."""

    cache: PagedHybridCache  # (allocate, as the two below)
    executors: Executors
    input_batch: InputBatch

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig, stats: EngineStats,
                 eos_token_ids: Sequence[int] = (), peers: Peers | None = None
                 ) -> None:
        self.model, self.config, self.stats = model, config, stats
        self.peers = peers  # rank 0 of a tensor-parallel group: the other ranks (distributed.py)
        self.eos_token_ids = tuple(eos_token_ids)
        # the EOS ids inside the logits' vocabulary (the grammars' and min_tokens' EOS)
        self._eos = [t for t in self.eos_token_ids if 0 <= t < model.config.vocab_size]
        spec = config.speculative
        self._mtp = spec is not None and proposer_spec(spec).model_head
        # the last step's metadata and requests, and its final-norm hidden [N, hidden]: the
        # MTP drafter's input (``forward_mtp``)
        self._hidden: tuple[StepMetadata, tuple[Request, ...]] | None = None
        self._head_in: torch.Tensor | None = None
        # what the engine needs goes into the choice (load_engine built the model with it)
        self.kernels: Selection = select(needs=config.kernel_needs(
            model.config, model.dtype, model.weight_format))
        if model.backend is not self.kernels.backend:  # a model built with another bundle
            model.use_backend(self.kernels.backend)
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
        self.executors = Executors(model, self.cache)  # the graph one where it binds
        self.input_batch = InputBatch(self.cache, config.device, config.max_num_seqs)
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
        mm = self.kernels.backend.modules.linear_for(self.model.dtype)
        parts.append("projections: " + ("torch" if mm is None else
                                        f"{mm.__module__.rsplit('.', 1)[-1]}.{mm.__name__}"))
        if self._native and self.model.dtype == torch.float32:
            small, mid, large = dense.fp32_gemm_timing()
            parts[-1] += (f" (timed at start: torch's fp32 GEMM {small:.2f}x the native "
                          f"kernel's time at 4 rows, {mid:.2f}x at 32, {large:.2f}x at 256)")
        elif mm is not None and self._native and dense.bf16_dot():
            parts[-1] += (f" (timed at start: torch's bf16 GEMM {dense.bf16_gemm_timing():.2f}x"
                          " the widened fp32 GEMM's time at 256 rows)")
        fmt, qm = self.model.weight_format, self.kernels.backend.modules.quantized_linear
        if fmt is not None and qm is not None:
            parts.append(f"{fmt.name} weights: {qm.__module__.rsplit('.', 1)[-1]}.{qm.__name__}"
                         + (f" ({native_quant.int_dot()})" if self._native else ""))
        parts.append(self.executors.describe())
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
        step = self.input_batch
        plan = step.update(scheduled)
        if self.peers is not None:  # the step's plan, once, to the other ranks
            self.peers.send("step", plan)
        for row, slot in plan.restores:  # prefix hits start from their checkpointed state
            self.cache.restore_checkpoint(row, slot)
        t1 = time.perf_counter()
        hidden: list[torch.Tensor] | None = [] if self._mtp else None
        self._hidden = None
        execute = self.executors.choose(
            step.meta, step.meta.num_tokens if step.rows is None else step.rows.shape[0])
        with self._collective():
            logits = execute(step.batch, self.cache, step.rows, step.meta, hidden)  # [R, V]
        if hidden:
            self._hidden, self._head_in = (step.meta, step.requests), hidden[0]
        t2 = time.perf_counter()
        for seq, first, row, count in plan.prompt_spans:
            req = scheduled.sequences[seq].request
            targets = req.token_ids[first + 1:first + 1 + count]
            req.record_prompt_logprobs(first, logprob_dicts(
                logits[row:row + count], targets, req.params.prompt_logprobs or 0))
        sampled: dict[str, list[SampledToken]] = {}
        failed: list[tuple[Request, str]] = []
        if plan.sampling:
            reqs = [scheduled.sequences[i].request for i in plan.sampling]
            rows = logits
            if len(plan.sample_rows) != logits.shape[0]:  # (distinct rows, ascending)
                rows = logits[list(plan.sample_rows)]  # [S, V] (prompt logprobs' rows left out)
            sampled, failed = sample_requests(rows, reqs, self._eos, st)
        if plan.verify_rows:
            seqs = [scheduled.sequences[i] for i, _ in plan.verify_rows]
            eos = self._eos
            masks = [None if s.request.matcher is None else draft_masks(
                s.request.matcher, s.drafts, logits.shape[1], eos) for s in seqs]
            for s, kept in zip(seqs, verify(logits, [s.request for s in seqs],
                                            [s.drafts for s in seqs],
                                            [r for _, r in plan.verify_rows], masks),
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
        and metadata as rank 0's (``InputBatch.replay``), the forward over this rank's shard of
        the pages and state slots, no logits (rank 0 samples)."""
        step = self.input_batch
        step.replay(plan)
        for row, slot in plan.restores:
            self.cache.restore_checkpoint(row, slot)
        hidden: list[torch.Tensor] | None = [] if self._mtp else None
        self.model.forward_packed(step.batch, self.cache, _NO_ROWS, step.meta, hidden)
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
        c, step = self.cache, self.input_batch
        meta = step.meta if step.built else None
        return {"num_pages": c.num_pages, "num_slots": c.num_slots,
                "num_checkpoints": c.num_checkpoints,
                "last_step": None if meta is None else (meta.q_lens, meta.past_lens)}

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
