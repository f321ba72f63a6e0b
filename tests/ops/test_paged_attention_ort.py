"""The reference against ONNX Runtime's own PagedAttention (WebGPU plugin EP on lavapipe, fp16).

One session per recipe (each is a distinct model signature); caches bound in place through
IOBinding. Needs onnxruntime + onnxruntime-ep-webgpu and a Vulkan adapter: a missing piece makes
these tests FAIL, never skip.

Bounds: output max |err| <= 2e-3 (ORT accumulates in float16; the recipes keep values at
std 0.5 so outputs sit mostly below 2, where 2e-3 is ~2 fp16 ulps). Caches must be bit-identical,
except keys rotated by RoPE, which ORT computes with float16 roundings of x*cos and x*sin: about
8% of those elements differ, by at most one fp16 ulp of the operands (<= 1.95e-3 measured), so
they get the 2e-3 bound; value caches and every untouched slot stay bit-identical.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.onnxruntime import paged_attention as ort_pa
from pagedhybrid.kernels.onnxruntime.session import run_single_node

pa = importlib.import_module("pagedhybrid.ops.paged_attention")

ORT_RECIPES = [r for r in pa.conformance_recipes() if "onnxruntime" in r["backends"]]
REF_ONLY = [r for r in pa.conformance_recipes() if "onnxruntime" not in r["backends"]]
OUT_ATOL = 2e-3
ROTATED_KEY_ATOL = 2e-3  # one fp16 ulp of operands in [2, 4): ORT rounds x*cos and x*sin in fp16


def _clone(inputs):
    return [t.clone() if t is not None else None for t in inputs]


def test_adapter_present():
    """The WebGPU plugin EP must be importable and expose an adapter (fails, never skips)."""
    from pagedhybrid.kernels.onnxruntime.session import webgpu_ep_device

    assert webgpu_ep_device() is not None
    assert ort_pa.EP == "webgpu"
    assert (torch.float16,) == ort_pa.DTYPES


@pytest.mark.parametrize("recipe", ORT_RECIPES, ids=lambda r: r["name"])
def test_reference_matches_onnxruntime(recipe):
    seed = 1000 + [r["name"] for r in ORT_RECIPES].index(recipe["name"])
    inputs, attrs = pa.make_inputs(recipe, torch.float16, seed)
    kc0 = inputs[3].clone()
    ref_out, ref_kc, ref_vc = pa.paged_attention(*_clone(inputs), **attrs)
    out, kc, vc = ort_pa.paged_attention(*inputs, **attrs)
    assert kc is inputs[3] and vc is inputs[4]  # updated in place, like the reference
    assert out.shape == ref_out.shape and out.dtype == torch.float16
    if out.numel():
        err = (out.float() - ref_out.float()).abs().max().item()
        assert err <= OUT_ATOL, f"{recipe['name']}: max |out - ref| = {err:.3e}"
    assert torch.equal(vc, ref_vc)
    if recipe["attrs"].get("do_rotary"):
        written = (ref_kc != kc0).any(dim=(2, 3))  # [num_blocks, block_size] slots written
        assert torch.equal(kc[~written], ref_kc[~written])
        diff = (kc.float() - ref_kc.float()).abs().max().item()
        assert diff <= ROTATED_KEY_ATOL, f"rotated keys off by {diff:.3e}"
    else:
        assert torch.equal(kc, ref_kc)


@pytest.mark.parametrize("recipe", REF_ONLY, ids=lambda r: r["name"])
def test_adapter_rejects_what_webgpu_does_not_serve(recipe):
    inputs, attrs = pa.make_inputs(recipe, torch.float16, 0)
    with pytest.raises(UnsupportedConfiguration, match="onnxruntime/webgpu"):
        ort_pa.paged_attention(*inputs, **attrs)


@pytest.mark.parametrize("cache", ["int8", "float8e4m3fn"])
def test_webgpu_refuses_quantized_caches_by_running(cache):
    """ORT itself: a session with an int8 / float8e4m3fn cache fails on the WebGPU EP (the
    adapter's and the exporter's refusal quote this answer)."""
    import onnxruntime as ort

    from pagedhybrid.kernels.onnxruntime.session import single_node_model, webgpu_ep_device

    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "int8_per_channel")
    recipe = {**recipe, "dims": {**recipe["dims"], "cache_dtype": cache}}
    inputs, attrs = pa.make_inputs(recipe, torch.float16, 0)
    pa.validate(inputs, attrs)  # a valid call of the contract
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_provider_for_devices([webgpu_ep_device()], {})
    model = single_node_model(pa.SPEC, inputs, attrs, 3).SerializeToString()
    with pytest.raises(Exception, match=ort_pa.QUANTIZED_CACHE_ERROR):
        ort.InferenceSession(model, sess_options=so)
    with pytest.raises(UnsupportedConfiguration, match="quantized"):
        ort_pa.paged_attention(*inputs, **attrs)


def test_adapter_rejects_float32():
    recipe = ORT_RECIPES[0]
    inputs, attrs = pa.make_inputs(recipe, torch.float32, 0)
    with pytest.raises(UnsupportedConfiguration, match="float16"):
        ort_pa.paged_attention(*inputs, **attrs)


def test_webgpu_decode_window_keeps_w_keys():
    """Pins the measured deviation: in decode, ORT WebGPU's local_window_size=w keeps w keys
    (the contract, like ORT CPU GQA and CUDA, keeps w + 1), i.e. it equals our w - 1."""
    recipe = {"name": "decode_window", "dims": {
        "seqs": [[20, 1], [9, 1]], "head_size": 32, "block_size": 16, "spare_blocks": 2,
        "packed_qkv": False, "rotary_dim": 0, "head_sink": False, "qk_norm": False,
        "slot_mapping": None, "attention_metadata": None},
        "attrs": {"num_heads": 4, "kv_num_heads": 2, "local_window_size": 5},
        "backends": ["reference"]}
    inputs, attrs = pa.make_inputs(recipe, torch.float16, 7)
    ort_out, _, _ = run_single_node(pa.SPEC, _clone(inputs), attrs, n_outputs=3, ep="webgpu",
                                    inplace={3: 1, 4: 2})
    same, _, _ = pa.paged_attention(*_clone(inputs), **{**attrs, "local_window_size": 4})
    contract, _, _ = pa.paged_attention(*_clone(inputs), **attrs)
    assert (ort_out.float() - same.float()).abs().max() <= OUT_ATOL
    assert (ort_out.float() - contract.float()).abs().max() > 10 * OUT_ATOL
