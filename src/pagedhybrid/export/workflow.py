"""Workflow metadata: a runtime-neutral description of the package's three state disciplines.

``pagedhybrid_workflow.json`` says how a serving runtime must drive the graph, independently of
genai's config syntax:

* ``paged_kv`` (full-attention layers): page buffers ``[num_blocks, block_size, Hkv, hd]`` shared
  by all sequences, addressed through ``block_table``; the op scatters new K/V into the pages
  (``update.kind = paged_scatter``) and the output must alias the input (``aliasing =
  required``);
* ``fixed_conv`` / ``fixed_recurrent`` (linear layers): one row per scheduled sequence, in the order
  of ``cumulative_sequence_lengths`` (``batch_layout.kind = request_aligned``); the output replaces
  the row (``update.kind = replace``); a sequence starting with ``past_sequence_lengths == 0``
  must be given a zero row. The recurrent state is float32 V-major ``[B, Hv, Dv, Dk]``.
"""

from __future__ import annotations

from typing import Any

from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import PackedAbi, TensorSpec

SCHEMA = "pagedhybrid.workflow/v1"


def _spec(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}


def _binding(abi: PackedAbi, kind: str, past: str, present: str) -> dict[str, Any]:
    sample = abi.cache_spec(kind, past)
    return {"state": kind, "input": past, "output": present, "dtype": sample.dtype,
            "shape": list(sample.shape)}


def make_workflow(abi: PackedAbi) -> dict[str, Any]:
    o = abi.options
    paged = {
        "discipline": c.GROUP_PAGED_KV,
        "layer_ids": list(abi.full_layers),
        "bindings": [_binding(abi, "key", c.PAST_KEY, c.PRESENT_KEY),
                     _binding(abi, "value", c.PAST_VALUE, c.PRESENT_VALUE)],
        "addressing": {"block_table": c.BLOCK_TABLE, "block_size": o.block_size,
                       "past_lengths": c.PAST_SEQLENS, "unmapped": -1},
        "update": {"kind": "paged_scatter", "aliasing": "required"},
        "element_type": abi.kv_dtype,
        "quantization": {"type": o.quant_type, "symmetric": True,
                         "scales": [c.K_SCALE, c.V_SCALE] if o.kv_cache_dtype else [],
                         "rule": "q = sat(rint(x * (1 / scale))); x' = q * scale"}
        if o.kv_cache_dtype else {"type": "NONE"},
    }
    states = [paged]
    fixed = {
        "batch_layout": {"kind": "request_aligned", "order": c.CU_SEQLENS},
        "update": {"kind": "replace", "aliasing": "allowed"},
        "reset": "zero row when past_sequence_lengths == 0",
    }
    if abi.linear_layers:
        states.append({"discipline": c.GROUP_FIXED_CONV, "layer_ids": list(abi.linear_layers),
                       "bindings": [_binding(abi, "conv_state", c.PAST_CONV, c.PRESENT_CONV)],
                       "layout": "channels_first [B, conv_dim, K-1]", **fixed})
        states.append({"discipline": c.GROUP_FIXED_RECURRENT,
                       "layer_ids": list(abi.linear_layers),
                       "bindings": [_binding(abi, "recurrent_state", c.PAST_RECURRENT,
                                             c.PRESENT_RECURRENT)],
                       "layout": "v_major [B, Hv, Dv, Dk]", **fixed})
    return {
        "schema": SCHEMA,
        "abi": c.ABI_NAME,
        "model_type": "qwen3_5_text",
        "graph": {"file": c.MODEL_FILE, "inputs": [_spec(t) for t in abi.inputs()],
                  "outputs": [_spec(t) for t in abi.outputs()]},
        "host_inputs": [c.ATTENTION_METADATA],
        "logits": {"rows": "last_token_per_sequence" if o.prune_logits else "every_token",
                   "dtype": "float"},
        "states": states,
        "execution_provider": o.ep,
        "dtype": o.onnx_dtype,
        "runtime": {"onnxruntime": c.ONNXRUNTIME_PIN, "onnxruntime_gpu": c.ONNXRUNTIME_GPU_PIN,
                    "onnxruntime_genai": c.ONNXRUNTIME_GENAI_PIN,
                    "onnxruntime_ep_webgpu": c.WEBGPU_PLUGIN_PIN},
    }
