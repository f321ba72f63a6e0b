"""ONNX Runtime's own ``com.microsoft.PagedAttention`` kernel, as an oracle for the reference.

Runs a one-node model on the WebGPU plugin EP (``onnxruntime-ep-webgpu``; lavapipe on machines
without a GPU) with the caches bound in place through IOBinding (input 3 <-> output 1, input 4
<-> output 2), exactly as a serving runtime binds them. The caller's cache tensors are then
updated in place from the device copy, so this function has the reference's signature (it is
the ``onnxruntime`` implementation registered with ``SPEC.implement``) and in-place semantics.

The call is validated by the pagedhybrid contract first (ORT leaves bad block tables and slots as
undefined behaviour). Features the WebGPU kernel does not serve (measured with
onnxruntime-ep-webgpu 0.4.0, see ``UNSUPPORTED``) raise UnsupportedConfiguration before a session
is built.

Measured on lavapipe (plugin 0.4.0): GQA, packed QKV, zero-length queries, ``token_count == 0``,
``head_sink``, ``do_rotary`` (interleaved and rotate-half, partial), ``scale`` and
``attention_metadata`` agree with the reference. The kernel accumulates in float16, so outputs
differ by a few fp16 ulps (<= 2e-3 for |output| < 2), and its RoPE rounds in float16, so rotated
keys written to the cache may differ from the reference's by one fp16 ulp.

Local window: the WebGPU shader keeps ``w`` keys (``j > p - w``) where ORT's CPU GroupQueryAttention
and the CUDA PagedAttention test reference (flash-attention ``window_size=(w, 0)``) keep ``w + 1``
(``j >= p - w``), the contract's convention; in prefill it also diverges from both conventions for
query positions >= 8 (lavapipe, subgroup size 8), an ORT bug.
"""

from __future__ import annotations

import torch

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.onnxruntime.session import run_single_node
from pagedhybrid.ops.paged_attention import SPEC, PagedAttentionDims, validate_call
from pagedhybrid.ops.spec import BoundCall

EP = "webgpu"
DTYPES = (torch.float16,)
# What ORT answered when a PagedAttention node with an int8 / float8e4m3fn cache was given to the
# WebGPU EP (tests/ops/test_paged_attention_ort.py runs it again): its kernel registers float16
# caches only, so no EP claims the node and the session fails to initialize.
QUANTIZED_CACHE = ("no WebGPU kernel claims the node (its T_CACHE is float16 only) and session "
                   "initialization fails: \"Provider type for PagedAttention node with name '' "
                   "is not set\"")
QUANTIZED_CACHE_ERROR = "Provider type for PagedAttention node"

# Features ORT's WebGPU PagedAttention (onnxruntime-ep-webgpu 0.4.0) does not serve, measured by
# running it: the first five fail with NOT_IMPLEMENTED / a constructor ORT_ENFORCE; the local
# window runs but disagrees with the contract (see the module docstring).
UNSUPPORTED = {
    "softcap": "non-zero softcap (NOT_IMPLEMENTED)",
    "slot_mapping": "the slot_mapping input (NOT_IMPLEMENTED)",
    "rotary_offset": "rotary_offset != 0 (NOT_IMPLEMENTED)",
    "qk_norm": "q_norm_weight/k_norm_weight (NOT_IMPLEMENTED)",
    "is_causal": "is_causal=0 (rejected when the session is created)",
    "local_window_size": "local_window_size > 0 (runs, but keeps w keys instead of the "
                         "contract's w+1 and diverges further in prefill)",
}


def unsupported_features(dims: PagedAttentionDims) -> list[str]:
    """The features of a validated call that ORT's WebGPU kernel does not serve correctly."""
    a = dims.attrs
    found = []
    if a["softcap"] != 0.0:
        found.append("softcap")
    if dims.has_slot_mapping:
        found.append("slot_mapping")
    if a["rotary_offset"] != 0:
        found.append("rotary_offset")
    if dims.has_qk_norm:
        found.append("qk_norm")
    if a["is_causal"] == 0:
        found.append("is_causal")
    if a["local_window_size"] > 0:
        found.append("local_window_size")
    return found


@SPEC.implement("onnxruntime")
def paged_attention(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ORT's WebGPU PagedAttention; returns ``(output, key_cache, value_cache)``.

    Attributes as in :func:`pagedhybrid.ops.paged_attention.paged_attention`; only those given
    are put on the node (ORT applies its own defaults to the rest).
    """
    dims = validate_call(call)
    if dims.cache_dtype in (torch.int8, torch.float8_e4m3fn):
        raise UnsupportedConfiguration(
            f"{SPEC.qualname} on onnxruntime/{EP}: quantized ({dims.cache_dtype}) caches: "
            f"{QUANTIZED_CACHE}")
    if dims.dtype not in DTYPES or dims.cache_dtype not in DTYPES:
        raise UnsupportedConfiguration(
            f"{SPEC.qualname} on onnxruntime/{EP}: only float16 inputs and caches are "
            f"registered (got {dims.dtype}, cache {dims.cache_dtype})")
    bad = unsupported_features(dims)
    if bad:
        raise UnsupportedConfiguration(
            f"{SPEC.qualname} on onnxruntime/{EP}: not implemented by ORT's WebGPU kernel: "
            + ", ".join(UNSUPPORTED[f] for f in bad))
    key_cache, value_cache = call["key_cache"], call["value_cache"]
    out, kc, vc = run_single_node(SPEC, call.inputs, call.given_attrs, n_outputs=3, ep=EP,
                                  inplace={3: 1, 4: 2})
    key_cache.copy_(kc)
    value_cache.copy_(vc)
    return out, key_cache, value_cache
