"""The model's step seam on every backend against the op references (the declared slow path).

Hypothesis draws packed steps: decode, short continuations (<= 16 new tokens, the native
attention) and long prefill chunks mixed, fresh and continuing sequences, shuffled pages across
tile and split boundaries, scattered state slots in garbage-filled pools. Each backend's
attention / causal conv / gated delta must match the reference step on the outputs, on every
page and pool row it writes, and leave every other row untouched.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.step import DecodeInputs, StepMetadata

SLOTS = 8
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@st.composite
def steps(draw: st.DrawFn) -> tuple[StepMetadata, int]:
    bs = draw(st.sampled_from([16, 32]))
    b = draw(st.integers(1, 5))
    q_lens = [draw(st.sampled_from([1, 1, 1, 2, 5, 16, 17, 40])) for _ in range(b)]
    past = [draw(st.sampled_from([0, 0, 1, 15, 16, 31, 100, 600])) for _ in range(b)]
    need = [-(-(p + q) // bs) for p, q in zip(past, q_lens, strict=True)]
    pages = draw(st.permutations(range(sum(need) + 3)))
    tables, k = [], 0
    for n in need:
        tables.append(list(pages[k:k + n]))
        k += n
    slots = draw(st.permutations(range(SLOTS)))[:b]
    meta = StepMetadata.build(q_lens, past, tables, slots, block_size=bs,
                              num_pages=len(pages), num_slots=SLOTS)
    return meta, bs


def _both(name: str, fn_name: str, *args: torch.Tensor | float | str | StepMetadata,
          pools: tuple[int, ...]) -> tuple[list[object], list[object]]:
    """Run ``fn_name`` of the reference and of ``name`` on separate copies of the pools
    (positional indices ``pools``)."""
    ref_args = [a.clone() if i in pools else a for i, a in enumerate(args)]
    got_args = [a.clone() if i in pools else a for i, a in enumerate(args)]
    ref = getattr(backend("reference").step, fn_name)(*ref_args)
    got = getattr(backend(name).step, fn_name)(*got_args)
    return [ref, *[ref_args[i] for i in pools]], [got, *[got_args[i] for i in pools]]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), heads=st.sampled_from([(4, 2, 32), (8, 1, 64), (2, 2, 16)]),
       seed=st.integers(0, 2 ** 16))
def test_attention_matches_reference(name: str, dtype: torch.dtype, case, heads, seed) -> None:
    meta, bs = case
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    n = meta.num_tokens
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(meta.num_pages, bs, hkv, d, generator=gen).to(dtype) for _ in "kv")
    want, got = _both(name, "attention", q, k, v, kc, vc, meta, d ** -0.5, pools=(3, 4))
    for w, g in zip(want, got, strict=True):
        _close(g, w, dtype)


@pytest.mark.parametrize("name", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), seed=st.integers(0, 2 ** 16))
def test_causal_conv_matches_reference(name: str, dtype: torch.dtype, case, seed) -> None:
    meta, _ = case
    gen = torch.Generator().manual_seed(seed)
    c, kk = 24, 4
    x = torch.randn(meta.num_tokens, c, generator=gen).to(dtype)
    w = (torch.randn(c, 1, kk, generator=gen) * 0.5).to(dtype)
    pool = torch.randn(SLOTS, c, kk - 1, generator=gen).to(dtype)
    want, got = _both(name, "causal_conv", x, w, pool, meta, "silu", pools=(2,))
    for wv, g in zip(want, got, strict=True):
        _close(g, wv, dtype)
    untouched = sorted(set(range(SLOTS)) - set(meta.state_slots.tolist()))
    assert torch.equal(got[1][untouched], pool[untouched])


@pytest.mark.parametrize("name", ["native", "torch"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), seed=st.integers(0, 2 ** 16), shape=st.sampled_from([(2, 4, 16, 8),
                                                                         (1, 1, 32, 32)]))
def test_gated_delta_matches_reference(name: str, case, seed, shape) -> None:
    meta, _ = case
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    n = meta.num_tokens
    q, k = (torch.nn.functional.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1)
            for _ in "qk")
    v = torch.randn(n, hv, dv, generator=gen)
    a, b = torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen)
    a_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen) * 0.5
    pool = torch.randn(SLOTS, hv, dv, dk, generator=gen)
    want, got = _both(name, "gated_delta", q, k, v, a, b, a_log, dt_bias, pool, meta,
                      dk ** -0.5, pools=(7,))
    for wv, g in zip(want, got, strict=True):
        _close(g, wv, torch.float32)
    untouched = sorted(set(range(SLOTS)) - set(meta.state_slots.tolist()))
    assert torch.equal(got[1][untouched], pool[untouched])


def test_metadata_rejects_corrupted_steps() -> None:
    good = {"block_size": 16, "num_pages": 4, "num_slots": 2}
    meta = StepMetadata.build([3, 1], [0, 20], [[2], [0, 1]], [1, 0], **good)
    assert meta.write_slots.tolist() == [32, 33, 34, 20]
    assert meta.decode == (1,) and meta.multi == (0,) and meta.fresh == (True, False)
    bad = [(([3, 1], [0, 20], [[2], [0, 4]], [1, 0]), "block_table"),  # page past the pool
           (([3, 1], [0, 20], [[2], [0]], [1, 0]), "block_table"),  # page not mapped
           (([3, 1], [0, 20], [[2], [0, 1]], [1, 2]), "state_slots"),  # slot out of range
           (([3, 1], [0, 20], [[2], [0, 1]], [1, 1]), "state_slots"),  # slot repeated
           (([3, -1], [0, 20], [[2], [0, 1]], [1, 0]), "q_lens/past_lens")]
    for args, where in bad:
        with pytest.raises(ContractViolation) as err:
            StepMetadata.build(*args, **good)
        assert err.value.where == where


def test_advance_is_the_next_decode_step_or_none() -> None:
    """``advance`` equals ``build`` of the same sequences one token on; it declines (None) a
    step that is not all decode, has checkpoints or whose next token opens a page, and refuses
    write slots that are missing or outside the pool."""
    good = {"block_size": 16, "num_pages": 4, "num_slots": 3}
    meta = StepMetadata.build([1, 1], [0, 20], [[2], [0, 1]], [1, 0], **good)
    nxt = meta.advance([33, 21])
    want = StepMetadata.build([1, 1], [1, 21], [[2], [0, 1]], [1, 0], **good)
    assert nxt is not None
    for name in ("cu_seqlens_t", "past_t", "block_table", "state_slots", "fresh_t", "positions",
                 "write_slots"):
        got, ref = getattr(nxt, name), getattr(want, name)
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    assert (nxt.q_lens, nxt.past_lens, nxt.decode, nxt.multi, nxt.cu_seqlens) == (
        want.q_lens, want.past_lens, want.decode, want.multi, want.cu_seqlens)
    assert nxt.fresh == (False, False)
    inputs = DecodeInputs(4)  # the same step written into persistent buffers
    again = meta.advance([33, 21], inputs)
    assert again is not None
    for name in ("past_t", "positions", "write_slots"):
        got, ref = getattr(again, name), getattr(nxt, name)
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    ids, attention, position_ids = inputs.tokens([5, 6], 1, 22)
    assert ids.tolist() == [5, 6] and attention.tolist() == [1, 22, 22]
    assert attention.dtype == torch.int32 and position_ids.tolist() == [[1, 21]] * 3
    assert inputs.write((7,), (40,))[1].data_ptr() == again.positions.data_ptr()  # reused
    small = DecodeInputs(1)  # too few rows for two sequences: fresh tensors instead
    fresh = meta.advance([33, 21], small)
    assert fresh is not None and torch.equal(fresh.write_slots, nxt.write_slots)
    assert small._n64.sum() == 0
    assert StepMetadata.build([1, 1], [15, 3], [[2], [0]], [1, 0], **good).advance([0, 4]) is None
    assert StepMetadata.build([2, 1], [0, 3], [[2], [0]], [1, 0], **good).advance([0, 4]) is None
    assert StepMetadata.build([1], [3], [[2]], [1], checkpoints=[(0, 1, 0)], num_checkpoints=1,
                              **good).advance([36]) is None
    for writes in ([33], [33, 64], [-1, 21]):
        with pytest.raises(ContractViolation) as err:
            meta.advance(writes)
        assert err.value.where == "write_slots"
