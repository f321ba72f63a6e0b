"""Fast CPU GatedDeltaNet == the reference recurrence (fp32 1e-5, fp64 1e-10, bf16 1 ulp).

bf16 tolerance: both implementations read the same bf16 inputs and compute in float32, so the
float32 results differ by ~1e-7 and the bf16 outputs by at most one bf16 rounding step
(``rtol = 2**-7``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.cpu import gated_delta_net

ref_mod = importlib.import_module("pagedhybrid.ops.gated_delta_net")

fast_mod = importlib.import_module("pagedhybrid.kernels.cpu.gated_delta_net")
RULES = ("linear", "gated", "delta", "gated_delta")
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
       torch.bfloat16: (2**-7, 1e-5)}  # (rtol, atol)


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def assert_same(ins: list, attrs: dict, dtype: torch.dtype) -> None:
    want_o, want_s, *want_u = ref_mod.gated_delta_net(*ins, **attrs)
    got_o, got_s, *got_u = gated_delta_net(*ins, **attrs)
    # a capturing call's state_update: the contract's exact capture, bitwise (absent otherwise)
    assert len(got_u) == len(want_u) == (1 if attrs.get("state_update_capacity") else 0)
    assert all(torch.equal(g, w) for g, w in zip(got_u, want_u, strict=True))
    rtol, atol = TOL[dtype]
    assert got_o.dtype == want_o.dtype and got_s.dtype == want_s.dtype
    assert got_o.shape == want_o.shape and got_s.shape == want_s.shape
    torch.testing.assert_close(got_o, want_o, rtol=rtol, atol=atol)
    srtol, satol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(got_s, want_s, rtol=srtol, atol=satol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("recipe", ref_mod.conformance_recipes(), ids=lambda r: r["name"])
def test_recipes_match_reference(recipe: dict, dtype: torch.dtype) -> None:
    ins, attrs = ref_mod.make_inputs(recipe, dtype, seed=3)
    assert_same(ins, attrs, dtype)


def random_case(lens: list[int], hk: int, hv: int, dk: int, dv: int, rule: str, per_key: bool,
                seed: int, dtype: torch.dtype = torch.float32, fused: bool = False,
                state: bool = True) -> tuple[list, dict]:
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)
    f64 = torch.float64
    q = torch.randn(t, hk, dk, generator=gen, dtype=f64)
    k = torch.randn(t, hk, dk, generator=gen, dtype=f64)
    v = torch.randn(t, hv, dv, generator=gen, dtype=f64) * 0.5
    gshape = (t, hv, dk) if per_key else (t, hv)
    attrs: dict = {"update_rule": rule, "qk_l2_norm": 1}
    decay = beta = a_log = dt_bias = None
    if rule in ("gated", "gated_delta"):
        if fused:
            decay = torch.randn(*gshape, generator=gen, dtype=f64)
            a_log = torch.randn(hv, generator=gen) * 0.5
            dt_bias = torch.randn(hv, generator=gen) * 0.5
            attrs["gate_activation"] = "qwen"
        else:
            decay = -(0.02 + 0.5 * torch.rand(*gshape, generator=gen, dtype=f64))
    if "delta" in rule:
        beta = torch.randn(t, hv, generator=gen, dtype=f64)
        attrs["beta_activation"] = "sigmoid"
    sd = f64 if dtype == f64 else torch.float32
    s0 = (torch.randn(b, hv, dv, dk, generator=gen, dtype=f64) * 0.5).to(sd) if state else None
    ins = [q.to(dtype), k.to(dtype), v.to(dtype), cu_of(lens),
           None if decay is None else decay.to(dtype), None if beta is None else beta.to(dtype),
           s0, None if a_log is None else a_log.to(sd), None if dt_bias is None else
           dt_bias.to(sd), None, None]
    return ins, attrs


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.sampled_from([0, 1, 1, 2, 5, 17, 63, 64, 65, 70]), min_size=1,
                     max_size=5).filter(lambda x: sum(x) > 0),
       hk=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 2, 4]),
       rule=st.sampled_from(RULES), per_key=st.booleans(), fused=st.booleans(),
       chunk=st.sampled_from([64, 64, 16, 5]), seed=st.integers(0, 2**16))
def test_property_random_packing(lens: list[int], hk: int, ratio: int, rule: str,
                                 per_key: bool, fused: bool, chunk: int, seed: int) -> None:
    per_key = per_key and rule in ("gated", "gated_delta")
    ins, attrs = random_case(lens, hk, hk * ratio, 8, 4, rule, per_key, seed, fused=fused)
    attrs["chunk_size"] = chunk
    assert_same(ins, attrs, torch.float32)


@pytest.mark.parametrize("lens", [[63, 64, 65], [127, 128, 129, 1], [1, 200, 3, 64]])
@pytest.mark.parametrize("per_key", [False, True])
def test_chunk_boundary_lengths(lens: list[int], per_key: bool) -> None:
    ins, attrs = random_case(lens, 2, 4, 16, 8, "gated_delta", per_key, seed=5, fused=True)
    assert_same(ins, attrs, torch.float32)


def test_long_sequences_2k_tokens_fp32_and_bf16() -> None:
    lens = [2100, 65, 1, 0, 300]
    for dtype in (torch.float32, torch.bfloat16):
        ins, attrs = random_case(lens, 1, 2, 16, 16, "gated_delta", False, seed=9, dtype=dtype,
                                 fused=True)
        assert_same(ins, attrs, dtype)


def test_small_groups_and_decode_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # many precompute groups and many decode blocks exercise the group / block seams
    monkeypatch.setattr(fast_mod, "GROUP_TOKENS", 1)
    monkeypatch.setattr(fast_mod, "DECODE_BLOCK_BYTES", 1)
    lens = [1, 130, 1, 64, 1, 1, 7]
    ins, attrs = random_case(lens, 2, 4, 8, 8, "gated_delta", False, seed=2, fused=True)
    assert_same(ins, attrs, torch.float32)
    ins, attrs = random_case(lens, 1, 2, 8, 8, "gated", True, seed=3)
    assert_same(ins, attrs, torch.float32)


def test_decode_only_batch_without_state_and_float64() -> None:
    ins, attrs = random_case([1] * 9, 2, 4, 8, 8, "gated_delta", False, seed=4,
                             dtype=torch.float64, fused=True, state=False)
    assert_same(ins, attrs, torch.float64)


def test_validation_is_the_contracts() -> None:
    ins, attrs = random_case([3, 4], 1, 2, 4, 4, "gated_delta", False, seed=1)
    bad = list(ins)
    bad[3] = torch.tensor([0, 5, 4], dtype=torch.int32)  # decreasing cu_seqlens
    for fn in (ref_mod.gated_delta_net, gated_delta_net):
        with pytest.raises(ContractViolation) as err:
            fn(*bad, **attrs)
        assert err.value.where == "cu_seqlens"
