"""Mixture-of-experts feed-forward of the packed graph (``qwen3_5_moe_text``): the routed experts
as one ``com.microsoft.MoE`` node per layer, the shared expert and its gate as plain nodes.

The math is the model's ``SparseMoE`` (transformers 5.24 ``Qwen3_5MoeSparseMoeBlock``): router
logits ``x @ gate^T`` in the activation dtype, softmax over all ``E`` experts in float32, top-k,
the k probabilities renormalised to sum 1, each chosen expert ``down_e(silu(g) * u)`` with
``[g; u] = gate_up_e(x)``, weighted and summed; plus
``sigmoid(x @ shared_expert_gate^T) * down_s(silu(gate_s x) * up_s x)``.

Per layer ``i`` (``N`` packed tokens, ``E`` experts of ``I`` channels, shared expert of ``Is``):

1. ``gate | shared_expert_gate | shared_expert.gate_proj | shared_expert.up_proj`` as one MatMul
   (they all read the normalised ``x``), split into router logits ``[N, E]``, the shared gate's
   logit ``[N, 1]`` and ``g_s, u_s [N, Is]`` -- with ``--weights`` the router gates
   ``gate | shared_expert_gate`` stay one float MatMul (the engine does not quantise them) and
   the shared expert's ``gate_proj | up_proj`` are one MatMulNBits;
2. ``MoE(x, router logits, fc1 = experts.gate_up_proj interleaved [E, 2I, H], -, fc2 =
   experts.down_proj [E, H, I]; k = num_experts_per_tok, activation_type = swiglu,
   swiglu_fusion = 1, normalize_routing_weights = 1, activation_alpha = 1, activation_beta = 0)``
   -> ``[N, H]`` in the activation dtype (no biases, no fc3, no ``swiglu_limit``);
3. ``down_s(silu(g_s) * u_s) * Sigmoid(shared logit)`` added to the routed output.

``com.microsoft.MoE`` in onnxruntime 1.32.0 -- what was established, and how:

* Schema (``onnxruntime.capi._pybind_state.get_all_operator_schema()`` of the installed
  1.32.0, the registry ``docs/ContribOperators.md`` is generated from): inputs ``input``
  ``[N, H]`` (packed, token-local: no sequence lengths) or ``[B, S, H]``, ``router_probs
  [N, E]``, ``fc1_experts_weights [E, fusion * I, H]``, ``fc1_experts_bias``,
  ``fc2_experts_weights [E, H, I]``, ``fc2_experts_bias``, ``fc3_experts_weights [E, I, H]``,
  ``fc3_experts_bias`` -- every weight ``[E, out, in]``, the checkpoint's own ``[out, in]`` per
  expert (no transpose); attributes ``k``, ``activation_type`` (default relu),
  ``normalize_routing_weights`` (0), ``swiglu_fusion`` (0: fc1 + fc3, 1: fused interleaved,
  2: fused ``[g | u]``), ``activation_alpha`` (1.0), ``activation_beta`` (0.0),
  ``swiglu_limit`` (absent = no clamp), ``use_sparse_mixer`` (0, k = 2 only); SwiGLU is
  ``G * sigmoid(alpha * G) * (L + beta)``.
* Kernels: the CPU EP runs float32 and float16 (a float16 graph node ran on
  ``CPUExecutionProvider``, per the session profile; bfloat16 has no CPU kernel: "Could not find
  an implementation for MoE(1)"); the WebGPU plugin (onnxruntime-ep-webgpu 0.4.0) registers no
  ``MoE`` (only ``QMoE``: ``get_registered_ep_kernel_defs``), so on ``--ep webgpu`` the float16
  node falls back to the CPU EP as GatedDeltaNet does; CUDA registers float, float16 and
  bfloat16 (microsoft/onnxruntime ``docs/OperatorKernels.md``, CUDAExecutionProvider table; not
  run here: no CUDA device).
* CPU semantics (``onnxruntime/contrib_ops/cpu/moe/moe_cpu.cc``, and measured): ``router_probs``
  are logits: the kernel converts them to float32, takes the softmax over all ``E``,
  ``partial_sort``s the (probability, expert) pairs descending (exact ties: the higher expert
  index first), and with ``normalize_routing_weights=1`` divides the k probabilities by their
  sum, kept in float32. SwiGLU on the CPU needs ``swiglu_fusion=1`` (the constructor throws
  "CPU MoE only supports interleaved SwiGLU format. Please set swiglu_fusion=1." for 0 and 2) and
  reads the gate at even and the up projection at odd rows; ``fc3`` is refused ("FC3 is not
  implemented for CPU MoE."), so ``silu`` + fc3 is no way out. ``activation_alpha`` /
  ``activation_beta`` are written explicitly: a WebGPU MoE of the upstream tree defaults
  ``activation_beta`` to 1.0.
* Probe (E 8, k 2, H 16, I 12, 10 tokens, float32, CPU EP, against a torch loop of the model's
  math): the chosen attributes 4.2e-7 max error; gate and up swapped 1.5; no renormalisation
  0.65; probabilities instead of logits 0.42; 3D input 4.2e-7; k = 1 and k = E 8e-7 / 2e-7;
  pre-activations up to 33 without a hidden clamp 3e-5 (relative 1e-6); ``swiglu_limit=1``
  clamps (1.3); float16 1.3e-3; ``use_sparse_mixer`` is ignored by the CPU kernel. With a zero
  router every expert ties: the kernel takes experts 7, 6 while ``torch.topk`` took 6, 5 -- a
  tie order neither side specifies, so exact ties (a degenerate router) may route differently.
  ``tests/export/test_export_moe.py`` keeps the decisive cases of this probe.
* Float16 graphs: the router logits carry ~2e-3 of float16 noise (tiny model, measured), so a
  token whose k-th and (k+1)-th logits are closer than that may take the other expert than
  float32 torch -- as right a choice within the activation precision, but a visible difference
  (0.3-0.6 on that token's tiny-model logits). The numerics tests separate such tokens.

``single_moe_model`` is the same node alone (inputs ``input``, ``router_probs``; tests and
benchmarks). ``verify_moe`` is ``pagedhybrid verify``'s part: the MoE metadata, one node per
decoder layer, its attributes, its operands' shapes (fc1 ``[E, 2I, H]`` interleaved, fc2
``[E, H, I]``, router logits of ``E`` columns) and the gated shared expert beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from pagedhybrid import dtypes
from pagedhybrid.export import constants as c
from pagedhybrid.export import ir_read as rd
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.export.weights import interleave_gate_up
from pagedhybrid.models.qwen35.config import Qwen35Config

if TYPE_CHECKING:
    from pathlib import Path

    import onnx

# The attributes that reproduce the model's math (module docstring); k is the config's.
MOE_ATTRS: dict[str, Any] = {"activation_type": "swiglu", "swiglu_fusion": 1,
                             "normalize_routing_weights": 1, "activation_alpha": 1.0,
                             "activation_beta": 0.0}
ABSENT_ATTRS = ("swiglu_limit", "use_sparse_mixer", "swiglu_limit_after_activation")
FC1, FC2 = 2, 4  # MoE operand indices of the expert weights
EMPTY_OPERANDS = (3, 5, 6, 7)  # biases and fc3


def emit_moe(b: GraphBuilder, config: Qwen35Config, i: int, x: ir.Value,
             layer: str | None = None) -> ir.Value:
    """Layer ``i``'s mixture of experts on the normalised ``x [N, H]`` -> ``[N, H]`` (checkpoint
    layer ``layer``, default ``model.layers.{i}``; the MTP head's ``mtp.layers.0``)."""
    layer = layer or f"model.layers.{i}"
    p = f"/model/layers.{i}/mlp" if layer == f"model.layers.{i}" else f"/{layer}/mlp"
    w = f"{layer}.mlp"
    e, si = config.num_experts, config.shared_expert_intermediate_size
    routers = [f"{w}.gate.weight", f"{w}.shared_expert_gate.weight"]
    shared_in = [f"{w}.shared_expert.gate_proj.weight", f"{w}.shared_expert.up_proj.weight"]
    if b.nbits is None:  # one float MatMul for all four
        logits, shared_logit, gate, up = b.fused_matmul(
            x, f"{w}.gate_and_shared_expert.weight", routers + shared_in, [e, 1, si, si],
            f"{p}/gate_and_shared_expert")  # [N, E], [N, 1], [N, Is] x2
    else:  # the router gates stay float (as the engine's), the shared expert's are quantized
        logits, shared_logit = b.fused_matmul(
            x, f"{layer}{c.ROUTER_WEIGHT}", routers, [e, 1], f"{p}/gate_and_shared_expert_gate",
            quantize=False)  # [N, E], [N, 1]
        gate, up = b.fused_matmul(x, f"{w}.shared_expert.gate_up_proj.weight", shared_in,
                                  [si, si], f"{p}/shared_expert/gate_up_proj")  # [N, Is] x2
    routed = b.op1(c.MOE, [x, logits, b.weight(f"{w}.experts.gate_up_proj", "interleave"), None,
                           b.weight(f"{w}.experts.down_proj")],
                   f"{p}/experts/{c.MOE}", {"k": config.num_experts_per_tok, **MOE_ATTRS},
                   domain=c.MS_DOMAIN)  # [N, H]
    prod = b.op1("Mul", [b.silu(gate, f"{p}/shared_expert/act"), up],
                 f"{p}/shared_expert/Mul")  # [N, Is]
    shared = b.matmul(prod, f"{w}.shared_expert.down_proj.weight",
                      f"{p}/shared_expert/down_proj")  # [N, H]
    gated = b.op1("Mul", [b.op1("Sigmoid", [shared_logit], f"{p}/shared_expert_gate/Sigmoid"),
                          shared], f"{p}/shared_expert_gate/Mul")  # [N, H]
    return b.op1("Add", [routed, gated], f"{p}/Add")  # [N, H]


