"""VarlenCausalConvWithState reference: hand-worked cases, conv1d per sequence, state carry."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.ops.varlen_causal_conv import varlen_causal_conv

vcc = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


# -- hand-worked ---------------------------------------------------------------------------------
def test_hand_worked_k2_two_sequences() -> None:
    # one channel, taps (previous, current) = (2, 3), bias 1
    w = torch.tensor([[[2.0, 3.0]]])  # [C=1, 1, K=2]
    x = torch.tensor([[1.0], [10.0], [4.0]])  # seq0 = [1, 10], seq1 = [4]
    state = torch.tensor([[[5.0]], [[-1.0]]])  # [B=2, C=1, L=1]
    out, final = varlen_causal_conv(x, w, cu_of([2, 1]), torch.tensor([1.0]), state)
    # seq0: 2*5 + 3*1 + 1 = 14, 2*1 + 3*10 + 1 = 33; seq1: 2*(-1) + 3*4 + 1 = 11
    assert out.flatten().tolist() == [14.0, 33.0, 11.0]
    assert final.flatten().tolist() == [10.0, 4.0]


def test_hand_worked_short_sequence_keeps_state_suffix_and_silu() -> None:
    w = torch.tensor([[[1.0, 10.0, 100.0]]])  # K=3, L=2
    x = torch.tensor([[0.5]])
    state = torch.tensor([[[0.25, 0.125]]])  # the two samples before x
    out, final = varlen_causal_conv(x, w, cu_of([1]), None, state, activation="silu")
    y = 1.0 * 0.25 + 10.0 * 0.125 + 100.0 * 0.5  # 51.5
    assert out.item() == pytest.approx(silu(y), rel=1e-6)
    assert final.flatten().tolist() == [0.125, 0.5]  # shift left, append


def test_hand_worked_dilation2() -> None:
    w = torch.tensor([[[2.0, 1.0]]])  # K=2, dilation 2 -> L=2
    x = torch.tensor([[1.0], [2.0], [3.0]])
    state = torch.tensor([[[7.0, 8.0]]])
    out, final = varlen_causal_conv(x, w, cu_of([3]), None, state, dilation=2)
    # y_p = 2 * x_ext[p] + 1 * x_p where x_ext = [7, 8, 1, 2, 3]
    assert out.flatten().tolist() == [2 * 7 + 1, 2 * 8 + 2, 2 * 1 + 3]
    assert final.flatten().tolist() == [2.0, 3.0]


def test_default_activation_is_none_and_swish_is_silu() -> None:
    ins, _ = vcc.make_inputs(vcc.conformance_recipes()[0], torch.float32, 3)
    raw, _ = varlen_causal_conv(*ins)
    explicit, _ = varlen_causal_conv(*ins, activation="none")
    silu_out, _ = varlen_causal_conv(*ins, activation="silu")
    swish_out, _ = varlen_causal_conv(*ins, activation="swish")
    assert torch.equal(raw, explicit)
    assert torch.equal(silu_out, swish_out)
    torch.testing.assert_close(silu_out, F.silu(raw), rtol=1e-6, atol=1e-6)


def test_none_state_is_zeros_and_dtypes_follow_input() -> None:
    ins, _ = vcc.make_inputs(vcc.conformance_recipes()[0], torch.float16, 1)
    zeros = torch.zeros_like(ins[4])
    a = varlen_causal_conv(*ins[:4], None, activation="silu")
    b = varlen_causal_conv(*ins[:4], zeros, activation="silu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].dtype == torch.float16 and a[1].dtype == torch.float16


def test_validate_and_output_shapes() -> None:
    recipe = next(r for r in vcc.conformance_recipes() if r["name"] == "dilation2_k3")
    ins, attrs = vcc.make_inputs(recipe, torch.float32, 0)
    d = vcc.validate(*ins, **attrs)
    assert (d.total_tokens, d.channels, d.kernel_size, d.dilation, d.state_len, d.batch) == (
        14, 8, 3, 2, 4, 3)
    assert d.cu_seqlens == (0, 7, 9, 14)
    shapes = vcc.output_shapes(*ins, **attrs)
    out, final = varlen_causal_conv(*ins, **attrs)
    assert shapes == ((tuple(out.shape), out.dtype), (tuple(final.shape), final.dtype))


def test_recipes_are_well_formed() -> None:
    recipes = vcc.conformance_recipes()
    assert 10 <= len(recipes) <= 20
    assert len({r["name"] for r in recipes}) == len(recipes)
    for r in recipes:
        ins, attrs = vcc.make_inputs(r, torch.float32, 0)
        assert len(ins) == len(vcc.SPEC.inputs)
        outs = varlen_causal_conv(*ins, **attrs)
        assert vcc.output_shapes(*ins, **attrs) == tuple((tuple(o.shape), o.dtype)
                                                         for o in outs)


# -- independent formulation: torch conv1d per sequence with the state prepended ------------------
def conv1d_oracle(x: torch.Tensor, w: torch.Tensor, lens: list[int], bias: torch.Tensor | None,
                  state: torch.Tensor, activation: str, dilation: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    outs, finals, start = [], [], 0
    state_len = state.shape[-1]
    for b, n in enumerate(lens):
        ext = torch.cat([state[b], x[start:start + n].T], dim=1)  # [C, L + n]
        y = F.conv1d(ext[None], w, bias, dilation=dilation, groups=w.shape[0])[0].T  # [n, C]
        outs.append(F.silu(y) if activation in ("silu", "swish") else y)
        finals.append(ext[:, ext.shape[1] - state_len:])
        start += n
    return torch.cat(outs), torch.stack(finals)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=4), channels=st.integers(1, 5),
       k=st.integers(1, 4), dilation=st.integers(1, 3), with_bias=st.booleans(),
       activation=st.sampled_from(["none", "silu", "swish"]), seed=st.integers(0, 2**16))
def test_matches_conv1d_per_sequence(lens: list[int], channels: int, k: int, dilation: int,
                                     with_bias: bool, activation: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state_len = (k - 1) * dilation
    x = torch.randn(sum(lens), channels, generator=g, dtype=torch.float64)
    w = torch.randn(channels, 1, k, generator=g, dtype=torch.float64)
    bias = torch.randn(channels, generator=g, dtype=torch.float64) if with_bias else None
    state = torch.randn(len(lens), channels, state_len, generator=g, dtype=torch.float64)
    want_out, want_state = conv1d_oracle(x, w, lens, bias, state, activation, dilation)
    out, final = varlen_causal_conv(x, w, cu_of(lens), bias, state, activation=activation,
                                    dilation=dilation)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(final, want_state)  # raw samples: exact
    out32, final32 = varlen_causal_conv(x.float(), w.float(), cu_of(lens),
                                        None if bias is None else bias.float(), state.float(),
                                        activation=activation, dilation=dilation)
    assert (out32.double() - want_out).abs().max() <= 1e-5
    assert torch.equal(final32, want_state.float())


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(2, 12), min_size=1, max_size=3), k=st.integers(1, 4),
       seed=st.integers(0, 2**16), data=st.data())
def test_split_calls_with_carried_state_equal_one_call(lens: list[int], k: int, seed: int,
                                                       data: st.DataObject) -> None:
    """Prefill in two chunks (the second can be single-token decode steps) == one call."""
    cuts = [data.draw(st.integers(1, n - 1)) for n in lens]
    g = torch.Generator().manual_seed(seed)
    c = 3
    x = torch.randn(sum(lens), c, generator=g)
    w = torch.randn(c, 1, k, generator=g)
    state = torch.randn(len(lens), c, k - 1, generator=g)
    full, full_state = varlen_causal_conv(x, w, cu_of(lens), None, state, activation="silu")
    starts = cu_of(lens)[:-1].tolist()
    first = torch.cat([x[s:s + m] for s, m in zip(starts, cuts, strict=True)])
    second = torch.cat([x[s + m:s + n] for s, m, n in zip(starts, cuts, lens, strict=True)])
    o1, s1 = varlen_causal_conv(first, w, cu_of(cuts), None, state, activation="silu")
    rest = [n - m for n, m in zip(lens, cuts, strict=True)]
    o2, s2 = varlen_causal_conv(second, w, cu_of(rest), None, s1, activation="silu")
    assert torch.equal(s2, full_state)
    got = torch.cat([torch.cat([o1[a:b], o2[c0:c1]]) for a, b, c0, c1 in zip(
        cu_of(cuts)[:-1].tolist(), cu_of(cuts)[1:].tolist(), cu_of(rest)[:-1].tolist(),
        cu_of(rest)[1:].tolist(), strict=True)])
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)


def test_float64_extension_and_bfloat16() -> None:
    recipe = vcc.conformance_recipes()[2]
    for dtype in (torch.float64, torch.bfloat16):
        ins, attrs = vcc.make_inputs(recipe, dtype, 0)
        out, final = varlen_causal_conv(*ins, **attrs)
        ref, ref_state = varlen_causal_conv(*(t if t is None or t.dtype == torch.int32
                                              else t.float() for t in ins), **attrs)
        assert out.dtype == dtype and final.dtype == dtype
        tol = 1e-6 if dtype == torch.float64 else 2e-2
        assert (out.float() - ref).abs().max() <= tol
        assert torch.equal(final.float(), ref_state)
