"""Projections of int8 / int4 weights on the native kernel (``csrc/quant.cpp``).

``linear(x, q)`` is ``x [..., K] @ dequantize(q)^T`` for a ``weightquant.QuantizedWeight``: the
weight's codes are read in place (4 or 8 bits per parameter and a float16 scale per block: a
decode step streams a quarter / an eighth of the fp32 bytes), the activations are quantised per
row to int8 on the fly (``weightquant.quantize_rows``) and each 32-element sub-block is an exact
integer dot product (``vpmaddubsw`` + ``vpmaddwd``, or ``vpdpbusd`` on a CPU form with
AVX512-VNNI), scaled and accumulated in fp32 (a weight in the engine's groups of 16 rows,
``weightquant.group_rows``: 16 rows' sums a vector at a time). Its arithmetic per
output element does not depend on the number of rows or their order: ``invariant_linear`` is
that kernel at every size, the batch-invariant bundle's product. ``linear`` (the fast form)
takes it below ``DEQUANT_ROWS`` rows; from there on (prefill) the integer form is bound by its
per-sub-block scaling while the fp32 GEMM is bound by arithmetic, so the weight rows are
dequantised a cache-sized chunk at a time (``quant_dequantize``, ``WIDEN_CHUNK_BYTES`` of fp32)
and multiplied by torch's fp32 GEMM (at 512 rows of a [8192, 2048] weight: int8 kernel 144 ms,
int4 191 ms, fp32 GEMM 116 ms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedhybrid.kernels.native import library
from pagedhybrid.kernels.native.dense import MIN_CHUNK_ROWS, WIDEN_CHUNK_BYTES
from pagedhybrid.weightquant import GROUP, QuantizedWeight


def int_dot() -> str:
    """The chosen form's int8 dot-product instructions, the engine's order of the codes and the
    prefetch of the codes this CPU gets (NTA on AMD, T0 elsewhere), as the engine's kernel line
    names them."""
    lib = library()
    dot = ("vpdpbusd, AVX512-VNNI" if lib.int8_dot() == "vpdpbusd"  # type: ignore[attr-defined]
           else "vpmaddubsw + vpmaddwd")
    return (f"{dot}; codes in groups of {GROUP} rows; "
            f"prefetched {lib.code_prefetch()}")  # type: ignore[attr-defined]


DEQUANT_ROWS = 64  # rows from which the fast form dequantises chunks for the fp32 GEMM


def linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """``x [..., K] @ dequantize(q)^T`` -> ``[..., N]`` in ``x``'s dtype (float32, bfloat16 or
    float16): the integer kernel below ``DEQUANT_ROWS`` rows, dequantised chunks and the fp32
    GEMM from there on."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m < DEQUANT_ROWS:
        return invariant_linear(x, q)
    x2 = x.reshape(m, k).float()
    n = q.shape[0]
    rows = max(MIN_CHUNK_ROWS, WIDEN_CHUNK_BYTES // (4 * k))
    out = torch.empty(m, n, dtype=x.dtype)
    chunk = torch.empty(min(rows, n), k)
    lib = library()
    for n0 in range(0, n, rows):
        w = chunk[:min(rows, n - n0)]
        lib.quant_dequantize(q.codes, q.scales, q.zeros, q.fmt.bits, n0, w)  # type: ignore[attr-defined]
        out[:, n0:n0 + w.shape[0]] = F.linear(x2, w)
    return out.view(*x.shape[:-1], n)


def invariant_linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """``linear`` by the integer kernel at every size (one reduction order per output element
    whatever the rows)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = q.shape[0]
    out = torch.empty(x2.shape[0], n, dtype=x.dtype)
    library().quant_linear(x2, q.codes, q.scales, q.zeros, q.fmt.bits, out)  # type: ignore[attr-defined]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
