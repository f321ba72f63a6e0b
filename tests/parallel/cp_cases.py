"""CP test cases: global inputs, per-rank shards and contracts, a float64 dense oracle.

Shared by the single-process tests and the gloo workers (``cp_worker``), so every rank builds
identical global tensors from a seed and slices its own shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedhybrid.attention.contract import AttentionContract, KVCacheSpec, ReductionSpec
from pagedhybrid.attention.layouts import cp_sharding
from pagedhybrid.dtypes import to_torch

HQ, HKV, D = 4, 2, 16
KV_BLOCK = 8
Q_BLOCK = 5  # deliberately not a divisor of the CP chunk sizes


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seq_lens: tuple[int, ...]
    scheme: str
    dtype: str = "fp32"
    causal: bool = True
    offsets: tuple[int, ...] | None = None  # causal offsets (default 0)
    seed: int = 0


@dataclass(frozen=True)
class DecodeCase:
    name: str
    kv_lens: tuple[int, ...]
    qlen: int = 1
    dtype: str = "fp32"
    seed: int = 1


PREFILL_CASES = (
    PrefillCase("causal_contiguous", (128,), "contiguous"),
    PrefillCase("causal_zigzag", (128,), "zigzag"),
    PrefillCase("packed_zigzag", (64, 128), "zigzag", seed=2),
    PrefillCase("packed_contiguous", (128, 64), "contiguous", seed=3),
    PrefillCase("packed_zigzag_offsets", (64, 128), "zigzag", offsets=(3, 0), seed=4),
    PrefillCase("noncausal_packed_zigzag", (64, 128), "zigzag", causal=False, seed=5),
    PrefillCase("causal_zigzag_bf16", (128,), "zigzag", dtype="bf16", seed=6),
    PrefillCase("packed_zigzag_bf16", (64, 128), "zigzag", dtype="bf16", seed=7),
    PrefillCase("packed_contiguous_bf16", (128, 64), "contiguous", dtype="bf16", seed=8),
)
DECODE_CASES = (
    DecodeCase("decode_paged", (13, 29, 40)),
    DecodeCase("chunked_prefill_paged", (13, 29, 40), qlen=3, seed=9),
    DecodeCase("decode_paged_bf16", (5, 29, 40), dtype="bf16", seed=10),
)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32)


def prefill_global(case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    n = sum(case.seq_lens)
    dt = to_torch(case.dtype)
    return (_randn(g, n, HQ, D).to(dt), _randn(g, n, HKV, D).to(dt), _randn(g, n, HKV, D).to(dt))


def prefill_contract(case: PrefillCase, world: int, rank: int) -> AttentionContract:
    sh = cp_sharding(case.seq_lens, cp_world_size=world, cp_rank=rank, scheme=case.scheme,
                     global_q_heads=HQ, global_kv_heads=HKV)
    b = len(case.seq_lens)
    return AttentionContract(
        role="infer", mode="prefill", dtype=case.dtype, batch_size=b,
        query_sequence_length=sh.local_sequence_length, head_dim=D, causal=case.causal,
        causal_offsets=(case.offsets or (0,) * b) if case.causal else None, sharding=sh,
        reduction=ReductionSpec(kv_block_size=KV_BLOCK))


def prefill_shard(case: PrefillCase, world: int, rank: int
                  ) -> tuple[AttentionContract, list[int], tuple[torch.Tensor, ...]]:
    """Contract, global coordinates of the local rows, and (q, k, v) of rank ``rank``."""
    contract = prefill_contract(case, world, rank)
    coords = contract.sharding.local_global_coordinates()
    q, k, v = prefill_global(case)
    return contract, coords, (q[coords], k[coords], v[coords])


def prefill_oracle(case: PrefillCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 masked softmax per sequence: out [N, HQ, D], lse [N, HQ]."""
    out = torch.zeros(q.shape[0], HQ, D, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], HQ, dtype=torch.float64)
    start = 0
    offsets = case.offsets or (0,) * len(case.seq_lens)
    for b, n in enumerate(case.seq_lens):
        sl = slice(start, start + n)
        start += n
        allowed = torch.ones(n, n, dtype=torch.bool)
        if case.causal:
            allowed = torch.arange(n)[None, :] <= torch.arange(n)[:, None] + offsets[b]
        out[sl], lse[sl] = _dense(q[sl], k[sl], v[sl], allowed)
    return out, lse


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    group = HQ // HKV
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(
        group, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)  # [H, Rq, Rk]
    s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, Rq]
    out = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)  # [Rq, H, D]
    return out, lse.T


