"""The attention contract: what one standard-softmax attention call under TP/CP means.

Objects (frozen dataclasses, validated at construction, JSON round-trip via ``to_dict`` /
``from_dict``):

* ``ShardingSpec``   -- TP-local head ownership (contiguous, preserving the global GQA mapping
  ``kv_head = q_head // (Hq / Hkv)``) and CP block-to-token ownership: local block ``m`` holds
  local rows ``[local_block_offsets[m], local_block_offsets[m+1])`` = global tokens
  ``[global_block_token_starts[m], ... + length)`` with the stable logical id
  ``global_block_indices[m]``; contiguous and non-contiguous (zigzag) ownership alike.
  Packed varlen layouts add ``packed_sequence_offsets`` (local) and, under CP,
  ``global_packed_sequence_offsets`` (the packed stream in global token coordinates).
* ``ReductionSpec``  -- the only merge: fp32 partial states ``(out, attention-domain lse)``
  merged by ``online_softmax_lse`` in ``global_block_index`` order, one downcast at the final
  write; ``kv_block_size`` fixes the KV tile grid (in global token coordinates per sequence)
  that partial states are computed on, independent of the CP size.
* ``KVCacheSpec``    -- decode cache identity (``pagedhybrid.attention.kv_cache``).
* ``RoPESpec``       -- RoPE state of Q / K / cached K, theta, rotary_dim, positions, cast point
  and the fused/unfused RoPE+Attention boundary.
* ``AttentionContract`` -- role, mode, dtype, causal metadata and the objects above.

What a backend truthfully supports, and why a contract is out of its reach, is
``pagedhybrid.attention.capability`` (which reads contracts; this module does not read it).

Causal semantics (all modes): query row ``i`` (in-sequence index) of sequence ``b`` has logical
position ``causal_offsets[b] + i`` and attends to keys of the same sequence whose logical position
is ``<=`` it. In prefill the keys are the call's own tokens at positions ``0..len-1``; in decode /
chunked prefill they are the cached tokens at ``KVCacheSpec.global_token_positions``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedhybrid.attention.fields import (
    AttentionContractError,
    AttentionDType,
    AttentionMerge,
    AttentionMode,
    AttentionRole,
    Checker,
    DowncastPoint,
    ImplementationKind,
    JsonObject,
    PartialState,
    ReductionEngine,
    ReductionOrder,
    RoPECastPoint,
    RoPEFusionBoundary,
    RoPEState,
)
from pagedhybrid.attention.kv_cache import KVCacheSpec

__all__ = [
    "AttentionContract", "AttentionContractError",
    "AttentionDType", "AttentionMerge", "AttentionMode", "AttentionRole", "DowncastPoint",
    "ImplementationKind", "KVCacheSpec", "PartialState", "ReductionEngine", "ReductionOrder",
    "ReductionSpec", "RoPECastPoint", "RoPEFusionBoundary", "RoPESpec", "RoPEState",
    "ShardingSpec",
]


# -- ShardingSpec --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardingSpec(JsonObject):
    """TP head ownership and CP block-to-token ownership of this rank (module docstring)."""

    tp_rank: int
    tp_world_size: int
    cp_rank: int
    cp_world_size: int
    global_q_heads: int
    global_kv_heads: int
    local_q_head_start: int
    local_q_heads: int
    local_kv_head_start: int
    local_kv_heads: int
    global_sequence_length: int
    local_sequence_length: int
    global_block_indices: tuple[int, ...]
    global_block_token_starts: tuple[int, ...]
    local_block_offsets: tuple[int, ...]
    packed_sequence_offsets: tuple[int, ...] | None = None
    global_packed_sequence_offsets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        c = Checker("ShardingSpec")
        cp = self._check_heads(c)
        glen, llen, starts, offs = self._check_blocks(c, cp)
        self._check_packed(c, cp, glen, llen, starts, offs)

    def _check_heads(self, c: Checker) -> int:
        """Ranks, world sizes and the contiguous TP head ownership; returns ``cp_world_size``."""
        tp = c.positive(self.tp_world_size, "tp_world_size")
        cp = c.positive(self.cp_world_size, "cp_world_size")
        tp_rank = c.non_negative(self.tp_rank, "tp_rank")
        cp_rank = c.non_negative(self.cp_rank, "cp_rank")
        c.check(tp_rank < tp, "tp_rank", f"must be < tp_world_size = {tp}", tp_rank)
        c.check(cp_rank < cp, "cp_rank", f"must be < cp_world_size = {cp}", cp_rank)
        hq = c.positive(self.global_q_heads, "global_q_heads")
        hkv = c.positive(self.global_kv_heads, "global_kv_heads")
        c.check(hq % hkv == 0, "global_q_heads",
                f"must be a multiple of global_kv_heads = {hkv} (GQA)", hq)
        c.check(hq % tp == 0, "global_q_heads", f"must be divisible by tp_world_size = {tp}", hq)
        c.check(hkv % tp == 0, "global_kv_heads",
                f"must be divisible by tp_world_size = {tp} (each rank keeps whole KV heads of "
                "its query-head groups)", hkv)
        lq, lkv = hq // tp, hkv // tp
        c.check(c.positive(self.local_q_heads, "local_q_heads") == lq, "local_q_heads",
                f"must equal global_q_heads / tp_world_size = {lq}", self.local_q_heads)
        c.check(c.positive(self.local_kv_heads, "local_kv_heads") == lkv, "local_kv_heads",
                f"must equal global_kv_heads / tp_world_size = {lkv}", self.local_kv_heads)
        qs = c.non_negative(self.local_q_head_start, "local_q_head_start")
        ks = c.non_negative(self.local_kv_head_start, "local_kv_head_start")
        c.check(qs == tp_rank * lq, "local_q_head_start",
                f"must equal tp_rank * local_q_heads = {tp_rank * lq} (contiguous ownership "
                "preserving the global GQA mapping)", qs)
        c.check(ks == tp_rank * lkv, "local_kv_head_start",
                f"must equal tp_rank * local_kv_heads = {tp_rank * lkv} (contiguous ownership "
                "preserving the global GQA mapping)", ks)
        return cp

    def _check_blocks(self, c: Checker, cp: int
                      ) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """Sequence lengths and CP block-to-token ownership (normalised in place); returns
        ``(global length, local length, block token starts, local block offsets)``."""
        glen = c.positive(self.global_sequence_length, "global_sequence_length")
        llen = c.positive(self.local_sequence_length, "local_sequence_length")
        c.check(llen <= glen, "local_sequence_length",
                f"must be <= global_sequence_length = {glen}", llen)
        c.check(cp > 1 or llen == glen, "local_sequence_length",
                f"must equal global_sequence_length = {glen} when cp_world_size = 1", llen)
        idx = c.ints(self.global_block_indices, "global_block_indices", minimum=0)
        c.check(len(idx) >= 1, "global_block_indices", "must not be empty", [])
        c.strictly_increasing(idx, "global_block_indices")
        starts = c.ints(self.global_block_token_starts, "global_block_token_starts", minimum=0)
        c.check(len(starts) == len(idx), "global_block_token_starts",
                f"must hold one global token start per block ({len(idx)})", len(starts))
        offs = c.offsets(self.local_block_offsets, "local_block_offsets", end=llen,
                         end_name="local_sequence_length")
        c.check(len(offs) == len(idx) + 1, "local_block_offsets",
                f"must hold nblocks + 1 = {len(idx) + 1} boundaries", len(offs))
        prev_end = 0
        for m, s in enumerate(starts):
            end = s + offs[m + 1] - offs[m]
            c.check(s >= prev_end, "global_block_token_starts",
                    "global token ranges of the blocks must be non-overlapping and ordered",
                    list(starts))
            c.check(end <= glen, "global_block_token_starts",
                    f"block {idx[m]} ends at {end}, beyond global_sequence_length = {glen}", s)
            prev_end = end
        object.__setattr__(self, "global_block_indices", idx)
        object.__setattr__(self, "global_block_token_starts", starts)
        object.__setattr__(self, "local_block_offsets", offs)
        return glen, llen, starts, offs

    def _check_packed(self, c: Checker, cp: int, glen: int, llen: int,
                      starts: tuple[int, ...], offs: tuple[int, ...]) -> None:
        """Packed varlen offsets, local and global, against the blocks this rank holds."""
        packed = self.packed_sequence_offsets
        gpacked = self.global_packed_sequence_offsets
        if packed is not None:
            packed = c.offsets(packed, "packed_sequence_offsets", end=llen,
                               end_name="local_sequence_length")
            object.__setattr__(self, "packed_sequence_offsets", packed)
        if gpacked is not None:
            c.check(packed is not None, "global_packed_sequence_offsets",
                    "requires packed_sequence_offsets", list(gpacked))
            gpacked = c.offsets(gpacked, "global_packed_sequence_offsets", end=glen,
                                end_name="global_sequence_length")
            assert packed is not None
            c.check(len(gpacked) == len(packed), "global_packed_sequence_offsets",
                    f"must describe the same {len(packed) - 1} sequences as "
                    "packed_sequence_offsets", list(gpacked))
            object.__setattr__(self, "global_packed_sequence_offsets", gpacked)
            counts = [0] * (len(gpacked) - 1)
            for m, s in enumerate(starts):
                e = s + offs[m + 1] - offs[m]
                for b in range(len(counts)):
                    counts[b] += max(0, min(e, gpacked[b + 1]) - max(s, gpacked[b]))
            local = [packed[b + 1] - packed[b] for b in range(len(counts))]
            c.check(counts == local, "packed_sequence_offsets",
                    "local sequence lengths must equal the tokens this rank's blocks hold of "
                    f"each global sequence {counts}", local)
        elif packed is not None and cp > 1:
            raise c.fail("global_packed_sequence_offsets",
                         "is required for packed varlen with cp_world_size > 1 (global sequence "
                         "boundaries cannot be derived from local offsets)")

    @property
    def is_packed(self) -> bool:
        return self.packed_sequence_offsets is not None

    @property
    def global_sequence_offsets(self) -> tuple[int, ...]:
        """Sequence boundaries in global token coordinates (one sequence when not packed)."""
        if self.global_packed_sequence_offsets is not None:
            return self.global_packed_sequence_offsets
        if self.packed_sequence_offsets is not None:  # CP = 1: local == global
            return self.packed_sequence_offsets
        return (0, self.global_sequence_length)

    def local_global_coordinates(self) -> list[int]:
        """Global token coordinate of every local row, in local order."""
        out: list[int] = []
        for m, s in enumerate(self.global_block_token_starts):
            out.extend(range(s, s + self.local_block_offsets[m + 1] - self.local_block_offsets[m]))
        return out


# -- ReductionSpec -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReductionSpec(JsonObject):
    """The fixed CP merge semantics; ``kv_block_size`` is the fixed KV tile in global tokens."""

    partial_state: PartialState = PartialState.OUT_ATTENTION_LSE
    merge: AttentionMerge = AttentionMerge.ONLINE_SOFTMAX_LSE
    acc_dtype: AttentionDType = AttentionDType.FP32
    order: ReductionOrder = ReductionOrder.GLOBAL_BLOCK_INDEX
    downcast_at: DowncastPoint = DowncastPoint.FINAL_WRITE
    engine: ReductionEngine = ReductionEngine.IN_OP_REFERENCE
    kv_block_size: int = 64
    batch_invariant: bool = False  # rows bitwise independent of the batch (capability flag)

    def __post_init__(self) -> None:
        c = Checker("ReductionSpec")
        object.__setattr__(self, "partial_state",
                           c.enum(PartialState, self.partial_state, "partial_state"))
        object.__setattr__(self, "merge", c.enum(AttentionMerge, self.merge, "merge"))
        acc = c.enum(AttentionDType, self.acc_dtype, "acc_dtype")
        c.check(acc is AttentionDType.FP32, "acc_dtype",
                "CP attention accumulation must be fp32", acc.value)
        object.__setattr__(self, "acc_dtype", acc)
        object.__setattr__(self, "order", c.enum(ReductionOrder, self.order, "order"))
        object.__setattr__(self, "downcast_at",
                           c.enum(DowncastPoint, self.downcast_at, "downcast_at"))
        object.__setattr__(self, "engine", c.enum(ReductionEngine, self.engine, "engine"))
        c.positive(self.kv_block_size, "kv_block_size")
        c.check(isinstance(self.batch_invariant, bool), "batch_invariant", "must be a bool",
                self.batch_invariant)


# -- RoPESpec ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoPESpec(JsonObject):
    """RoPE state and position identity at the attention boundary.

    Unfused (``RoPE -> Attention``): attention receives post-RoPE Q and K. Fused
    (``RoPE+Attention``): attention receives pre-RoPE Q and K and rotates them itself.
    ``position_ids`` are global positions per local token (never re-derived from local offsets).
    """

    q_state: RoPEState
    k_state: RoPEState
    k_cache_state: RoPEState = RoPEState.POST_ROPE
    theta: float = 1.0e6
    rotary_dim: int = 128
    rope_scaling: dict[str, Any] | None = None
    position_ids: tuple[int, ...] | None = None
    query_position_offsets: tuple[int, ...] | None = None
    key_position_offsets: tuple[int, ...] | None = None
    cast_at: RoPECastPoint = RoPECastPoint.NONE
    output_dtype: AttentionDType | None = None
    fusion_boundary: RoPEFusionBoundary = RoPEFusionBoundary.UNFUSED_ROPE_ATTENTION

    def __post_init__(self) -> None:
        c = Checker("RoPESpec")
        q = c.enum(RoPEState, self.q_state, "q_state")
        k = c.enum(RoPEState, self.k_state, "k_state")
        object.__setattr__(self, "q_state", q)
        object.__setattr__(self, "k_state", k)
        object.__setattr__(self, "k_cache_state",
                           c.enum(RoPEState, self.k_cache_state, "k_cache_state"))
        object.__setattr__(self, "theta", c.finite_positive(self.theta, "theta"))
        rd = c.positive(self.rotary_dim, "rotary_dim")
        c.check(rd % 2 == 0, "rotary_dim", "must be even (rotation pairs)", rd)
        if self.rope_scaling is not None:
            c.check(isinstance(self.rope_scaling, dict), "rope_scaling",
                    "must be a JSON object or None", type(self.rope_scaling).__name__)
            try:
                json.dumps(self.rope_scaling)
            except TypeError as e:
                raise c.fail("rope_scaling", "must be JSON-serialisable", str(e)) from None
        for name in ("position_ids", "query_position_offsets", "key_position_offsets"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, c.ints(v, name, minimum=0))
        object.__setattr__(self, "cast_at", c.enum(RoPECastPoint, self.cast_at, "cast_at"))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype",
                               c.enum(AttentionDType, self.output_dtype, "output_dtype"))
        c.check(self.cast_at is RoPECastPoint.NONE or self.output_dtype is not None,
                "output_dtype", f"is required when cast_at = {self.cast_at.value}", None)
        fb = c.enum(RoPEFusionBoundary, self.fusion_boundary, "fusion_boundary")
        object.__setattr__(self, "fusion_boundary", fb)
        want = (RoPEState.POST_ROPE if fb is RoPEFusionBoundary.UNFUSED_ROPE_ATTENTION
                else RoPEState.PRE_ROPE)
        for name, state in (("q_state", q), ("k_state", k)):
            c.check(state is want, name,
                    f"must be {want.value} at the {fb.value} boundary (unfused attention "
                    "consumes rotated Q/K; a fused kernel rotates them itself)", state.value)

    @property
    def fused(self) -> bool:
        return self.fusion_boundary is RoPEFusionBoundary.FUSED_ROPE_ATTENTION


# -- AttentionContract ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionContract(JsonObject):
    """One attention invocation; a valid contract is complete and internally consistent."""

    role: AttentionRole
    mode: AttentionMode
    dtype: AttentionDType
    batch_size: int
    query_sequence_length: int
    head_dim: int
    causal: bool
    causal_offsets: tuple[int, ...] | None
    sharding: ShardingSpec
    reduction: ReductionSpec = ReductionSpec()
    kv_cache: KVCacheSpec | None = None
    export_lse: bool = True
    rope: RoPESpec | None = None

    _nested = {"sharding": ShardingSpec, "reduction": ReductionSpec,  # noqa: RUF012
               "kv_cache": KVCacheSpec, "rope": RoPESpec}

    def __post_init__(self) -> None:
        c = Checker("AttentionContract")
        object.__setattr__(self, "role", c.enum(AttentionRole, self.role, "role"))
        mode = c.enum(AttentionMode, self.mode, "mode")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "dtype", c.enum(AttentionDType, self.dtype, "dtype"))
        batch = c.positive(self.batch_size, "batch_size")
        qlen = c.positive(self.query_sequence_length, "query_sequence_length")
        c.positive(self.head_dim, "head_dim")
        c.check(isinstance(self.causal, bool), "causal", "must be a bool", self.causal)
        for name, typ in (("sharding", ShardingSpec), ("reduction", ReductionSpec)):
            c.check(isinstance(getattr(self, name), typ), name, f"must be a {typ.__name__}",
                    type(getattr(self, name)).__name__)
        sh = self.sharding
        c.check(self.export_lse is True, "export_lse",
                "must be True (the contract exports attention-domain LSE)", self.export_lse)
        if sh.packed_sequence_offsets is not None:
            n = len(sh.packed_sequence_offsets) - 1
            c.check(batch == n, "batch_size",
                    f"must equal len(packed_sequence_offsets) - 1 = {n} for packed varlen "
                    "(the logical sequence count, not the token dimension)", batch)
        if self.causal:
            c.check(self.causal_offsets is not None, "causal_offsets",
                    "is required when causal = True (one per sequence)", None)
            offs = c.ints(self.causal_offsets, "causal_offsets", minimum=0)
            c.check(len(offs) == batch, "causal_offsets",
                    f"must hold one offset per logical sequence (batch_size = {batch})",
                    len(offs))
            object.__setattr__(self, "causal_offsets", offs)
        else:
            c.check(self.causal_offsets is None, "causal_offsets",
                    "must be None when causal = False", self.causal_offsets)

        kv = self.kv_cache
        if mode is AttentionMode.PREFILL:
            c.check(qlen == sh.local_sequence_length, "query_sequence_length",
                    "must equal sharding.local_sequence_length "
                    f"({sh.local_sequence_length}) for full prefill", qlen)
            c.check(kv is None, "kv_cache",
                    "must be None for prefill (use chunked_prefill or decode to attend a cache)",
                    "KVCacheSpec")
        if mode is AttentionMode.DECODE:
            c.check(kv is not None, "kv_cache",
                    "is required for decode (cache positions, page table, page size, global "
                    "token positions)", None)
        if kv is not None:
            c.check(isinstance(kv, KVCacheSpec), "kv_cache", "must be a KVCacheSpec",
                    type(kv).__name__)
            self._check_cache(c, kv, batch, qlen)
        if self.rope is not None:
            self._check_rope(c, self.rope, batch, qlen)

    def _check_cache(self, c: Checker, kv: KVCacheSpec, batch: int, qlen: int) -> None:
        c.check(kv.batch_size == batch, "kv_cache",
                f"must hold one kv_seq_lens / cache_positions entry per sequence ({batch})",
                kv.batch_size)
        sh = self.sharding
        c.check(sh.local_sequence_length == batch * qlen, "query_sequence_length",
                "with a KV cache the query holds query_sequence_length rows per sequence: "
                f"batch_size * query_sequence_length must equal sharding.local_sequence_length "
                f"({sh.local_sequence_length})", qlen)
        if self.causal:
            assert self.causal_offsets is not None
            for b in range(batch):
                last = self.causal_offsets[b] + qlen - 1
                if sh.cp_world_size == 1:
                    c.check(kv.cache_positions[b] == last, f"causal_offsets[{b}]",
                            "the last query token must be the terminal cached token: "
                            f"causal_offsets[{b}] + query_sequence_length - 1 must equal "
                            f"kv_cache.cache_positions[{b}] = {kv.cache_positions[b]}",
                            self.causal_offsets[b])
                else:
                    c.check(kv.cache_positions[b] <= last, f"causal_offsets[{b}]",
                            "this rank caches a token after the last query position", last)

    def _check_rope(self, c: Checker, rope: RoPESpec, batch: int, qlen: int) -> None:
        c.check(isinstance(rope, RoPESpec), "rope", "must be a RoPESpec", type(rope).__name__)
        c.check(rope.rotary_dim <= self.head_dim, "rope.rotary_dim",
                f"must be <= head_dim = {self.head_dim}", rope.rotary_dim)
        for name in ("query_position_offsets", "key_position_offsets"):
            v = getattr(rope, name)
            if v is not None:
                c.check(len(v) == batch, f"rope.{name}",
                        f"must hold one offset per logical sequence (batch_size = {batch})",
                        len(v))
        if rope.output_dtype is not None:
            c.check(rope.output_dtype == self.dtype, "rope.output_dtype",
                    f"must equal the attention dtype {self.dtype.value} (RoPE output feeds "
                    "attention)", rope.output_dtype.value)
        sh = self.sharding
        pid = rope.position_ids
        if pid is not None:
            c.check(len(pid) in (qlen, sh.local_sequence_length), "rope.position_ids",
                    f"length must be query_sequence_length ({qlen}) or local_sequence_length "
                    f"({sh.local_sequence_length})", len(pid))
        if pid is not None and self.mode is AttentionMode.PREFILL:
            want = self._global_positions(rope.query_position_offsets)
            c.check(list(pid) == want, "rope.position_ids",
                    f"must be the global in-sequence positions of the local tokens {want}",
                    list(pid))

    def _global_positions(self, offsets: tuple[int, ...] | None) -> list[int]:
        sh = self.sharding
        bounds = sh.global_sequence_offsets
        out = []
        for g in sh.local_global_coordinates():
            b = max(i for i in range(len(bounds) - 1) if bounds[i] <= g)
            out.append(g - bounds[b] + (offsets[b] if offsets else 0))
        return out

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["semantic_operator"] = "standard_softmax_attention"
        d["lse_domain"] = "attention"
        return d

    @classmethod
    def _ignored(cls) -> tuple[str, ...]:
        return ("semantic_operator", "lse_domain")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionContract:
        c = Checker("AttentionContract")
        c.check(isinstance(d, dict), "<dict>", "must be a JSON object", type(d).__name__)
        for k, v in (("semantic_operator", "standard_softmax_attention"),
                     ("lse_domain", "attention")):
            c.check(d.get(k, v) == v, k, f"must be {v!r}", d.get(k))
        return super().from_dict(d)
