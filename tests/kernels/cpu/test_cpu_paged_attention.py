"""Fast CPU PagedAttention == the reference (fp32 1e-5, fp64 1e-10, bf16 documented below).

Caches must come out bitwise equal (the same K/V, rounded to the cache type, in the same slots;
untouched slots keep their garbage). bf16: the fast path attends in bf16 tiles with float32
accumulation (q rounded to bf16 as ONNX Runtime's kernels do, probabilities rounded to bf16
before the P.V product, partial outputs rounded before the lse merge), the reference entirely in
float32; measured differences are at most 2 bf16 ulps of O(1) outputs (7.8e-3), so the
documented tolerance is ``rtol = atol = 2**-6`` (fp16: ``2**-8``, measured 1 ulp).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.cpu import paged_attention

ref_mod = importlib.import_module("pagedhybrid.ops.paged_attention")

fast_mod = importlib.import_module("pagedhybrid.kernels.cpu.paged_attention")
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
       torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-8, 2**-8)}


def _clone(inputs: list) -> list:
    return [None if x is None else x.clone() for x in inputs]


def assert_same(inputs: list, attrs: dict, dtype: torch.dtype) -> None:
    want, want_k, want_v = ref_mod.paged_attention(*_clone(inputs), **attrs)
    ins = _clone(inputs)
    got, got_k, got_v = paged_attention(*ins, **attrs)
    assert got_k is ins[3] and got_v is ins[4]  # caches updated in place and returned
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ref_mod.conformance_recipes(), ids=lambda r: r["name"])
def test_recipes_match_reference(recipe: dict, dtype: torch.dtype) -> None:
    inputs, attrs = ref_mod.make_inputs(recipe, dtype, seed=3)
    assert_same(inputs, attrs, dtype)


@st.composite
def paged_case(draw: st.DrawFn) -> tuple[dict, int, int]:
    hkv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    batch = draw(st.integers(1, 5))
    seqs = [[draw(st.sampled_from([0, 1, 5, 15, 16, 17, 31, 32, 33, 40, 70])),
             draw(st.sampled_from([0, 1, 1, 1, 2, 3, 7, 16, 17]))] for _ in range(batch)]
    attrs = {"num_heads": hkv * ratio, "kv_num_heads": hkv,
             "is_causal": draw(st.sampled_from([1, 1, 0])),
             "local_window_size": draw(st.sampled_from([-1, -1, 1, 4, 20])),
             "softcap": draw(st.sampled_from([0.0, 0.0, 3.0])),
             "scale": draw(st.sampled_from([0.0, 0.3]))}
    rotary = draw(st.sampled_from([0, 0, 16]))
    if rotary:
        attrs.update(do_rotary=1, rotary_interleaved=draw(st.sampled_from([0, 1])))
    recipe = {"name": "prop", "dims": {
        "seqs": seqs, "head_size": draw(st.sampled_from([16, 32])),
        "block_size": draw(st.sampled_from([16, 32])), "spare_blocks": draw(st.integers(0, 3)),
        "packed_qkv": draw(st.booleans()), "rotary_dim": rotary,
        "head_sink": draw(st.booleans()), "qk_norm": draw(st.booleans()),
        "slot_mapping": draw(st.sampled_from([None, "derived", "skip_every_3rd"])),
        "attention_metadata": draw(st.sampled_from([None, "exact"]))},
        "attrs": attrs, "backends": ["reference"]}
    tile = draw(st.sampled_from([1, 4096, fast_mod.TILE_BYTES]))
    return recipe, draw(st.integers(0, 2**16)), tile


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_case())
def test_property_random_packing_and_pages(case: tuple[dict, int, int]) -> None:
    recipe, seed, tile = case
    inputs, attrs = ref_mod.make_inputs(recipe, torch.float32, seed)
    old = fast_mod.TILE_BYTES
    fast_mod.TILE_BYTES = tile  # 1: one page per tile, every merge seam exercised
    try:
        assert_same(inputs, attrs, torch.float32)
    finally:
        fast_mod.TILE_BYTES = old


def _long_recipe(seqs: list[list[int]], **attrs: object) -> dict:
    return {"name": "long", "dims": {
        "seqs": seqs, "head_size": 16, "block_size": 16, "spare_blocks": 2, "packed_qkv": False,
        "rotary_dim": 0, "head_sink": False, "qk_norm": False, "slot_mapping": None,
        "attention_metadata": None},
        "attrs": {"num_heads": 4, "kv_num_heads": 1, **attrs}, "backends": ["reference"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_decode_and_prefill(dtype: torch.dtype,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # decode over >= 2k cached tokens, a 2k-token chunked prefill with history, short ones
    recipe = _long_recipe([[2100, 1], [63, 1], [64, 1], [65, 1], [30, 2050], [0, 1]])
    inputs, attrs = ref_mod.make_inputs(recipe, dtype, seed=5)
    monkeypatch.setattr(fast_mod, "TILE_BYTES", 64 << 10)  # several page ranges per sequence
    assert_same(inputs, attrs, dtype)


def test_long_context_window_softcap_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _long_recipe([[2050, 1], [900, 300], [5, 1]], local_window_size=100, softcap=5.0)
    recipe["dims"]["head_sink"] = True
    inputs, attrs = ref_mod.make_inputs(recipe, torch.float32, seed=6)
    monkeypatch.setattr(fast_mod, "TILE_BYTES", 32 << 10)
    assert_same(inputs, attrs, torch.float32)


def test_validation_is_the_contracts() -> None:
    recipe = next(r for r in ref_mod.conformance_recipes() if r["name"] == "packed_qkv")
    inputs, attrs = ref_mod.make_inputs(recipe, torch.float32, seed=1)
    inputs[7] = inputs[7].clone()
    inputs[7][0, 0] = inputs[3].shape[0]  # a needed page outside the pool
    for fn in (ref_mod.paged_attention, paged_attention):
        with pytest.raises(ContractViolation) as err:
            fn(*_clone(inputs), **attrs)
        assert err.value.where == "block_table"


def test_compute_on_prevalidated_dims_matches_call() -> None:
    recipe = next(r for r in ref_mod.conformance_recipes()
                  if r["name"] == "rotary_sink_scale_metadata_gqa4")
    inputs, attrs = ref_mod.make_inputs(recipe, torch.float32, seed=2)
    dims = ref_mod.validate(inputs, attrs)
    a = _clone(inputs)
    out_a = fast_mod.compute(a, dims)[0]
    out_b = paged_attention(*_clone(inputs), **attrs)[0]
    assert torch.equal(out_a, out_b)