# -- decode / chunked prefill over a paged cache --------------------------------------------------
def decode_global(case: DecodeCase) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Query [B * qlen, HQ, D] and per-sequence dense K/V [n_b, HKV, D] (positions 0..n_b-1)."""
    g = torch.Generator().manual_seed(case.seed)
    dt = to_torch(case.dtype)
    q = _randn(g, len(case.kv_lens) * case.qlen, HQ, D).to(dt)
    ks = [_randn(g, n, HKV, D).to(dt) for n in case.kv_lens]
    vs = [_randn(g, n, HKV, D).to(dt) for n in case.kv_lens]
    return q, ks, vs


def decode_shard(case: DecodeCase, world: int, rank: int
                 ) -> tuple[AttentionContract, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rank ``rank`` caches the KV tiles ``t`` with ``t % world == rank`` (one page per tile).

    Physical page ids are handed out in reverse order to exercise the block table; unused pages
    and unused page slots hold NaN, so reading one would poison the result.
    """
    q, ks, vs = decode_global(case)
    dt = to_torch(case.dtype)
    page = KV_BLOCK
    lens, positions, tables, chunks_k, chunks_v = [], [], [], [], []
    for b, n in enumerate(case.kv_lens):
        pos = [p for p in range(n) if (p // KV_BLOCK) % world == rank]
        lens.append(len(pos))
        positions.extend(pos)
        ntiles = -(-len(pos) // page)
        tables.append(list(range(len(chunks_k), len(chunks_k) + ntiles)))
        for t in range(ntiles):
            sel = pos[t * page:(t + 1) * page]
            kp = torch.full((page, HKV, D), float("nan"), dtype=dt)  # padding is never read
            vp = torch.full((page, HKV, D), float("nan"), dtype=dt)
            kp[: len(sel)] = ks[b][sel]
            vp[: len(sel)] = vs[b][sel]
            chunks_k.append(kp)
            chunks_v.append(vp)
    num_pages = len(chunks_k) + 2  # two unused pages
    width = max(max((len(t) for t in tables), default=0), 1) + 1
    perm = list(reversed(range(num_pages)))  # logical page i -> physical perm[i]
    key_cache = torch.full((num_pages, page, HKV, D), float("nan")).to(dt)
    value_cache = torch.full((num_pages, page, HKV, D), float("nan")).to(dt)
    for i, (kp, vp) in enumerate(zip(chunks_k, chunks_v, strict=True)):
        key_cache[perm[i]] = kp
        value_cache[perm[i]] = vp
    table = tuple(tuple([perm[i] for i in t] + [-1] * (width - len(t))) for t in tables)
    kv = KVCacheSpec(
        cache_positions=tuple((positions_of(positions, lens, b)[-1]
                               if lens[b] else -1) for b in range(len(lens))),
        kv_seq_lens=tuple(lens), block_table=table, global_token_positions=tuple(positions),
        page_size=page)
    sh = cp_sharding((len(case.kv_lens) * case.qlen,), cp_world_size=1, cp_rank=0,
                     scheme="contiguous", global_q_heads=HQ, global_kv_heads=HKV)
    if world > 1:  # queries are replicated: every rank holds all query rows
        sh = type(sh)(**{**sh.__dict__, "cp_world_size": world, "cp_rank": rank})
    contract = AttentionContract(
        role="infer", mode="decode" if case.qlen == 1 else "chunked_prefill", dtype=case.dtype,
        batch_size=len(case.kv_lens), query_sequence_length=case.qlen, head_dim=D, causal=True,
        causal_offsets=tuple(n - case.qlen for n in case.kv_lens), sharding=sh,
        reduction=ReductionSpec(kv_block_size=KV_BLOCK), kv_cache=kv)
    return contract, (q, key_cache, value_cache)


def positions_of(positions: list[int], lens: list[int], b: int) -> list[int]:
    start = sum(lens[:b])
    return positions[start:start + lens[b]]


def decode_oracle(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    q, ks, vs = decode_global(case)
    out = torch.zeros(q.shape[0], HQ, D, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], HQ, dtype=torch.float64)
    for b, n in enumerate(case.kv_lens):
        sl = slice(b * case.qlen, (b + 1) * case.qlen)
        qpos = torch.arange(case.qlen) + n - case.qlen
        allowed = torch.arange(n)[None, :] <= qpos[:, None]
        out[sl], lse[sl] = _dense(q[sl], ks[b], vs[b], allowed)
    return out, lse
