"""Weights of the exported graph: read lazily from the checkpoint, or declared but absent.

Both sources hand out ``onnx_ir`` tensors keyed by HF state-dict names (the names of
``pagedhybrid.models.qwen35``), already transformed into the layout the graph consumes:

* projections ``[out, in]`` are transposed to ``[in, out]`` (``MatMul`` right operand); the
  projections that read the same input are concatenated along ``out`` into one matrix (q|k|v
  of a full-attention layer, qkv|z|b|a of a linear layer, gate|up of an MLP);
* OffsetRMSNorm gains become ``1 + w`` (computed in float32, then cast);
* ``A_log`` and ``dt_bias`` stay float32 (GatedDeltaNet's gate math is float32); everything
  else takes the export dtype (float16 / bfloat16);
* a mixture of experts' ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) becomes
  ``com.microsoft.MoE``'s interleaved ``fc1`` (rows ``g0, u0, g1, u1, ...``: the ``interleave``
  transform, ``export/moe.py``); ``experts.down_proj [E, H, I]`` is ``fc2`` as it is. A
  checkpoint with one tensor per expert (``experts.{e}.gate_proj.weight`` ..., as transformers
  publishes them) is stacked into those layouts tensor by tensor at write time;
* with ``--weights`` a projection (or several, fused: rows concatenated) is instead
  ``com.microsoft.MatMulNBits``' ``B`` / ``scales`` / ``zero_points`` (``quantized``):
  ``weightquant.quantize`` of the checkpoint tensors as stored, in ``export/nbits.py``'s layout.

``CheckpointWeights`` validates the checkpoint with the model's own loader
(``load_state_dict``: every expected tensor present with the right shape, nothing unknown), keeps
the zero-copy memory-mapped views, and converts each tensor only when ``onnx_ir`` writes it (a
``LazyTensor``), so peak memory stays near one tensor. ``AbsentWeights`` (``--no-weights``)
declares each initializer as external data at the offsets a full export would use, without
reading or writing a byte: a structural export of a 27B-class config takes seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import onnx_ir as ir
import torch

from pagedhybrid import dtypes
from pagedhybrid.export import constants as c
from pagedhybrid.export.nbits import NBitsLayout, layout, pack_zero_points, quantize_projection
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.model import build
from pagedhybrid.models.qwen35.weights import (
    experts_layout,
    fused_experts,
    iter_checkpoint,
    load_state_dict,
    per_expert_shapes,
)
from pagedhybrid.weightquant import QuantizedWeight, WeightFormat

FLOAT32_PARAMS = (".A_log", ".dt_bias")
TRANSFORMS = ("cast", "transpose", "offset", "interleave")


def expected_shapes(config: Qwen35Config, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, from the torch model itself (built on the meta device; with
    its MTP head's ``mtp.*`` when ``mtp``)."""
    return build(config, torch.float32, "meta", mtp=mtp).expected_shapes()


def param_dtype(name: str, io_dtype: str) -> str:
    return "float" if name.endswith(FLOAT32_PARAMS) else io_dtype


Names = str | tuple[str, ...]


def _names(names: Names) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else names


def out_shape(shapes: list[tuple[int, ...]], transform: str) -> tuple[int, ...]:
    """Shape of one tensor after ``transform``, or of several transposed and concatenated."""
    if transform == "transpose":
        return (shapes[0][1], sum(s[0] for s in shapes))  # [in, out_1 + out_2 + ...]
    if len(shapes) != 1:
        raise ValueError("only transposed projections can be fused")
    return shapes[0]


class NBitsTensors(NamedTuple):
    """One MatMulNBits projection's initializers (``zero_points`` None: symmetric)."""

    layout: NBitsLayout
    codes: ir.TensorProtocol
    scales: ir.TensorProtocol
    zero_points: ir.TensorProtocol | None


