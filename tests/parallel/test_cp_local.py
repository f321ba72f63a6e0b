"""The deterministic CP path on one rank: oracle checks, paged decode, typed rejections."""

from __future__ import annotations

import math

import pytest
import torch
from cp_cases import (
    DECODE_CASES,
    HKV,
    HQ,
    KV_BLOCK,
    Q_BLOCK,
    D,
    PrefillCase,
    decode_oracle,
    decode_shard,
    prefill_contract,
    prefill_global,
    prefill_oracle,
)

from pagedhybrid.attention.contract import AttentionContract, KVCacheSpec, ReductionSpec
from pagedhybrid.attention.cp_plan import QueryRows, fold_partials, prefill_rows, tile_partials
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.parallel import context_parallel_attention


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs() / ref.abs().clamp(min=1.0)).max().item()


def test_cp1_prefill_matches_float64() -> None:
    case = PrefillCase("p", (24, 40), "zigzag", offsets=(2, 0), seed=11)
    c = prefill_contract(case, 1, 0)
    q, k, v = prefill_global(case)
    out, lse = context_parallel_attention(q, k, v, contract=c, query_block_size=Q_BLOCK)
    ref_out, ref_lse = prefill_oracle(case, q, k, v)
    assert _rel(out, ref_out) < 1e-6 and _rel(lse, ref_lse) < 1e-6


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_cp1_paged_decode_matches_float64(case: object) -> None:
    c, (q, kc, vc) = decode_shard(case, 1, 0)  # type: ignore[arg-type]
    out, lse = context_parallel_attention(q, kc, vc, contract=c)
    ref_out, ref_lse = decode_oracle(case)  # type: ignore[arg-type]
    tol = 1e-6 if c.dtype == "fp32" else 2 ** -7
    assert _rel(out, ref_out) < tol and _rel(lse, ref_lse) < 1e-6


