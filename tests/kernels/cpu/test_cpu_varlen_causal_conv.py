"""Fast CPU VarlenCausalConvWithState == the reference (fp32 1e-5, fp64 1e-12, bf16 1 ulp).

The final state is raw input samples, so it must be bitwise equal in every dtype. bf16 outputs:
both sides compute in float32 from the same bf16 inputs; they differ by at most one bf16
rounding step (``rtol = 2**-7``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.cpu import varlen_causal_conv

ref_mod = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

fast_mod = importlib.import_module("pagedhybrid.kernels.cpu.varlen_causal_conv")
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
       torch.bfloat16: (2**-7, 1e-5)}


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def assert_same(ins: list, attrs: dict, dtype: torch.dtype) -> None:
    want_o, want_s, *want_u = ref_mod.varlen_causal_conv(*ins, **attrs)
    got_o, got_s, *got_u = varlen_causal_conv(*ins, **attrs)
    rtol, atol = TOL[dtype]
    assert got_o.dtype == want_o.dtype == dtype and got_s.dtype == want_s.dtype
    torch.testing.assert_close(got_o, want_o, rtol=rtol, atol=atol)
    assert torch.equal(got_s, want_s)
    # a capturing call's state_update: raw input rows, bitwise (absent when not capturing)
    assert len(got_u) == len(want_u) == (1 if attrs.get("state_update_capacity") else 0)
    assert all(torch.equal(g, w) for g, w in zip(got_u, want_u, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("recipe", ref_mod.conformance_recipes(), ids=lambda r: r["name"])
def test_recipes_match_reference(recipe: dict, dtype: torch.dtype) -> None:
    ins, attrs = ref_mod.make_inputs(recipe, dtype, seed=4)
    assert_same(ins, attrs, dtype)


def random_case(lens: list[int], channels: int, k: int, dilation: int, bias: bool,
                activation: str, seed: int, dtype: torch.dtype = torch.float32,
                state: bool = True) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(seed)
    sl = (k - 1) * dilation
    x = torch.randn(sum(lens), channels, generator=g).to(dtype)
    w = (torch.randn(channels, 1, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    s = torch.randn(len(lens), channels, sl, generator=g).to(dtype) if state else None
    return [x, w, cu_of(lens), b, s, None, None, None], {"activation": activation,
                                                         "dilation": dilation}


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=5), channels=st.integers(1, 9),
       k=st.integers(1, 5), dilation=st.integers(1, 3), bias=st.booleans(),
       activation=st.sampled_from(["none", "silu", "swish"]), state=st.booleans(),
       block=st.sampled_from([1, 3, 256]), seed=st.integers(0, 2**16))
def test_property_random_packing(lens: list[int], channels: int, k: int, dilation: int,
                                 bias: bool, activation: str, state: bool, block: int,
                                 seed: int) -> None:
    ins, attrs = random_case(lens, channels, k, dilation, bias, activation, seed, state=state)
    old = fast_mod.ROW_BLOCK
    fast_mod.ROW_BLOCK = block  # row-block seams inside and across sequences
    try:
        assert_same(ins, attrs, torch.float32)
    finally:
        fast_mod.ROW_BLOCK = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequences_and_boundaries(dtype: torch.dtype) -> None:
    lens = [2500, 1, 2, 3, 63, 64, 65, 300]
    ins, attrs = random_case(lens, 24, 4, 1, True, "silu", seed=7, dtype=dtype)
    assert_same(ins, attrs, dtype)


def test_decode_only_batch_float64() -> None:
    ins, attrs = random_case([1] * 11, 16, 4, 2, False, "silu", seed=8, dtype=torch.float64)
    assert_same(ins, attrs, torch.float64)


def test_validation_is_the_contracts() -> None:
    ins, attrs = random_case([3, 4], 4, 4, 1, False, "silu", seed=1)
    ins[2] = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty sequence: rejected
    for fn in (ref_mod.varlen_causal_conv, varlen_causal_conv):
        with pytest.raises(ContractViolation) as err:
            fn(*ins, **attrs)
        assert err.value.where == "cumulative_sequence_length"
