"""The pinned (out, lse) merge: formula, ±inf conventions, order semantics, partial states."""

from __future__ import annotations

import math

import torch

from pagedhybrid.attention.lse import (
    attention_partial,
    fold_states,
    merge_states,
    normalize_partial,
)

NEG = float("-inf")


def _states(n: int, rows: int = 256, d: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d, generator=g), torch.randn(rows, generator=g) * 5)
            for _ in range(n)]


def _nway64(states: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(torch.stack([s[1].double() for s in states]), 0)
    out = sum(torch.exp(s[1].double() - lse)[:, None] * s[0].double() for s in states)
    assert isinstance(out, torch.Tensor)
    return out, lse


def test_merge_matches_float64_nway_softmax() -> None:
    states = _states(4)
    out, lse = fold_states((i, o, lb) for i, (o, lb) in enumerate(states))
    ref_out, ref_lse = _nway64(states)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max() < 2e-5
    assert (lse.double() - ref_lse).abs().max() < 2e-5


def test_merge_formula_is_the_pinned_logaddexp_form() -> None:
    (oa, la), (ob, lb) = _states(2, rows=64)
    out, lse = merge_states(oa, la, ob, lb)
    big = torch.logaddexp(la, lb)
    assert torch.equal(lse, big)
    assert torch.equal(out, torch.exp(la - big)[:, None] * oa + torch.exp(lb - big)[:, None] * ob)


def test_fully_masked_partials_give_zero_and_neg_inf_without_nan() -> None:
    z, ninf = torch.zeros(3, 4), torch.full((3,), NEG)
    out, lse = merge_states(z, ninf, z, ninf)
    assert torch.equal(out, z) and torch.equal(lse, ninf)
    (o, lb), = _states(1, rows=3, d=4)
    out, lse = merge_states(z, ninf, o, lb)
    assert torch.equal(out, o) and torch.equal(lse, lb)  # (0, -inf) is an exact identity
    out, lse = merge_states(o, lb, z, ninf)
    assert torch.equal(out, o) and torch.equal(lse, lb)


def test_plus_inf_lse_is_ingested_as_empty() -> None:
    out, lse = normalize_partial(torch.ones(2, 3), torch.tensor([math.inf, 1.0]))
    assert lse[0] == NEG and torch.equal(out[0], torch.zeros(3)) and torch.equal(out[1],
                                                                                 torch.ones(3))
    states = _states(2, rows=2, d=3)
    merged = fold_states([(0, *states[0]), (1, torch.ones(2, 3), torch.full((2,), math.inf))])
    assert torch.equal(merged[0], states[0][0]) and torch.equal(merged[1], states[0][1])


def test_merge_order_uses_global_block_index_not_arrival_order() -> None:
    states = _states(4, seed=3)
    tagged = [(i, o, lb) for i, (o, lb) in enumerate(states)]
    first = fold_states(tagged)
    second = fold_states([tagged[2], tagged[0], tagged[3], tagged[1]])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    # the order is semantic: folding in reverse global order changes the bits
    rev = fold_states((3 - i, o, lb) for i, o, lb in tagged)
    assert not (torch.equal(first[0], rev[0]) and torch.equal(first[1], rev[1]))


def test_duplicate_block_indices_are_rejected() -> None:
    (o, lb), = _states(1)
    try:
        fold_states([(1, o, lb), (1, o, lb)])
    except ValueError as e:
        assert "duplicate global block indices" in str(e)
    else:
        raise AssertionError("duplicate indices were merged")


def test_attention_partial_matches_float64_and_masks_to_the_empty_state() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(5, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g),
               torch.randn(6, 2, 8, generator=g))
    allowed = torch.rand(5, 6, generator=g) > 0.4
    allowed[2] = False  # a fully masked row
    out, lse = attention_partial(q, k, v, allowed, 0.3)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.einsum("rhd,chd->rhc", q.double(), kk) * 0.3
    s = s.masked_fill(~allowed[:, None, :], NEG)
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.einsum("rhc,chd->rhd", torch.nan_to_num(torch.softmax(s, -1)), vv)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.equal(out[2], torch.zeros(4, 8)) and torch.isneginf(lse[2]).all()
    keep = torch.tensor([0, 1, 3, 4])
    assert (out[keep].double() - ref_out[keep]).abs().max() < 1e-6
    assert (lse[keep].double() - ref_lse[keep]).abs().max() < 1e-6