def test_decode_through_shared_prefix_pages_equals_teacher_forcing_prefill() -> None:
    """Two sequences share a read-only prefix page; each decodes its next token."""
    page = KV_BLOCK
    g = torch.Generator().manual_seed(4)
    prefix_k, prefix_v = torch.randn(page, HKV, D, generator=g), torch.randn(page, HKV, D,
                                                                             generator=g)
    lens = (page + 3, page + 5)
    ks = [torch.cat([prefix_k, torch.randn(n - page, HKV, D, generator=g)]) for n in lens]
    vs = [torch.cat([prefix_v, torch.randn(n - page, HKV, D, generator=g)]) for n in lens]
    num_pages = 6
    kc = torch.full((num_pages, page, HKV, D), float("nan"))
    vc = torch.full((num_pages, page, HKV, D), float("nan"))
    kc[4], vc[4] = prefix_k, prefix_v  # the shared page
    table = ((4, 0), (4, 2))
    for b, n in enumerate(lens):
        kc[table[b][1], : n - page] = ks[b][page:]
        vc[table[b][1], : n - page] = vs[b][page:]
    kv = KVCacheSpec(cache_positions=tuple(n - 1 for n in lens), kv_seq_lens=lens,
                     block_table=table,
                     global_token_positions=tuple(p for n in lens for p in range(n)),
                     page_size=page, prefix_cache_enabled=True, prefix_cache_key="sys",
                     shared_prefix_page_count=1)
    q = torch.randn(2, HQ, D, generator=g)
    sh = prefill_contract(PrefillCase("x", (2,), "contiguous"), 1, 0).sharding
    c = AttentionContract(role="infer", mode="decode", dtype="fp32", batch_size=2,
                          query_sequence_length=1, head_dim=D, causal=True,
                          causal_offsets=tuple(n - 1 for n in lens), sharding=sh,
                          reduction=ReductionSpec(kv_block_size=KV_BLOCK), kv_cache=kv)
    out, lse = context_parallel_attention(q, kc, vc, contract=c)
    for b, n in enumerate(lens):  # teacher forcing: the last row of a causal prefill
        seq_q = torch.randn(n, HQ, D, generator=g)
        seq_q[-1] = q[b]
        pc = PrefillCase("tf", (n,), "contiguous")
        pout, plse = context_parallel_attention(seq_q, ks[b], vs[b],
                                                contract=prefill_contract(pc, 1, 0))
        assert (out[b] - pout[-1]).abs().max() < 1e-6
        assert (lse[b] - plse[-1]).abs().max() < 1e-6
    s = torch.einsum("hd,jhd->hj", q[0], ks[0].repeat_interleave(HQ // HKV, 1)) / math.sqrt(D)
    assert (lse[0] - torch.logsumexp(s, -1)).abs().max() < 1e-5


def test_arrival_order_of_partials_does_not_change_the_bits() -> None:
    case = PrefillCase("p", (16, 24), "contiguous", seed=12)
    c = prefill_contract(case, 1, 0)
    q, k, v = prefill_global(case)
    rows = prefill_rows(c, q)
    from pagedhybrid.attention.cp_plan import prefill_tiles

    parts = tile_partials(c, rows, prefill_tiles(c, k, v), 1 / math.sqrt(D), Q_BLOCK)
    out, lse = fold_partials(rows, parts, Q_BLOCK)
    perm = torch.randperm(parts.ids.numel(), generator=torch.Generator().manual_seed(0))
    shuffled = type(parts)(parts.ids[perm], parts.tiles[perm], parts.out[perm], parts.lse[perm])
    out2, lse2 = fold_partials(rows, shuffled, Q_BLOCK)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    rows_rev = QueryRows(rows.ids.flip(0), rows.seq.flip(0), rows.index.flip(0),
                         rows.pos.flip(0), rows.q.flip(0))  # local row order is irrelevant too
    out3, lse3 = fold_partials(rows_rev, parts, Q_BLOCK)
    assert torch.equal(out3.flip(0), out) and torch.equal(lse3.flip(0), lse)
    dup = type(parts)(torch.cat([parts.ids, parts.ids[:1]]), torch.cat([parts.tiles,
                                                                        parts.tiles[:1]]),
                      torch.cat([parts.out, parts.out[:1]]), torch.cat([parts.lse,
                                                                        parts.lse[:1]]))
    with pytest.raises(ContractViolation, match="two partial states"):
        fold_partials(rows, dup, Q_BLOCK)


def test_typed_rejections() -> None:
    case = PrefillCase("p", (16,), "contiguous")
    c = prefill_contract(case, 1, 0)
    q, k, v = prefill_global(case)
    with pytest.raises(ContractViolation, match="'key' must have the contract dtype"):
        context_parallel_attention(q, k.double(), v, contract=c)
    with pytest.raises(ContractViolation, match=r"'query' must have shape \[16, 4, 16\]"):
        context_parallel_attention(q[:, :2], k, v, contract=c)
    cp2 = prefill_contract(case, 2, 0)
    with pytest.raises(UnsupportedConfiguration, match=r"initialised torch\.distributed"):
        context_parallel_attention(q[:8], k[:8], v[:8], contract=cp2)
    batched = AttentionContract.from_dict({**c.to_dict(), "batch_size": 2,
                                           "causal_offsets": [0, 0]})
    with pytest.raises(UnsupportedConfiguration, match="packed varlen layout"):
        context_parallel_attention(q, k, v, contract=batched)
    dc, (dq, kc, vc) = decode_shard(DECODE_CASES[0], 1, 0)
    with pytest.raises(ContractViolation, match="page ids must be < num_pages"):
        context_parallel_attention(dq, kc[:2], vc[:2], contract=dc)
    with pytest.raises(ContractViolation, match="must be a paged cache"):
        context_parallel_attention(dq, kc[:, :2], vc[:, :2], contract=dc)


def test_fold_runs_in_ascending_global_block_order() -> None:
    """fold_partials == a hand-written left fold in ascending tile order (and != descending)."""
    from pagedhybrid.attention.cp_plan import prefill_tiles
    from pagedhybrid.attention.lse import merge_states

    case = PrefillCase("p", (64,), "contiguous", causal=False, seed=13)
    c = prefill_contract(case, 1, 0)
    q, k, v = prefill_global(case)
    rows = prefill_rows(c, q)
    parts = tile_partials(c, rows, prefill_tiles(c, k, v), 1 / math.sqrt(D), Q_BLOCK)
    out, lse = fold_partials(rows, parts, Q_BLOCK)

    def by_hand(tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        so, sl = torch.zeros(Q_BLOCK, HQ, D), torch.full((Q_BLOCK, HQ), float("-inf"))
        for t in tiles:
            sel = (parts.tiles[:, 1] == t) & (parts.ids < Q_BLOCK)  # query block 0
            bo, bl = torch.zeros(Q_BLOCK, HQ, D), torch.full((Q_BLOCK, HQ), float("-inf"))
            bo[parts.ids[sel]], bl[parts.ids[sel]] = parts.out[sel], parts.lse[sel]
            so, sl = merge_states(so, sl, bo, bl)
        return so, sl

    tiles = sorted(set(parts.tiles[:, 1].tolist()))
    assert len(tiles) == 64 // KV_BLOCK
    asc_o, asc_l = by_hand(tiles)
    assert torch.equal(out[:Q_BLOCK], asc_o) and torch.equal(lse[:Q_BLOCK], asc_l)
    desc_o, desc_l = by_hand(tiles[::-1])
    assert not (torch.equal(out[:Q_BLOCK], desc_o) and torch.equal(lse[:Q_BLOCK], desc_l))