def nbits_layout(shapes: dict[str, tuple[int, ...]], names: Names, fmt: WeightFormat
                 ) -> NBitsLayout:
    """The MatMulNBits layout of ``names``' rows concatenated (their K must agree)."""
    parts = [shapes[n] for n in _names(names)]
    if len({p[1] for p in parts}) != 1:
        raise ValueError(f"fused projections {_names(names)} read different K")
    return layout(fmt, sum(p[0] for p in parts), parts[0][1], "|".join(_names(names)))


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` gate rows then up rows -> rows ``g0, u0, g1, u1, ...`` (MoE's
    ``swiglu_fusion=1``)."""
    e, two_i, h = t.shape
    return t.reshape(e, 2, two_i // 2, h).transpose(1, 2).reshape(e, two_i, h)


def _apply(ts: list[torch.Tensor], transform: str, dtype: torch.dtype) -> torch.Tensor:
    if transform == "transpose":
        return torch.cat([t.t().to(dtype) for t in ts], dim=1).contiguous()  # [in, sum(out)]
    if transform == "offset":
        return (1.0 + ts[0].float()).to(dtype).contiguous()  # OffsetRMSNorm gain (1 + w)
    if transform == "interleave":
        return interleave_gate_up(ts[0].to(dtype)).contiguous()  # [E, 2I, H] interleaved
    return ts[0].to(dtype).contiguous()


class CheckpointWeights:
    """Tensors of an HF checkpoint folder, converted lazily at save time."""

    def __init__(self, model_dir: str | Path, config: Qwen35Config, io_dtype: str,
                 mtp: bool = False) -> None:
        self.io_dtype = io_dtype
        self.shapes = expected_shapes(config, mtp)
        per_expert = config.is_moe and experts_layout(model_dir, mtp) == "per_expert"
        stored = {name: file.dtype(key) for key, name, file in iter_checkpoint(model_dir, mtp)}
        # Ask the loader for each tensor in its stored dtype: zero-copy views, validated.
        self._raw = load_state_dict(
            model_dir, per_expert_shapes(self.shapes) if per_expert else self.shapes,
            lambda n: stored.get(n, torch.float32), optional=frozenset({"lm_head.weight"}),
            mtp=mtp)

    def read(self, name: str) -> torch.Tensor:
        """The checkpoint tensor ``name`` as stored; a fused experts tensor of a per-expert
        checkpoint is stacked from its experts' tensors here (``weights.fused_experts``)."""
        if name in self._raw:
            return self._raw[name]
        base, kind = name.rsplit(".", 1)  # "<layer>.mlp.experts", gate_up_proj | down_proj
        return fused_experts(kind, lambda e, proj: self._raw[f"{base}.{e}.{proj}.weight"],
                             self.shapes[name][0])

    def tensor(self, names: Names, transform: str = "cast") -> ir.TensorProtocol:
        """One checkpoint tensor, or several projections transposed and concatenated."""
        dtype = param_dtype(_names(names)[0], self.io_dtype)
        shape = out_shape([self.shapes[n] for n in _names(names)], transform)

        def make() -> ir.TensorProtocol:
            raws = [self.read(n) for n in _names(names)]
            return ir.tensor_adapters.TorchTensor(_apply(raws, transform, dtypes.to_torch(dtype)))

        return ir.LazyTensor(make, dtypes.ir_dtype(dtype), ir.Shape(shape))

    def quantized(self, names: Names, fmt: WeightFormat) -> NBitsTensors:
        """The projection(s) ``names`` in ``fmt``, quantised once when the first of the three
        initializers is written (they are written one after another)."""
        lay = nbits_layout(self.shapes, names, fmt)
        held: list[QuantizedWeight] = []

        def part(k: int) -> ir.LazyTensor:
            def make() -> ir.TensorProtocol:
                if not held:
                    held.append(quantize_projection([self.read(n) for n in _names(names)], fmt,
                                                    "|".join(_names(names))))
                q = held[0]
                t = (q.codes, q.scales, None if q.zeros is None else
                     pack_zero_points(q.zeros, fmt.bits))[k]
                if k == 2 or (q.zeros is None and k == 1):
                    held.clear()  # the last of the three: one projection's codes in memory
                return ir.tensor_adapters.TorchTensor(t)

            shape = (lay.codes, lay.scales, lay.zero_points)[k]
            dtype = ir.DataType.FLOAT16 if k == 1 else ir.DataType.UINT8
            return ir.LazyTensor(make, dtype, ir.Shape(shape))

        return NBitsTensors(lay, part(0), part(1), None if fmt.symmetric else part(2))


class AbsentWeights:
    """Initializers declared as external data that is not written (``--no-weights``)."""

    def __init__(self, config: Qwen35Config, io_dtype: str, file: str = c.WEIGHTS_FILE,
                 mtp: bool = False) -> None:
        self.io_dtype = io_dtype
        self.shapes = expected_shapes(config, mtp)
        self.file = file
        self._offset = 0

    def tensor(self, names: Names, transform: str = "cast") -> ir.TensorProtocol:
        dtype = param_dtype(_names(names)[0], self.io_dtype)
        shape = out_shape([self.shapes[n] for n in _names(names)], transform)
        return self._declare(shape, dtype, "|".join(_names(names)))

    def quantized(self, names: Names, fmt: WeightFormat) -> NBitsTensors:
        lay = nbits_layout(self.shapes, names, fmt)
        label = "|".join(_names(names))
        return NBitsTensors(lay, self._declare(lay.codes, "uint8", label),
                            self._declare(lay.scales, "float16", label),
                            None if lay.zero_points is None else
                            self._declare(lay.zero_points, "uint8", label))

    def _declare(self, shape: tuple[int, ...], dtype: str, name: str) -> ir.TensorProtocol:
        numel = 1
        for s in shape:
            numel *= s
        length = numel * dtypes.itemsize(dtype)
        offset = self._offset
        self._offset += (length + 4095) // 4096 * 4096  # onnx_ir's page alignment
        return ir.ExternalTensor(self.file, offset, length, dtypes.ir_dtype(dtype),
                                 shape=ir.Shape(shape), name=name)


WeightSource = CheckpointWeights | AbsentWeights
