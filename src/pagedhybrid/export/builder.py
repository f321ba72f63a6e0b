"""A thin ``onnx_ir`` graph builder: named nodes and values, initializers, small op helpers.

Nodes are recorded on an ``onnx_ir.tape.Tape``; each node gets a path-like name
(``/model/layers.3/attn/PagedAttention``) and each output value ``<node name>/output_<k>`` unless a
graph-level name (``present.3.key``) is given. Weights come from a ``WeightSource``; small
constants are int64/float initializers. Helpers shared by both layer kinds live here:
``matmul`` (right operand ``[in, out]``), ``fused_matmul`` (several projections of one input as
one ``MatMul`` + ``Split``; with ``--weights`` each product is one ``com.microsoft.MatMulNBits``
instead, ``export/nbits.py``), ``l2_normalize`` (HF's q/k norm with its eps),
``offset_rms_norm`` (``SimplifiedLayerNormalization`` with the ``1 + w`` gain, statistics in
float32) and ``skip_rms_norm`` (the residual add fused in, ``SkipSimplifiedLayerNormalization``),
``silu``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir import tape

from pagedhybrid import dtypes
from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import TensorSpec
from pagedhybrid.export.nbits import (
    CODES,
    SCALES,
    ZERO_POINTS,
    NBitsLayout,
    NBitsWeights,
    node_attributes,
)
from pagedhybrid.export.weights import WeightSource


class GraphBuilder:
    def __init__(self, weights: WeightSource, io_dtype: str,
                 nbits: NBitsWeights | None = None) -> None:
        self.weights = weights
        self.io_dtype = io_dtype
        self.nbits = nbits  # the projections' 8 / 4-bit format (None: float MatMuls)
        self.tape = tape.Tape()
        self._consts: dict[tuple[str, tuple[Any, ...]], ir.Value] = {}
        self._weights: dict[tuple[str, str], ir.Value] = {}
        self._nbits: dict[str, tuple[NBitsLayout, list[ir.Value]]] = {}
        self.inputs: dict[str, ir.Value] = {}

    # -- values ------------------------------------------------------------------------------
    @staticmethod
    def value(spec: TensorSpec) -> ir.Value:
        return ir.Value(name=spec.name, type=ir.TensorType(dtypes.ir_dtype(spec.dtype)),
                        shape=ir.Shape(list(spec.shape)))

    def add_input(self, spec: TensorSpec) -> ir.Value:
        v = self.value(spec)
        self.inputs[spec.name] = v
        return v

    def weight(self, name: str, transform: str = "cast",
               fused: tuple[str, ...] | None = None) -> ir.Value:
        """Initializer ``name`` (+ ``.transform``); ``fused`` concatenates several transposed
        projections into it."""
        key = (name, transform)
        if key not in self._weights:
            init_name = name if transform == "cast" else f"{name}.{transform}"
            tensor = self.weights.tensor(fused or name, transform)
            tensor.name = init_name
            self._weights[key] = self.tape.initializer(tensor, name=init_name)
        return self._weights[key]

    def const_i64(self, values: Sequence[int]) -> ir.Value:
        key = ("int64", tuple(values))
        if key not in self._consts:
            name = "const_i64_" + "_".join(str(v).replace("-", "m") for v in values)
            self._consts[key] = self.tape.initializer(
                ir.tensor(np.array(values, dtype=np.int64), name=name), name=name)
        return self._consts[key]

    def zeros(self, name: str, size: int) -> ir.Value:
        """A zero vector ``[size]`` in the activation dtype (e.g. an all-zero bias)."""
        import torch

        zeros = torch.zeros(size, dtype=dtypes.to_torch(self.io_dtype))
        tensor = ir.tensor_adapters.TorchTensor(zeros, name=name)
        return self.tape.initializer(tensor, name=name)

    def const_f32(self, name: str, values: np.ndarray) -> ir.Value:
        key = ("float:" + name, ())
        if key not in self._consts:
            self._consts[key] = self.tape.initializer(
                ir.tensor(np.ascontiguousarray(values, dtype=np.float32), name=name), name=name)
        return self._consts[key]

    # -- nodes -------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[ir.Value | None], name: str,
           attrs: Mapping[str, Any] | None = None, *, domain: str = "",
           outputs: Sequence[str | None] | int = 1) -> list[ir.Value]:
        """Emit one node; ``outputs`` is a count or a list of graph names (None = auto)."""
        names = [None] * outputs if isinstance(outputs, int) else list(outputs)
        values = self.tape.op_multi_out(op_type, list(inputs), dict(attrs or {}),
                                        num_outputs=len(names), domain=domain, name=name)
        for k, (v, n) in enumerate(zip(values, names, strict=True)):
            v.name = n if n is not None else f"{name}/output_{k}"  # "" = optional, omitted
        return list(values)

    def op1(self, op_type: str, inputs: Sequence[ir.Value | None], name: str,
            attrs: Mapping[str, Any] | None = None, *, domain: str = "",
            output: str | None = None) -> ir.Value:
        return self.op(op_type, inputs, name, attrs, domain=domain, outputs=[output])[0]

    # -- helpers -----------------------------------------------------------------------------
    def matmul(self, x: ir.Value, weight_name: str, name: str, *, quantize: bool = True,
               sources: Sequence[str] | None = None) -> ir.Value:
        """``x[..., in] @ W^T`` as the node ``{name}/MatMul`` with the checkpoint's ``[out, in]``
        weight stored transposed, or -- with ``--weights`` and ``quantize`` -- as
        ``{name}/MatMulNBits`` (``sources``: the checkpoint tensors whose rows ``W`` is, default
        ``weight_name`` itself; several are concatenated)."""
        parts = tuple(sources or (weight_name,))
        if self.nbits is not None and quantize:
            return self._matmul_nbits(x, weight_name, parts, f"{name}/{c.MATMUL_NBITS}")
        w = self.weight(weight_name, "transpose", fused=parts if len(parts) > 1 else None)
        return self.op1("MatMul", [x, w], f"{name}/MatMul")

    def fused_matmul(self, x: ir.Value, fused_name: str, weight_names: Sequence[str],
                     widths: Sequence[int], name: str, *, quantize: bool = True
                     ) -> list[ir.Value]:
        """One product (``matmul``) with the projections concatenated along ``out``, split back
        into ``x @ W_1^T``, ``x @ W_2^T``, ... of the given widths (same math per column)."""
        y = self.matmul(x, fused_name, name, quantize=quantize,
                        sources=weight_names)  # [N, sum(widths)]
        return self.op("Split", [y, self.const_i64(list(widths))], f"{name}/Split",
                       {"axis": -1}, outputs=len(widths))

    def _matmul_nbits(self, x: ir.Value, base: str, parts: tuple[str, ...], name: str
                      ) -> ir.Value:
        """One ``com.microsoft.MatMulNBits`` over ``parts``' rows (``export/nbits.py``): the
        initializers ``{base}.codes`` / ``.scales`` (/ ``.zero_points``), the node metadata
        naming the parts."""
        assert self.nbits is not None
        if base not in self._nbits:
            q = self.weights.quantized(parts, self.nbits.fmt)
            values = []
            for suffix, tensor in ((CODES, q.codes), (SCALES, q.scales),
                                   (ZERO_POINTS, q.zero_points)):
                if tensor is not None:
                    tensor.name = base + suffix
                    values.append(self.tape.initializer(tensor, name=base + suffix))
            self._nbits[base] = (q.layout, values)
        lay, values = self._nbits[base]
        y = self.op1(c.MATMUL_NBITS, [x, *values], name,
                     node_attributes(self.nbits.fmt, lay, self.nbits.accuracy_level),
                     domain=c.MS_DOMAIN)  # [N, out]
        node = y.producer()
        assert node is not None
        node.metadata_props[c.META_PROJECTIONS] = ",".join(parts)
        return y

    def offset_rms_norm(self, x: ir.Value, weight_name: str, eps: float, name: str,
                        output: str | None = None) -> ir.Value:
        """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last axis, stats in float32."""
        gain = self.weight(weight_name, "offset")
        return self.op1("SimplifiedLayerNormalization", [x, gain], name,
                        {"axis": -1, "epsilon": float(eps), "stash_type": 1}, output=output)

    def skip_rms_norm(self, x: ir.Value, delta: ir.Value, weight_name: str, eps: float,
                      name: str) -> tuple[ir.Value, ir.Value]:
        """``h = x + delta`` and OffsetRMSNorm of ``h`` in one com.microsoft
        ``SkipSimplifiedLayerNormalization`` (the sum is normalised in float32 before rounding);
        returns ``(norm(h), h)``."""
        gain = self.weight(weight_name, "offset")
        y, _, _, h = self.op("SkipSimplifiedLayerNormalization", [x, delta, gain], name,
                             {"epsilon": float(eps)}, domain=c.MS_DOMAIN,
                             outputs=[None, "", "", None])
        return y, h

    def l2_normalize(self, x: ir.Value, eps: float, name: str) -> ir.Value:
        """float32 ``x * 1/sqrt(sum(x^2) + eps)`` over the last axis (HF ``l2norm``):
        ``Cast -> ReduceSumSquare -> Add(eps) -> Sqrt -> Reciprocal -> Mul``."""
        xf = x if self.io_dtype == "float" else self.cast(x, "float", f"{name}/Cast")
        ss = self.op1("ReduceSumSquare", [xf, self.const_i64([-1])], f"{name}/ReduceSumSquare",
                      {"keepdims": 1})  # [..., 1]
        eps_v = self.const_f32(f"const_f32_l2norm_eps_{eps:g}",
                               np.array([eps], dtype=np.float32))
        inv = self.op1("Reciprocal", [self.op1("Sqrt", [self.op1("Add", [ss, eps_v],
                                                                  f"{name}/Add")],
                                                 f"{name}/Sqrt")], f"{name}/Reciprocal")
        return self.op1("Mul", [xf, inv], f"{name}/Mul")

    def silu(self, x: ir.Value, name: str) -> ir.Value:
        return self.op1("Mul", [x, self.op1("Sigmoid", [x], f"{name}/Sigmoid")], f"{name}/Mul")

    def cast(self, x: ir.Value, to: str, name: str) -> ir.Value:
        return self.op1("Cast", [x], name, {"to": dtypes.ir_dtype(to)})

    def reshape(self, x: ir.Value, shape: Sequence[int], name: str) -> ir.Value:
        return self.op1("Reshape", [x, self.const_i64(shape)], name)

    def model(self, outputs: Sequence[ir.Value], metadata: Mapping[str, str]) -> ir.Model:
        graph = ir.Graph(
            list(self.inputs.values()), list(outputs), nodes=self.tape.nodes,
            initializers=self.tape.initializers,
            opset_imports={"": c.OPSET, c.MS_DOMAIN: c.MS_OPSET},
            name="pagedhybrid_qwen35_packed_paged")
        return ir.Model(graph, ir_version=c.IR_VERSION, producer_name=c.PRODUCER,
                        producer_version=_version(), metadata_props=dict(metadata))


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedhybrid")
    except Exception:  # not installed (PYTHONPATH=src)
        return "0+src"