def single_moe_model(gate_up: np.ndarray, down: np.ndarray, k: int,
                     external: Path | None = None) -> onnx.ModelProto:
    """One ``MoE`` node as the export writes it, over the experts ``gate_up [E, 2I, H]`` (gate
    rows, then up rows: the checkpoint's layout; interleaved here) and ``down [E, H, I]`` in
    their dtype (float32 or float16): inputs ``input [N, H]`` and ``router_probs [N, E]``
    (logits), output ``output [N, H]``. With ``external`` (a folder) the weights are written
    there as ``fc1.bin`` / ``fc2.bin`` and referenced as external data (a model over 2 GB):
    save the model into the same folder."""
    import onnx
    import torch
    from onnx import helper, numpy_helper

    e, _, h = gate_up.shape
    fc1 = interleave_gate_up(torch.from_numpy(gate_up)).contiguous().numpy()  # [E, 2I, H]
    elem = helper.np_dtype_to_tensor_dtype(gate_up.dtype)

    def tensor(name: str, arr: np.ndarray) -> onnx.TensorProto:
        if external is None:
            return numpy_helper.from_array(arr, name)
        arr.tofile(external / f"{name}.bin")
        t = onnx.TensorProto(name=name, data_type=elem, dims=arr.shape,
                             data_location=onnx.TensorProto.EXTERNAL)
        t.external_data.add(key="location", value=f"{name}.bin")
        return t

    node = helper.make_node(c.MOE, ["input", "router_probs", "fc1", "", "fc2"], ["output"],
                            domain=c.MS_DOMAIN, k=k, **MOE_ATTRS)
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("input", elem, ["num_tokens", h]),
         helper.make_tensor_value_info("router_probs", elem, ["num_tokens", e])],
        [helper.make_tensor_value_info("output", elem, ["num_tokens", h])],
        [tensor("fc1", fc1), tensor("fc2", np.ascontiguousarray(down))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.OPSET),
                                                    helper.make_opsetid(c.MS_DOMAIN, c.MS_OPSET)])
    model.ir_version = c.IR_VERSION
    return model


