"""Run one ``com.microsoft`` node of an OpSpec in a real onnxruntime session.

* ``ep="cpu"``: the CPU execution provider (GatedDeltaNet, VarlenCausalConvWithState).
* ``ep="webgpu"``: the ``onnxruntime-ep-webgpu`` plugin EP (PagedAttention, fp16 only), which on a
  machine without a GPU runs on Mesa's lavapipe software Vulkan adapter. The plugin hides software
  adapters unless ``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1``; we set it before registering.

In-place ports (e.g. PagedAttention's caches) are bound as one device OrtValue for both the input
and its aliasing output through IOBinding, exactly as a serving runtime does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.ops.spec import OpSpec


@functools.cache
def webgpu_ep_device() -> Any:
    """Register the WebGPU plugin EP once and return its OrtEpDevice.

    Raises UnsupportedConfiguration (with what to install) when no adapter is visible.
    """
    import onnxruntime as ort
    import onnxruntime_ep_webgpu as wep

    os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    ort.register_execution_provider_library("webgpu", wep.get_library_path())
    for dev in ort.get_ep_devices():
        if dev.ep_name == wep.get_ep_name():
            return dev
    raise UnsupportedConfiguration(
        "no WebGPU adapter for onnxruntime-ep-webgpu: install a Vulkan driver (Mesa >= 23 "
        "lavapipe: `make system-deps`) and set ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1")


def single_node_model(spec: OpSpec, inputs: Sequence[torch.Tensor | None],
                      attrs: Mapping[str, Any], n_outputs: int) -> onnx.ModelProto:
    """A model with one ``spec`` node; absent optional inputs are empty names, trailing ones
    are dropped."""
    last = max(i for i, t in enumerate(inputs) if t is not None)
    names, graph_inputs = [], []
    for port, t in zip(spec.inputs[: last + 1], inputs[: last + 1], strict=True):
        if t is None:
            names.append("")
            continue
        elem = dtypes.onnx_code(t.dtype, op=spec.qualname, where=port.name)
        names.append(port.name)
        graph_inputs.append(helper.make_tensor_value_info(port.name, elem, list(t.shape)))
    out_names = [p.name for p in spec.outputs[:n_outputs]]
    outputs = [onnx.ValueInfoProto(name=n) for n in out_names]  # types left to inference
    node = helper.make_node(spec.name, names, out_names, domain=spec.domain, **dict(attrs))
    graph = helper.make_graph([node], spec.name, graph_inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(spec.domain, 1)])
    model.ir_version = 10
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def run_single_node(spec: OpSpec, inputs: Sequence[torch.Tensor | None],
                    attrs: Mapping[str, Any], *, n_outputs: int, ep: str = "cpu",
                    inplace: Mapping[int, int] | None = None) -> list[torch.Tensor]:
    """Run the node and return its outputs as torch tensors (in output order).

    ``inplace`` maps input index -> output index for ports that alias (bound as one OrtValue).
    """
    import onnxruntime as ort

    model = single_node_model(spec, inputs, attrs, n_outputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if ep == "webgpu":
        dev = webgpu_ep_device()
        so.add_provider_for_devices([dev], {})
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    elif ep != "cpu":
        raise UnsupportedConfiguration(f"run_single_node: unknown ep {ep!r}; use cpu or webgpu")
    sess = ort.InferenceSession(model.SerializeToString(), sess_options=so,
                                providers=None if ep == "webgpu" else ["CPUExecutionProvider"])
    inplace = dict(inplace or {})
    io = sess.io_binding()
    aliased: dict[int, Any] = {}
    for i, (port, t) in enumerate(zip(spec.inputs, inputs, strict=False)):
        if t is None:
            continue
        if i in inplace and ep == "webgpu":
            mi = dev.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
            v = ort.OrtValue.ortvalue_from_shape_and_type(list(t.shape), _np(t).dtype,
                                                          memory_info=mi)
            ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(_np(t))], [v])
        else:
            v = ort.OrtValue.ortvalue_from_numpy(_np(t))
        if i in inplace:
            aliased[inplace[i]] = (v, t)
        io.bind_ortvalue_input(port.name, v)
    for j, port in enumerate(spec.outputs[:n_outputs]):
        if j in aliased:
            io.bind_ortvalue_output(port.name, aliased[j][0])
        else:
            io.bind_output(port.name, "cpu")
    sess.run_with_iobinding(io)
    results = []
    for j, v in enumerate(io.get_outputs()):  # binding order == output order here
        if j in aliased and ep == "webgpu":
            like = aliased[j][1]
            host = ort.OrtValue.ortvalue_from_numpy(np.empty(tuple(like.shape), _np(like).dtype))
            ort.copy_tensors([v], [host])
            v = host
        results.append(torch.from_numpy(np.array(v.numpy())))
    return results
