"""Quantised KV pages: element types, ONNX Runtime's quantise / dequantise rule, scale files.

The rule is ``com.microsoft.PagedAttention``'s (ORT's CUDA ``paged_attention_impl.cu``, the same
numerics as ``group_query_attention_qdq.cuh``), symmetric with no zero point:

* write: ``y = float32(x) * (1 / scale)`` (a reciprocal multiply; ``scale == 0`` stores 0), then
  int8: ``clamp(rint(y), -128, 127)`` (round half to even); float8e4m3fn: ``clamp(y, -448, 448)``
  converted with round to nearest even (saturating: never NaN). A NaN ``y`` stores 0 (int8: PTX
  ``cvt`` maps NaN to 0) and +448 (fp8: ``fminf``/``fmaxf`` drop the NaN operand).
* read: ``x' = float32(q) * scale``.

``scale`` is float32 ``(1)`` (PER_TENSOR) or ``(kv_num_heads, 1, head_size)`` (PER_CHANNEL),
element ``[h, 0, c]`` scaling channel ``c`` of kv head ``h``. Kernels never dequantise pages into
a copy: K's scale folds into the query (``q . (s * k) = (q * s) . k`` per channel) and V's into
the output (``sum p v s = s sum p v``), so the inner loops only convert the stored element.

Scale files (``pagedhybrid calibrate-kv``) are safetensors with ``layers.{i}.k_scale`` /
``layers.{i}.v_scale`` per full-attention layer ``i`` in that layout and the header metadata
``kv_cache_dtype`` (``int8`` | ``fp8_e4m3``), ``quant`` (``per-channel`` | ``per-tensor``) and
how they were calibrated. ``default_scales_path`` is where the engine and the exporter look when
no file is given: ``kv_scales/{dtype}-{quant}.safetensors`` in the checkpoint folder. They live in
a subfolder because checkpoint loaders (vLLM, SGLang) read every ``*.safetensors`` at the top of
the folder as weights and would reject ``layers.{i}.k_scale`` as an unknown parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

OP = "pagedhybrid.kvquant"
# engine / CLI name -> torch dtype; ONNX spells them int8 / float8e4m3fn
KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
QUANTS = {"per-channel": "PER_CHANNEL", "per-tensor": "PER_TENSOR"}  # CLI name -> ORT attribute


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def kv_dtype(name: str) -> torch.dtype:
    """The cache element type of an engine / CLI name (``int8``, ``fp8_e4m3``; ``fp8`` too)."""
    key = "fp8_e4m3" if name == "fp8" else name
    if key not in KV_DTYPES:
        raise ContractViolation(OP, "kv_cache_dtype", f"must be one of {['auto', *KV_DTYPES]}",
                                name)
    return KV_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in KV_DTYPES.items() if v == dtype)


def channel_scale(scale: torch.Tensor, hkv: int, d: int) -> torch.Tensor:
    """float32 ``[Hkv, D]`` view of an ORT-layout scale (a PER_TENSOR scale broadcast)."""
    return scale.to(torch.float32).reshape(-1, d).expand(hkv, d) if scale.numel() > 1 \
        else scale.to(torch.float32).reshape(1, 1).expand(hkv, d)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., Hkv, D]`` into ``dtype`` by the rule above (``scale`` in ORT layout)."""
    hkv, d = x.shape[-2], x.shape[-1]
    s = channel_scale(scale, hkv, d)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    y = x.to(torch.float32) * inv
    if dtype == torch.int8:
        return torch.nan_to_num(y, nan=0.0).round().clamp(-128, 127).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return torch.nan_to_num(y, nan=448.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    raise UnsupportedConfiguration(f"{OP}: no quantised KV element type {dtype}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """``q [..., Hkv, D]`` back to ``dtype``: ``float32(q) * scale`` in float32 (float64 for a
    float64 ``dtype``, the verification extension, where the product is exact)."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    s = channel_scale(scale, q.shape[-2], q.shape[-1]).to(cdt)
    return (q.to(cdt) * s).to(dtype)


def query_scales(k_scale: torch.Tensor, v_scale: torch.Tensor, hq: int, hkv: int, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[Hq, D]`` per query head: K's scale (multiplies q) and V's (multiplies the
    output); query head ``h`` reads kv head ``h // (Hq / Hkv)``."""
    g = hq // hkv
    return (channel_scale(k_scale, hkv, d).repeat_interleave(g, dim=0),
            channel_scale(v_scale, hkv, d).repeat_interleave(g, dim=0))


def scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache`` ``[P, bs, Hkv, D]`` flat slots ``slots`` [n] = ``rows`` [n, Hkv, D] in place
    (``rows`` already in the cache type; float8 caches are written through a uint8 view, torch
    has no float8 ``index_copy_``)."""
    hkv, d = cache.shape[-2], cache.shape[-1]
    if cache.dtype == torch.float8_e4m3fn:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.view(-1, hkv, d).index_copy_(0, slots, rows)


class KVScales(NamedTuple):
    """One full-attention layer's scales, float32 in ORT layout."""

    k: torch.Tensor
    v: torch.Tensor


def per_tensor(scales: KVScales) -> bool:
    return scales.k.numel() == 1


SCALES_DIR = "kv_scales"  # the checkpoint's subfolder of scale files, out of weight loaders' glob


def default_scales_path(model_dir: str | Path, dtype: torch.dtype, quant: str) -> Path:
    return Path(model_dir) / SCALES_DIR / f"{dtype_name(dtype)}-{quant}.safetensors"


def save_scales(path: str | Path, scales: Mapping[int, KVScales], dtype: torch.dtype,
                quant: str, info: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    tensors = {}
    for i, s in sorted(scales.items()):
        tensors[f"layers.{i}.k_scale"] = s.k.to(torch.float32).contiguous()
        tensors[f"layers.{i}.v_scale"] = s.v.to(torch.float32).contiguous()
    meta = {"kv_cache_dtype": dtype_name(dtype), "quant": quant, **(info or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_scales(path: str | Path, layers: tuple[int, ...], hkv: int, d: int,
                dtype: torch.dtype, quant: str | None = None) -> tuple[dict[int, KVScales], str]:
    """Scales of ``layers`` from a scale file, checked against the cache type and shape.

    Returns the scales and the file's quant (``per-channel`` | ``per-tensor``); ``quant`` given
    must match it. Raises ``ContractViolation`` naming the file and what is wrong.
    """
    from safetensors import safe_open

    path = Path(path)
    where = f"kv_scales ({path})"
    if not path.is_file():
        raise ContractViolation(OP, where, "must name a scale file (pagedhybrid calibrate-kv)",
                                "missing")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        got_dtype, got_quant = meta.get("kv_cache_dtype"), meta.get("quant")
        if got_dtype != dtype_name(dtype):
            raise ContractViolation(OP, where, f"was calibrated for {got_dtype!r}, the cache is "
                                    f"{dtype_name(dtype)!r}", got_dtype)
        if got_quant not in QUANTS or (quant is not None and got_quant != quant):
            raise ContractViolation(OP, where, f"holds {got_quant!r} scales, wanted "
                                    f"{quant or list(QUANTS)}", got_quant)
        shape = (1,) if got_quant == "per-tensor" else (hkv, 1, d)
        out = {}
        for i in layers:
            pair = []
            for kv in ("k", "v"):
                name = f"layers.{i}.{kv}_scale"
                if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    raise ContractViolation(OP, where, f"has no {name!r} (layer {i})", "missing")
                t = f.get_tensor(name)
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    raise ContractViolation(OP, where, f"{name!r} must be float32 {list(shape)}",
                                            f"{t.dtype} {list(t.shape)}")
                if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                    raise ContractViolation(OP, where, f"{name!r} must be finite and > 0",
                                            float(t.min()))
                pair.append(t)
            out[i] = KVScales(*pair)
    return out, got_quant
