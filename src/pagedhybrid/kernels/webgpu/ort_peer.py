"""ONNX Runtime's own WebGPU PagedAttention as a persistent benchmark peer.

One ``com.microsoft.PagedAttention`` node runs in one ``InferenceSession`` on the
``onnxruntime-ep-webgpu`` plugin EP (CPU fallback disabled, so the node can only run on WebGPU).
The KV caches live on the device as one OrtValue each, bound through IOBinding both as the
``key_cache``/``value_cache`` input and as the aliasing ``key_cache_out``/``value_cache_out``
output, exactly as a serving runtime binds them. Per call, like our own kernel's per-call path,
the small inputs (query/key/value, sequence metadata) are uploaded from the host and ``output``
is read back to the host.

The node is built here from ONNX Runtime's input names (not from our OpSpec) so the peer stays an
independent oracle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration

# ONNX Runtime's PagedAttention inputs in schema order (onnxruntime 1.32.0, bert_defs.cc).
ORT_INPUTS = (
    "query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
    "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink",
    "q_norm_weight", "k_norm_weight", "k_scale", "v_scale", "attention_metadata",
)
ORT_OUTPUTS = ("output", "key_cache_out", "value_cache_out")


def _model_bytes(inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> bytes:
    import onnx
    from onnx import helper

    present = [n for n in ORT_INPUTS if n in inputs]
    last = max(ORT_INPUTS.index(n) for n in present)
    names = [n if n in inputs else "" for n in ORT_INPUTS[: last + 1]]
    graph_inputs = [helper.make_tensor_value_info(n, dtypes.onnx_code(inputs[n].dtype, where=n),
                                                  list(inputs[n].shape)) for n in present]
    outputs = [onnx.ValueInfoProto(name=n) for n in ORT_OUTPUTS]
    node = helper.make_node("PagedAttention", names, list(ORT_OUTPUTS), domain="com.microsoft",
                            **dict(attrs))
    graph = helper.make_graph([node], "PagedAttention", graph_inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


class OrtWebGpuPagedAttention:
    """A prepared ORT WebGPU PagedAttention call with device-resident, aliased caches."""

    def __init__(self, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
        import onnxruntime as ort

        from pagedhybrid.kernels.onnxruntime.session import webgpu_ep_device

        os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
        self._ort = ort
        dev = webgpu_ep_device()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_provider_for_devices([dev], {})
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        try:
            self.session = ort.InferenceSession(_model_bytes(inputs, attrs), sess_options=so)
        except Exception as exc:  # pragma: no cover - depends on the installed driver
            raise UnsupportedConfiguration(
                f"onnxruntime-ep-webgpu could not create a PagedAttention session: {exc}") from exc
        mi = dev.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        self.caches: dict[str, Any] = {}
        io = self.session.io_binding()
        for name in ORT_INPUTS:
            if name not in inputs:
                continue
            arr = np.ascontiguousarray(inputs[name])
            if name in ("key_cache", "value_cache"):
                v = ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype,
                                                              memory_info=mi)
                ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(arr)], [v])
                self.caches[name] = (v, arr.shape, arr.dtype)
                io.bind_ortvalue_input(name, v)
            else:
                io.bind_cpu_input(name, arr)
        io.bind_output("output", "cpu")
        io.bind_ortvalue_output("key_cache_out", self.caches["key_cache"][0])
        io.bind_ortvalue_output("value_cache_out", self.caches["value_cache"][0])
        self.io = io

    def __call__(self) -> np.ndarray:
        """One call: upload the small inputs, run, read ``output`` back."""
        self.session.run_with_iobinding(self.io)
        return self.io.copy_outputs_to_cpu()[0]

    def read_cache(self, name: str) -> np.ndarray:
        v, shape, dtype = self.caches[name]
        host = self._ort.OrtValue.ortvalue_from_numpy(np.empty(shape, dtype))
        self._ort.copy_tensors([v], [host])
        return np.array(host.numpy())


def time_calls(fn: Any, warmup: int, iters: int,
               max_seconds: float = 20.0) -> tuple[float, list[float]]:
    """(first-call seconds, steady-state per-call seconds) of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return first, times
