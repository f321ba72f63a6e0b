"""The native kernels behind the three operator contracts, on every conformance recipe.

Each recipe runs through ``kernels.native.contract`` and the torch reference on the same inputs:
outputs within the dtype's tolerance, caches bitwise equal. Calls the native kernels cannot serve
are handed to the torch kernels -- declared in ``COVERAGE`` and visible in ``last_path`` --
and every op must run natively on the recipes of the model's form. Corrupted calls raise the
contract's ``ContractViolation`` naming the port.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native import contract

gdn_ref = importlib.import_module("pagedhybrid.ops.gated_delta_net")
pa_ref = importlib.import_module("pagedhybrid.ops.paged_attention")
conv_ref = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8}
PATHS: dict[str, set[str]] = {}


def _clone(xs: list) -> list:
    return [None if x is None else x.clone() for x in xs]


def _run(op: str, ref, fn, inputs: list, attrs: dict, dtype: torch.dtype) -> None:
    want = ref(*_clone(inputs), **attrs)
    got_in = _clone(inputs)
    got = fn(*got_in, **attrs)
    PATHS.setdefault(op, set()).add(contract.last_path(op) or "?")
    tol = TOL[dtype]
    for g, w in zip(got, want, strict=False):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
    if op == "paged_attention":
        assert torch.equal(got_in[3], want[1]) and torch.equal(got_in[4], want[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", pa_ref.conformance_recipes(), ids=lambda r: r["name"])
def test_paged_attention_recipes(recipe: dict, dtype: torch.dtype) -> None:
    inputs, attrs = pa_ref.make_inputs(recipe, dtype, seed=5)
    _run("paged_attention", pa_ref.paged_attention, contract.paged_attention, inputs, attrs,
         dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", gdn_ref.conformance_recipes(), ids=lambda r: r["name"])
def test_gated_delta_net_recipes(recipe: dict, dtype: torch.dtype) -> None:
    inputs, attrs = gdn_ref.make_inputs(recipe, dtype, seed=5)
    _run("gated_delta_net", gdn_ref.gated_delta_net, contract.gated_delta_net, inputs, attrs,
         dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", conv_ref.conformance_recipes(), ids=lambda r: r["name"])
def test_conv_recipes(recipe: dict, dtype: torch.dtype) -> None:
    inputs, attrs = conv_ref.make_inputs(recipe, dtype, seed=5)
    _run("varlen_causal_conv", conv_ref.varlen_causal_conv, contract.varlen_causal_conv, inputs,
         attrs, dtype)


def _recipe(name: str) -> dict:
    return next(r for r in pa_ref.conformance_recipes() if r["name"] == name)


def _decode_case(b: int = 3, hk: int = 2, hv: int = 4, d: int = 16) -> tuple[list, dict]:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(b, hk, d, generator=gen), dim=-1)
            for _ in "qk")
    ins = [q, k, torch.randn(b, hv, d, generator=gen), torch.arange(b + 1, dtype=torch.int32),
           torch.randn(b, hv, generator=gen), torch.randn(b, hv, generator=gen),
           torch.randn(b, hv, d, d, generator=gen), torch.randn(hv, generator=gen) * 0.5,
           torch.randn(hv, generator=gen) * 0.5]
    return ins, {"gate_activation": "qwen", "beta_activation": "sigmoid", "scale": 0.25}


@pytest.mark.parametrize("head_size", [8, 24, 40])
@pytest.mark.parametrize("name", ["page_boundaries_15_16_17", "mixed_gqa4_block64",
                                  "int8_per_channel", "fp8_per_tensor"])
def test_paged_attention_head_sizes_beyond_whole_vectors(name: str, head_size: int) -> None:
    """Head sizes that are not whole 16-lane vectors run natively (their last chunk loaded
    zero-filled) and agree with the reference."""
    recipe = _recipe(name)
    recipe = {**recipe, "dims": {**recipe["dims"], "head_size": head_size}}
    for dtype in (torch.float32, torch.bfloat16):
        inputs, attrs = pa_ref.make_inputs(recipe, dtype, seed=5)
        _run("paged_attention", pa_ref.paged_attention, contract.paged_attention, inputs, attrs,
             dtype)
        assert contract.last_path("paged_attention") == "native", (name, head_size, dtype)


@pytest.mark.parametrize("cache", [None, "int8"])
@pytest.mark.parametrize("name", ["bidirectional_block", "bidirectional_window_long",
                                  "local_window", "local_window_decode_long"])
def test_paged_attention_masks_run_natively(name: str, cache: str | None) -> None:
    """``is_causal=0`` (a block drafter's bidirectional block) and ``local_window_size`` run in
    the native tile -- not delegated, never causal in their place -- and agree with the
    reference; a window that leaves whole KV splits out skips them (``_long``: 300 keys of
    history, splits of ``KV_SPLIT``)."""
    recipe = _recipe(name)
    if cache:
        recipe = {**recipe, "dims": {**recipe["dims"], "cache_dtype": cache},
                  "attrs": {**recipe["attrs"], "k_quant_type": "PER_CHANNEL",
                            "v_quant_type": "PER_TENSOR"}}
    for dtype in (torch.float32, torch.bfloat16):
        inputs, attrs = pa_ref.make_inputs(recipe, dtype, seed=3)
        _run("paged_attention", pa_ref.paged_attention, contract.paged_attention, inputs, attrs,
             dtype)
        assert contract.last_path("paged_attention") == "native", (name, dtype)
        causal = {**attrs, "is_causal": 1, "local_window_size": -1}
        assert not torch.allclose(contract.paged_attention(*_clone(inputs), **attrs)[0].float(),
                                  pa_ref.paged_attention(*_clone(inputs), **causal)[0].float(),
                                  atol=1e-3)  # the mask takes effect


def test_model_form_runs_natively_and_the_rest_is_declared() -> None:
    ins, attrs = _decode_case()
    _run("gated_delta_net", gdn_ref.gated_delta_net, contract.gated_delta_net, ins, attrs,
         torch.float32)
    assert contract.last_path("gated_delta_net") == "native"
    gen = torch.Generator().manual_seed(2)
    conv_in = [torch.randn(3, 24, generator=gen), torch.randn(24, 1, 4, generator=gen),
               torch.arange(4, dtype=torch.int32), torch.randn(24, generator=gen),
               torch.randn(3, 24, 3, generator=gen)]  # one token per sequence, with state
    _run("varlen_causal_conv", conv_ref.varlen_causal_conv, contract.varlen_causal_conv,
         conv_in, {"activation": "silu"}, torch.float32)
    assert contract.last_path("varlen_causal_conv") == "native"
    recipe = _recipe("decode_long_context_gqa8")
    inputs, pattrs = pa_ref.make_inputs(recipe, torch.bfloat16, seed=1)
    _run("paged_attention", pa_ref.paged_attention, contract.paged_attention, inputs, pattrs,
         torch.bfloat16)
    assert contract.last_path("paged_attention") == "native"
    for name in ("int8_per_channel", "int8_per_tensor", "fp8_per_channel", "fp8_per_tensor"):
        inputs, pattrs = pa_ref.make_inputs(_recipe(name), torch.bfloat16, seed=1)
        _run("paged_attention", pa_ref.paged_attention, contract.paged_attention, inputs,
             pattrs, torch.bfloat16)
        assert contract.last_path("paged_attention") == "native", name  # pages read in place
    softcap = next(r for r in pa_ref.conformance_recipes() if r["attrs"].get("softcap"))
    inputs, pattrs = pa_ref.make_inputs(softcap, torch.float32, seed=1)
    contract.paged_attention(*inputs, **pattrs)
    assert contract.last_path("paged_attention") == "torch"
    assert "softcap" in " ".join(contract.COVERAGE["com.microsoft.PagedAttention"].delegated)
    # over the recipes above, every op ran natively on some and was handed over on others
    for op in ("paged_attention", "gated_delta_net", "varlen_causal_conv"):
        assert PATHS.get(op, set()) >= {"native", "torch"}, (op, PATHS.get(op))


def test_corrupted_calls_name_the_port() -> None:
    recipe = _recipe("decode_long_context_gqa8")
    inputs, attrs = pa_ref.make_inputs(recipe, torch.float32, seed=1)
    bad = _clone(inputs)
    bad[7] = bad[7].clone()
    bad[7][0, 0] = bad[3].shape[0] + 5  # a page past the pool
    with pytest.raises(ContractViolation) as err:
        contract.paged_attention(*bad, **attrs)
    assert err.value.where == "block_table"
    ins, gattrs = _decode_case()
    ins[6] = ins[6][:2]  # initial_state for 2 of 3 sequences
    with pytest.raises(ContractViolation) as err:
        contract.gated_delta_net(*ins, **gattrs)
    assert err.value.where == "initial_state"
