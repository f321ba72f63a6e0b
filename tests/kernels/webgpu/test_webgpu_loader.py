"""The Python loader's API: aliasing caches, output derivation, typed rejections, dispatch shim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.webgpu import GpuTensor, backend_capability, get_kernel, paged_attention
from pagedhybrid.kernels.webgpu.cases import make_case
from pagedhybrid.kernels.webgpu.runner import gpu
from pagedhybrid.kernels.webgpu.testsuite import reference

RECIPE = {"seqs": [[20, 3], [5, 1], [0, 4]], "num_heads": 4, "kv_num_heads": 2,
          "head_size": 64, "block_size": 16, "seed": 42}
TOL = 2e-3


def _close(a, b, tol=TOL) -> None:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


def test_get_kernel_is_cached_and_versioned() -> None:
    k = get_kernel("com.microsoft.PagedAttention", version=1)
    assert k is get_kernel("com.microsoft.PagedAttention")
    with pytest.raises(UnsupportedConfiguration):
        get_kernel("com.microsoft.PagedAttention", version=2)


def test_resident_caches_alias_and_carry_state_across_steps(kernel) -> None:
    inputs, attrs = make_case(RECIPE)
    kc, vc = GpuTensor.from_numpy(inputs["keyCacheT"]), GpuTensor.from_numpy(inputs["valueCacheT"])
    call = {**inputs, "keyCacheT": kc, "valueCacheT": vc}
    out = kernel(call, attrs)
    assert out["keyCacheT"] is kc and out["valueCacheT"] is vc
    assert out["outputT"].shape == (8, 4 * 64) and out["outputT"].dtype == np.float16
    want = reference(inputs, attrs)
    _close(out["outputT"], want["outputT"])
    np.testing.assert_array_equal(kc.numpy(), want["keyCacheT"])
    # a decode step on top of the updated device caches sees the previous step's K/V
    step2 = dict(RECIPE, seqs=[[23, 1], [6, 1], [4, 1]], seed=43)
    inputs2, _ = make_case(step2)
    inputs2["blockTableT"] = inputs["blockTableT"]
    host = {**inputs2, "keyCacheT": want["keyCacheT"], "valueCacheT": want["valueCacheT"]}
    out2 = kernel({**inputs2, "keyCacheT": kc, "valueCacheT": vc}, attrs)
    want2 = reference(host, attrs)
    _close(out2["outputT"], want2["outputT"])
    np.testing.assert_array_equal(vc.numpy(), want2["valueCacheT"])


def test_host_caches_are_updated_in_place(kernel) -> None:
    inputs, attrs = make_case(dict(RECIPE, slot_mapping="skip"))
    call = {k: v.copy() for k, v in inputs.items()}
    out = kernel(call, attrs)
    assert out["keyCacheT"] is call["keyCacheT"]
    want = reference(inputs, attrs)
    np.testing.assert_array_equal(call["keyCacheT"], want["keyCacheT"])
    np.testing.assert_array_equal(call["valueCacheT"], want["valueCacheT"])


def test_token_count_zero_does_no_gpu_work(kernel) -> None:
    inputs, attrs = make_case(dict(RECIPE, seqs=[[7, 0], [3, 0]]))
    before = inputs["keyCacheT"].copy()
    out = kernel(inputs, attrs)
    assert out["outputT"].shape == (0, 4 * 64) and out["outputT"].dtype == np.float16
    assert kernel.last["variant"] is None and kernel.last["dispatches"] == []
    np.testing.assert_array_equal(out["keyCacheT"], before)


def test_second_identical_call_compiles_nothing(kernel) -> None:
    inputs, attrs = make_case(RECIPE)
    kernel(inputs, attrs)
    n = gpu().compiles
    kernel(inputs, attrs)
    assert gpu().compiles == n


def test_split_k_and_tiled_agree(kernel) -> None:
    inputs, attrs = make_case(dict(RECIPE, seqs=[[200, 1], [90, 1]]))
    tiled = kernel({k: v.copy() for k, v in inputs.items()}, attrs)["outputT"]
    assert kernel.last["variant"] == "tiled"
    split = kernel({k: v.copy() for k, v in inputs.items()}, attrs,
                   tunables={"splitKMinContext": 32, "splitKMinChunk": 32})["outputT"]
    assert kernel.last["variant"] == "flash-decode-splitk"
    assert kernel.last["derive"]["numSplits"] > 1
    _close(split, tiled)
    _close(split, reference(inputs, attrs)["outputT"])


def test_args_are_upper_bounds(kernel) -> None:
    inputs, attrs = make_case(RECIPE)
    want = reference(inputs, attrs)["outputT"]
    got = kernel({k: v.copy() for k, v in inputs.items()}, attrs,
                 args={"maxQueryLen": 9, "maxKvLen": 64})["outputT"]
    _close(got, want)
    with pytest.raises(ContractViolation, match="upper bound"):
        kernel(inputs, attrs, args={"maxKvLen": 5})
    with pytest.raises(ContractViolation, match="not an argument"):
        kernel(inputs, attrs, args={"maxBatch": 5})
    with pytest.raises(ContractViolation, match="not a tunable"):
        kernel(inputs, attrs, tunables={"unroll": 5})


def _rejects(kernel, call, attrs, error, match):
    kernel.last = {"sentinel": True}
    compiles = gpu().compiles
    with pytest.raises(error, match=match):
        kernel(call, attrs)
    assert kernel.last == {"sentinel": True} and gpu().compiles == compiles  # no GPU work


def test_typed_rejections_before_gpu_work(kernel) -> None:
    inputs, attrs = make_case(RECIPE)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    bf16 = {**t, **{k: t[k].to(torch.bfloat16) for k in ("queryT", "keyT", "valueT",
                                                           "keyCacheT", "valueCacheT")}}
    _rejects(kernel, bf16, attrs, UnsupportedConfiguration, "bfloat16")
    _rejects(kernel, t, {**attrs, "is_causal": 2}, UnsupportedConfiguration, "is_causal")
    _rejects(kernel, t, {**attrs, "do_rotary": 1}, UnsupportedConfiguration, "do_rotary")
    _rejects(kernel, t, {**attrs, "kv_cache_layout": "LATENT"}, UnsupportedConfiguration,
             "kv_cache_layout")
    _rejects(kernel, {**t, "qNormWeightT": torch.ones(64, dtype=torch.float16)}, attrs,
             UnsupportedConfiguration, "q_norm_weight")
    _rejects(kernel, {**t, "queryT": t["queryT"].float()}, attrs, ContractViolation, "float16")
    _rejects(kernel, {k: v for k, v in t.items() if k != "pastSeqlensT"}, attrs,
             ContractViolation, "required input")
    _rejects(kernel, {**t, "queryT": t["queryT"][None]}, attrs, ContractViolation, "rank")
    _rejects(kernel, {**t, "queryT": inputs["queryT"].tolist()}, attrs, ContractViolation,
             "numpy array")
    _rejects(kernel, t, {"num_heads": 4, "kv_num_heads": 3}, ContractViolation, "kv_num_heads")
    short = {**t, "blockTableT": t["blockTableT"][:, :1].contiguous()}
    _rejects(kernel, short, attrs, ContractViolation, "block_table")
    # ONNX Runtime defaults of unimplemented attributes ask nothing and are accepted
    kernel(inputs, {**attrs, "softcap": 0.0, "local_window_size": -1, "do_rotary": 0})


def test_dispatch_shim_matches_the_reference_in_place() -> None:
    from pagedhybrid.ops.paged_attention import SPEC
    from pagedhybrid.ops.paged_attention import paged_attention as ref_pa

    inputs, attrs = make_case(dict(RECIPE, packed_qkv=True))
    from pagedhybrid.kernels.webgpu.cases import to_onnx_names

    named = to_onnx_names(inputs)

    def args():
        return [torch.from_numpy(named[p.name].copy()) if p.name in named else None
                for p in SPEC.inputs]

    ours_in, ref_in = args(), args()
    out, kc, vc = paged_attention(*ours_in, **attrs)
    r_out, r_kc, r_vc = ref_pa(*ref_in, **attrs)
    assert kc is ours_in[3] and vc is ours_in[4]
    _close(out, r_out)
    assert torch.equal(kc, r_kc) and torch.equal(vc, r_vc)


def test_backend_capability() -> None:
    cap = backend_capability()
    assert cap["op"] == "com.microsoft.PagedAttention" and cap["dtypes"] == ["float16"]
    assert "slot_mapping" in cap["inputs"] and "cos_cache" not in cap["inputs"]
    assert cap["attribute_values"] == {"is_causal": [0, 1]}
