"""Weights of the exported graph: read lazily from the checkpoint, or declared but absent.

Both sources hand out ``onnx_ir`` tensors keyed by HF state-dict names (the names of
``pagedhybrid.models.qwen35``), already transformed into the layout the graph consumes:

* projections ``[out, in]`` are transposed to ``[in, out]`` (``MatMul`` right operand); the
  projections that read the same input are concatenated along ``out`` into one matrix (q|k|v
  of a full-attention layer, qkv|z|b|a of a linear layer, gate|up of an MLP);
* OffsetRMSNorm gains become ``1 + w`` (computed in float32, then cast);
* ``A_log`` and ``dt_bias`` stay float32 (GatedDeltaNet's gate math is float32); everything
  else takes the export dtype (float16 / bfloat16).

``CheckpointWeights`` validates the checkpoint with the model's own loader
(``load_state_dict``: every expected tensor present with the right shape, nothing unknown), keeps
the zero-copy memory-mapped views, and converts each tensor only when ``onnx_ir`` writes it (a
``LazyTensor``), so peak memory stays near one tensor. ``AbsentWeights`` (``--no-weights``)
declares each initializer as external data at the offsets a full export would use, without
reading or writing a byte: a structural export of a 27B-class config takes seconds.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import torch

from pagedhybrid import dtypes
from pagedhybrid.export import constants as c
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.model import build
from pagedhybrid.models.qwen35.weights import iter_checkpoint, load_state_dict

FLOAT32_PARAMS = (".A_log", ".dt_bias")
TRANSFORMS = ("cast", "transpose", "offset")


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


def _apply(ts: list[torch.Tensor], transform: str, dtype: torch.dtype) -> torch.Tensor:
    if transform == "transpose":
        return torch.cat([t.t().to(dtype) for t in ts], dim=1).contiguous()  # [in, sum(out)]
    if transform == "offset":
        return (1.0 + ts[0].float()).to(dtype).contiguous()  # OffsetRMSNorm gain (1 + w)
    return ts[0].to(dtype).contiguous()


class CheckpointWeights:
    """Tensors of an HF checkpoint folder, converted lazily at save time."""

    def __init__(self, model_dir: str | Path, config: Qwen35Config, io_dtype: str,
                 mtp: bool = False) -> None:
        self.io_dtype = io_dtype
        self.shapes = expected_shapes(config, mtp)
        stored = {name: file.dtype(key) for key, name, file in iter_checkpoint(model_dir, mtp)}
        # Ask the loader for each tensor in its stored dtype: zero-copy views, validated.
        self._raw = load_state_dict(
            model_dir, self.shapes, lambda n: stored.get(n, torch.float32),
            optional=frozenset({"lm_head.weight"}), mtp=mtp)

    def tensor(self, names: Names, transform: str = "cast") -> ir.TensorProtocol:
        """One checkpoint tensor, or several projections transposed and concatenated."""
        raws = [self._raw[n] for n in _names(names)]
        dtype = param_dtype(_names(names)[0], self.io_dtype)
        shape = out_shape([tuple(r.shape) for r in raws], transform)

        def make() -> ir.TensorProtocol:
            return ir.tensor_adapters.TorchTensor(_apply(raws, transform, dtypes.to_torch(dtype)))

        return ir.LazyTensor(make, dtypes.ir_dtype(dtype), ir.Shape(shape))


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
        numel = 1
        for s in shape:
            numel *= s
        length = numel * dtypes.itemsize(dtype)
        offset = self._offset
        self._offset += (length + 4095) // 4096 * 4096  # onnx_ir's page alignment
        return ir.ExternalTensor(self.file, offset, length, dtypes.ir_dtype(dtype),
                                 shape=ir.Shape(shape), name="|".join(_names(names)))


WeightSource = CheckpointWeights | AbsentWeights
