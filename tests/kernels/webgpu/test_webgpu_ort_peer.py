"""The benchmark peer: ONNX Runtime's WebGPU PagedAttention with resident, aliased caches.

Checks the peer's IOBinding (caches bound once as input and aliasing output on the device) on a
small decode step against the reference, so the benchmark compares like with like. Needs
onnxruntime-ep-webgpu and a Vulkan adapter: fails, never skips, without them.
"""

from __future__ import annotations

import numpy as np

from pagedhybrid.kernels.webgpu.cases import make_case, to_onnx_names
from pagedhybrid.kernels.webgpu.ort_peer import OrtWebGpuPagedAttention
from pagedhybrid.kernels.webgpu.testsuite import reference


def test_peer_decode_step_matches_reference_and_updates_device_caches(kernel) -> None:
    recipe = {"seqs": [[33, 1], [7, 1]], "num_heads": 4, "kv_num_heads": 2, "head_size": 64,
              "seed": 7}
    inputs, attrs = make_case(recipe)
    want = reference(inputs, attrs)
    peer = OrtWebGpuPagedAttention(to_onnx_names({k: v.copy() for k, v in inputs.items()}),
                                   attrs)
    out = peer()
    np.testing.assert_allclose(out.astype(np.float32), want["outputT"].astype(np.float32),
                               atol=2e-3, rtol=2e-3)
    np.testing.assert_array_equal(peer.read_cache("key_cache"), want["keyCacheT"])
    np.testing.assert_array_equal(peer.read_cache("value_cache"), want["valueCacheT"])
    ours = kernel({k: v.copy() for k, v in inputs.items()}, attrs)["outputT"]
    np.testing.assert_allclose(ours.astype(np.float32), out.astype(np.float32),
                               atol=3e-3, rtol=3e-3)
