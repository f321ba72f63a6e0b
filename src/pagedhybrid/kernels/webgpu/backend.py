"""The WebGPU PagedAttention kernel as a backend of the PagedAttention contract.

``paged_attention(...)`` is the ``webgpu`` implementation registered with the contract's
``SPEC.implement``, so it takes the signature of ``pagedhybrid.ops.paged_attention`` (positional
= ONNX Runtime input order, attributes keyword-only; the kernel gets the attributes the caller
gave) and returns
``(output, key_cache, value_cache)`` as torch tensors; the caches are updated in place (float16
CPU tensors: uploaded, updated on the device, written back). ``backend_capability()`` describes
what it serves so a dispatch registry can route to it or reject with a reason; anything outside
it raises UnsupportedConfiguration from the loader before any GPU work.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedhybrid.kernels.webgpu.loader import get_kernel
from pagedhybrid.kernels.webgpu.manifest_gen import (
    SUPPORTED_ATTRIBUTES,
    SUPPORTED_INPUTS,
    SUPPORTED_VALUES,
    bind_key,
)
from pagedhybrid.ops.paged_attention import SPEC
from pagedhybrid.ops.spec import BoundCall

OP_ID = SPEC.qualname


def backend_capability() -> dict[str, Any]:
    """What this backend serves (plain data, for the dispatch registry and provenance)."""
    return {
        "name": "webgpu",
        "op": OP_ID,
        "implementation": "WGSL package kernels/webgpu/com.microsoft.PagedAttention via wgpu-py",
        "dtypes": ["float16"],
        "cache_dtypes": ["float16"],
        "inputs": list(SUPPORTED_INPUTS),
        "attributes": list(SUPPORTED_ATTRIBUTES),
        "attribute_values": dict(SUPPORTED_VALUES),
        "kv_cache_layout": ["SEPARATE"],
        "head_size": "multiple of 8",
        "block_size": "power of two >= 16",
        "requires": {"wgpu_features": ["shader-f16"]},
        "in_place_caches": True,
        "device": "any WebGPU adapter with shader-f16 (lavapipe on CPU-only machines)",
    }


@SPEC.implement("webgpu")
def paged_attention(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same call as the torch reference; runs the WebGPU package kernel."""
    bound = {bind_key(n): t.detach().cpu() if isinstance(t, torch.Tensor) else t
             for n, t in call.named_inputs.items() if t is not None}
    kc, vc = call["key_cache"], call["value_cache"]
    result = get_kernel(OP_ID, version=1)(bound, call.given_attrs)
    out = torch.from_numpy(result["outputT"])
    # The bound caches share storage with the caller's tensors (detach/cpu of a CPU tensor), and
    # the loader writes the updated caches back into them: the update is in place.
    assert isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    return out, kc, vc