# -- verify ---------------------------------------------------------------------------------------
Check = Any  # verify._Checker: (cond, check, detail) -> bool


def _int(meta: dict[str, str], key: str) -> int | None:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        return None


def _dims(v: ir.Value | None) -> list[Any]:
    return [] if v is None or v.shape is None else [
        d if isinstance(d, int) else d.value for d in v.shape]


def _layer_of(n: ir.Node) -> int | None:
    """The decoder layer whose ``model.layers.{i}.mlp.experts.*`` fc1 the node reads."""
    v = rd.operand(n, FC1)
    parts = (v.name or "").split(".") if v is not None else []
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and \
        parts[2].isdigit() else None


def _router_columns(v: ir.Value | None, hidden: int) -> int | None:
    """Columns of the router logits: output 0 of a Split of ``x @ W`` with ``W [H, ...]``."""
    split = v.producer() if v is not None else None
    if split is None or split.op_type != "Split" or split.outputs[0] is not v:
        return None
    sizes, mm = split.inputs[1], split.inputs[0].producer() if split.inputs[0] else None
    w = mm.inputs[1] if mm is not None and mm.op_type == "MatMul" else None
    if sizes is None or sizes.const_value is None or w is None or _dims(w)[:1] != [hidden]:
        return None
    return int(sizes.const_value.numpy().reshape(-1)[0])


