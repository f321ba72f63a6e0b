"""The WebGPU PagedAttention kernel as a backend of the PagedAttention contract.

``paged_attention(...)`` has the signature of ``pagedhybrid.ops.paged_attention.paged_attention``
(positional = ONNX Runtime input order, keyword = attribute names) and returns
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

OP_ID = "com.microsoft.PagedAttention"
_ORDER = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
          "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink",
          "q_norm_weight", "k_norm_weight", "k_scale", "v_scale", "attention_metadata")


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


def paged_attention(*inputs: torch.Tensor | None, **attrs: Any
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same call as the torch reference; runs the WebGPU package kernel."""
    if len(inputs) > len(_ORDER):
        raise TypeError(f"paged_attention takes at most {len(_ORDER)} positional inputs")
    named = dict(zip(_ORDER, inputs, strict=False))
    for name in _ORDER:
        if name in attrs:  # inputs given by keyword
            named[name] = attrs.pop(name)
    bound = {bind_key(n): t.detach().cpu() if isinstance(t, torch.Tensor) else t
             for n, t in named.items() if t is not None}
    kc, vc = named.get("key_cache"), named.get("value_cache")
    result = get_kernel(OP_ID, version=1)(bound, attrs)
    out = torch.from_numpy(result["outputT"])
    # The bound caches share storage with the caller's tensors (detach/cpu of a CPU tensor), and
    # the loader writes the updated caches back into them: the update is in place.
    assert isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    return out, kc, vc