def _gated_shared(routed: ir.Value) -> bool:
    """``routed`` is added to ``Mul(Sigmoid(.), .)`` (the gated shared expert)."""
    for use in routed.uses():
        add = use.node
        if add.op_type != "Add":
            continue
        other = next((v for v in add.inputs if v is not routed), None)
        mul = other.producer() if other is not None else None
        if mul is not None and mul.op_type == "Mul" and any(
                v is not None and v.producer() is not None and v.producer().op_type == "Sigmoid"
                for v in mul.inputs):
            return True
    return False


def verify_moe(model: ir.Model, genai: dict[str, Any], chk: Check) -> None:
    """The MoE part of ``pagedhybrid verify`` (module docstring); a dense package must have no
    MoE node and no MoE metadata."""
    meta = dict(model.metadata_props)
    nodes = [n for n in model.graph if n.op_type == c.MOE]
    keys = (c.META_MOE_EXPERTS, c.META_MOE_TOP_K, c.META_MOE_INTERMEDIATE, c.META_MOE_SHARED)
    if not nodes and not any(k in meta for k in keys):
        return
    sizes = [_int(meta, k) for k in keys]
    if not chk(all(s is not None and s > 0 for s in sizes), "moe metadata",
               f"{[meta.get(k) for k in keys]} (num_experts, num_experts_per_tok, "
               "moe_intermediate_size, shared_expert_intermediate_size)"):
        return
    e, k, inter, _ = (int(s) for s in sizes if s is not None)
    dec = genai.get("model", {}).get("decoder", {})
    n_layers, hidden = dec.get("num_hidden_layers"), dec.get("hidden_size")
    io_dtype = meta.get(c.META_DTYPE)
    layers = sorted(x for x in (_layer_of(n) for n in nodes) if x is not None)
    chk(layers == list(range(n_layers if isinstance(n_layers, int) else -1)), "MoE count",
        f"{len(nodes)} {c.MOE} nodes on layers {layers} for {n_layers} decoder layers")
    for n in nodes:
        i = _layer_of(n)
        attrs = {name: a.value for name, a in n.attributes.items()}
        want = {"k": k, **MOE_ATTRS}
        ok = n.domain == c.MS_DOMAIN and all(attrs.get(a) == v for a, v in want.items()) \
            and not any(a in attrs for a in ABSENT_ATTRS)
        chk(ok, "MoE attributes", f"layer {i}: {n.domain} {attrs}" + (
            "" if ok else f" (expected {c.MS_DOMAIN} {want}, none of {list(ABSENT_ATTRS)})"))
        fc1, fc2 = rd.operand(n, FC1), rd.operand(n, FC2)
        empty = [rd.operand(n, j) is not None for j in EMPTY_OPERANDS]
        ok = (fc1 is not None and fc2 is not None and fc1.const_value is not None
              and fc2.const_value is not None and not any(empty)
              and (fc1.name or "").endswith(".gate_up_proj.interleave")
              and _dims(fc1) == [e, 2 * inter, hidden] and _dims(fc2) == [e, hidden, inter]
              and all(v.dtype is not None and dtypes.describe(v.dtype) == io_dtype
                      for v in (fc1, fc2)))
        chk(ok, "MoE expert weights", f"layer {i}: fc1 {fc1.name if fc1 else None} "
            f"{_dims(fc1)}, fc2 {_dims(fc2)}, biases/fc3 present {empty} (expected interleaved "
            f"{io_dtype} [{e}, {2 * inter}, {hidden}], [{e}, {hidden}, {inter}], none)")
        cols = _router_columns(rd.operand(n, 1), hidden) if isinstance(hidden, int) else None
        chk(cols == e, "MoE router", f"layer {i}: router logits of {cols} experts (expected "
            f"{e}, from x @ W with W [{hidden}, ...])")
        chk(_gated_shared(n.outputs[0]), "MoE shared expert",
            f"layer {i}: routed output + Sigmoid(gate) * shared expert")
