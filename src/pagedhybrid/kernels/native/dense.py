"""Projections (``x @ weight^T``) on the native kernels, for CPUs without BF16 dot instructions.

torch's bf16 GEMM is oneDNN's: on a CPU with AVX512-BF16 (or AMX) it multiplies bf16 pairs in
hardware; on one without (a Xeon with AVX-512 + VNNI only, or an AVX2 CPU) it emulates them and
runs 2-4x slower than torch's own fp32 GEMM (``benchmarks/ops.py --only forms``). There
``linear`` runs the native ``linear`` kernel instead: the bf16 (or fp16) weights and activations
are widened to fp32 in registers -- exactly: bf16 is the high half of an fp32 -- and multiplied
with fp32 FMAs, accumulating in fp32 (as oneDNN does) and rounding to ``x``'s dtype once at the
end. A decode step streams the weights once, at half the bytes of fp32; 16 to 63 rows pack each
weight panel into fp32 once per 96 rows for an outer-product micro-kernel; a prefill chunk of 64
rows or more widens the weights to fp32 8 MiB at a time (in cache) and runs torch's fp32 GEMM on
them, within ~10% of the fp32 model's own GEMM (``benchmarks/ops.py --only forms``).
``invariant_linear`` is the batch-invariant form (one reduction order per output element
whatever the number of rows), for ``kernels/native/invariant.py``.

``preferred_linear(dtype)`` says what the ``native`` bundle multiplies with in ``dtype`` on the
chosen CPU form (``kernels.native.status()``): ``linear`` for bf16 / fp16 models on a form without
BF16 dot instructions. For fp32 it is timed at start (``fp32_gemm_timing``: torch's fp32 GEMM
against the native kernel on a [4096, 1024] weight at 4 and at 256 rows, medians of 5), because
torch's GEMM is MKL's and MKL's speed depends on the CPU's vendor, not its flags: on an Intel Xeon
it was as fast or faster at every size (``benchmarks/latency.py``: the native kernel made fp32
decode 1.2x and a 16-request batch 1.5x slower), on an AMD EPYC (AVX2) it ran 2 to 16 rows 15x
slower than one row and 3-5x slower than the native kernel (which stays within 2x of one row's
time up to 16 rows), and 256 rows 1.5x slower. So fp32 runs torch's GEMM (None) where it is the
faster at 4 rows, else the native kernel below ``DECODE_ROWS`` (``decode_linear``) or at every
size (``linear``) when it is also the faster at 256 rows. On a form with BF16 dot instructions
it depends on how good oneDNN's bf16 GEMM is on the machine, which the CPU flags do not tell.
Below ``DECODE_ROWS`` rows the native kernel runs (oneDNN's per-call overhead dominates such small
products), up to ``WIDEN_ROWS`` torch's bf16 GEMM (the 0.8B geometry decoded 16 sequences at 38
tok/s with it, 21 with the native packed form); from ``WIDEN_ROWS`` rows on whichever of torch's
bf16 GEMM and ``linear``'s widened fp32 GEMM the first call timed faster (``bf16_gemm_timing``: a
[4096, 1024] bf16 weight at 256 rows, medians of 5, ~0.1 s once per process and form):
``decode_linear`` (torch's) or ``mixed_linear`` (the widened fp32 GEMM: an AVX512-BF16 Xeon without
AMX timed torch's bf16 GEMM 1.1-1.5x slower, and prefilled 512 tokens of the 0.8B geometry in 4.7 s
instead of 6.2).

Packed weights (``preferred_pack``, ``pack``): on a form with BF16 dot instructions a bf16
projection weight of ``PACK_MIN_BYTES`` or more is reordered once, at load, into oneDNN's blocked
layout (``mkldnn._reorder_linear_weight``, as vLLM's CPU backend does) and takes the plain
weight's place -- one copy, the mapped file's pages released. A packed weight multiplies with
oneDNN's GEMM on that layout below ``WIDEN_ROWS`` rows (every decode product; in C++ too, in the
fused decode layers) and from there on as the plain weight would (the widened GEMM reads its
plain form back). Streaming the 0.8B geometry's projections from memory at 16 rows it ran 1.38x
faster than torch's GEMM on the plain weights and 2.2x faster than the native kernel, and within
the box's noise of the native kernel at one row; the sums are oneDNN's (on this Xeon bit-equal to
torch's bf16 GEMM on the plain weight at every row count). Smaller weights stay plain: they sit in
cache, where the oneDNN call's ~19 us costs more than it saves. A tied LM head is the embedding
table, whose rows the embedding reads: the model gives the head a packed copy (the one weight held
twice, as vLLM's CPU backend holds it); at 16 rows the 248k x 1024 table multiplied 1.5-2.6x
faster packed than plain (runs differ that much on this shared VM). Activations in another dtype
than a packed weight multiply with its plain form.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedhybrid.kernels.native import library, status

WIDENED_DTYPES = (torch.bfloat16, torch.float16)
WIDEN_ROWS = 64  # rows from which bf16 / fp16 weights are widened in chunks for torch's fp32 GEMM
WIDEN_CHUNK_BYTES = 8 << 20  # fp32 weight rows widened at a time
MIN_CHUNK_ROWS = 16
DECODE_ROWS = 8  # rows below which decode_linear runs the native kernel
PACK_MIN_BYTES = 1 << 20  # bf16 weights from this size are packed (preferred_pack)
PACK_ROWS = 32  # the batch oneDNN picks the packed layout for (vLLM's CPU backend's choice)


def _product(op: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel reads x in its dtype (or in fp32 beside bf16 / fp16 weights) and writes out in
    it: no conversion pass, so no extra parallel region, around the call. At decode each call
    is a few microseconds of work, so no-op conversions and views are skipped, not dispatched."""
    k = x.shape[-1]
    xd = x.dtype if x.dtype in (weight.dtype, torch.float32) else torch.float32
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    if x2.dtype != xd:
        x2 = x2.to(xd)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=xd)  # [M, N]
    if x2.shape[0]:
        getattr(library(), op)(x2, weight if weight.is_contiguous() else weight.contiguous(), out)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], weight.shape[0])
    return out if xd == x.dtype else out.to(x.dtype)


def _widened_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Prefill-sized: weight rows widened to fp32 a cache-sized chunk at a time, torch's fp32
    GEMM on each chunk, the result rounded once into ``x``'s dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()  # [M, K]
    n = weight.shape[0]
    rows = max(MIN_CHUNK_ROWS, WIDEN_CHUNK_BYTES // (4 * k))
    out = torch.empty(x2.shape[0], n, dtype=x.dtype)  # [M, N]
    for n0 in range(0, n, rows):
        out[:, n0:n0 + rows] = F.linear(x2, weight[n0:n0 + rows].float())
    return out.view(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` with fp32 arithmetic and accumulation, rounded once to
    ``x``'s dtype (``weight`` float32, bfloat16 or float16). Fewer than ``WIDEN_ROWS`` rows: the
    native ``linear`` kernel (the weights streamed once and widened in registers; packed fp32
    panels and an outer-product kernel from 16 rows on); from ``WIDEN_ROWS`` rows on (prefill)
    with bf16 / fp16 weights: chunks of the weights widened to fp32 and torch's fp32 GEMM."""
    return _run(linear, x, weight)


def mixed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``decode_linear`` below ``WIDEN_ROWS`` rows (the native kernel, then torch's GEMM),
    ``linear`` (the widened fp32 GEMM) from there on."""
    return _run(mixed_linear, x, weight)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As ``linear``, in one fixed reduction order per output element whatever the number of
    rows (``linear_invariant``: the batch-invariant mode's projection)."""
    return _product("linear_invariant", x, weight)


def bf16_dot() -> bool:
    """Whether the chosen form multiplies bf16 pairs in hardware (AVX512-BF16)."""
    st = status()
    return st.available and st.isa == "avx512_bf16"


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The native kernel for fewer than ``DECODE_ROWS`` rows (decode), torch's GEMM above."""
    return _run(decode_linear, x, weight)


def product_form(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 weight_dtype: torch.dtype, rows: int) -> str | None:
    """How ``matmul`` (a bundle's ``linear_for`` choice; None = ``F.linear``) multiplies ``rows``
    rows by ``weight_dtype`` weights: ``"native"`` (the native ``linear`` kernel), ``"torch"``
    (``F.linear``) or ``"widened"`` (the widened fp32 GEMM); None for a product not chosen here
    (the batch-invariant kernel). The one rule: ``linear``, ``mixed_linear`` and
    ``decode_linear`` dispatch by it, and the fused decode layers read it to mirror them."""
    if matmul is None:
        return "torch"
    if matmul is mixed_linear:
        matmul = decode_linear if rows < WIDEN_ROWS else linear
    if matmul is linear:
        return "widened" if weight_dtype in WIDENED_DTYPES and rows >= WIDEN_ROWS else "native"
    if matmul is decode_linear:
        return "native" if rows < DECODE_ROWS else "torch"
    return None


def _run(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
         weight: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn and x.dtype != weight.dtype:
        weight = weight.to_dense()  # activations in another dtype: the plain weight's product
    form = product_form(matmul, weight.dtype, math.prod(x.shape[:-1]))
    if weight.is_mkldnn:  # packed: oneDNN's GEMM on it unless widened (prefill)
        return _widened_gemm(x, weight.to_dense()) if form == "widened" \
            else packed_linear(x, weight)
    if form == "native":
        return _product("linear", x, weight)
    return _widened_gemm(x, weight) if form == "widened" else F.linear(x, weight)


def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight^T`` by oneDNN's GEMM on a weight ``pack`` reordered (``x`` in the
    weight's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(x2 if x2.is_contiguous() else x2.contiguous(),
                                             weight, None, "none", [], "")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bf16) reordered into oneDNN's blocked layout for ``PACK_ROWS``-row
    products: an opaque tensor of the same shape, dtype and bytes (``to_dense()`` gives it
    back exactly)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _pack_large(weight: torch.Tensor) -> torch.Tensor:
    return pack(weight) if weight.numel() * weight.element_size() >= PACK_MIN_BYTES else weight


def preferred_pack(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a ``dtype`` model's projection weights are held on the chosen form (module
    docstring): bf16 weights of ``PACK_MIN_BYTES`` or more packed where the form multiplies
    bf16 pairs in hardware; None (plain) otherwise."""
    if dtype != torch.bfloat16 or not bf16_dot() \
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return _pack_large


@functools.cache
def _bf16_gemm_timing(form: str) -> float:
    cpu = torch.device("cpu")  # also when called while a model is built on the meta device
    weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0),
                         device=cpu).bfloat16()
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1), device=cpu).bfloat16()
    # the weight held as the projections hold it; each product through the one dispatch
    # (_run): decode_linear at 256 rows is torch's GEMM (oneDNN's on a packed weight), linear
    # the widened GEMM (from the plain form read back)
    held = pack(weight) if preferred_pack(torch.bfloat16) is not None else weight
    times: dict[str, list[float]] = {"torch": [], "widened": []}
    for _ in range(6):  # the first round warms both up and is dropped
        for name, fn in (("torch", decode_linear), ("widened", linear)):
            t0 = time.perf_counter()
            fn(x, held)
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["torch"][1:]) / statistics.median(times["widened"][1:])


_AGREED: dict[tuple[str, str], tuple[float, ...]] = {}
_SHARED: dict[tuple[str, str], object] = {}  # the group each figure was last agreed in


def _agreed(name: str, measure: Callable[[str], tuple[float, ...]]) -> tuple[float, ...]:
    """``measure(form)`` once per process and form -- rank 0's figures on every rank of an
    initialised torch.distributed group, agreed once per group (ranks measure apart and could
    choose differently, and tensor-parallel ranks must multiply alike; a figure measured
    before the group existed is rank 0's to send all the same)."""
    import torch.distributed as dist

    key = (name, status().isa)
    if key not in _AGREED:
        _AGREED[key] = measure(key[1])
    if dist.is_available() and dist.is_initialized() and \
            _SHARED.get(key) is not dist.group.WORLD:
        t = torch.tensor(_AGREED[key], dtype=torch.float64, device="cpu")
        dist.broadcast(t, src=0)
        _AGREED[key], _SHARED[key] = tuple(t.tolist()), dist.group.WORLD
    return _AGREED[key]


def bf16_gemm_timing() -> float:
    """Time of torch's bf16 GEMM (oneDNN's on the packed weight where weights are packed) over
    the widened fp32 GEMM's (from the plain weight read back) at 256 rows on this machine
    (> 1: torch's is slower), measured once per form (rank 0's under torch.distributed): the
    figure the start-up line reports is the one the projections were chosen by."""
    return _agreed("bf16", lambda form: (_bf16_gemm_timing(form),))[0]


@functools.cache
def _fp32_gemm_timing(form: str) -> tuple[float, float]:
    with torch.device("cpu"):  # also when called while a model is built on the meta device
        weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
        out = []
        for rows in (4, 256):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(1))
            times: dict[str, list[float]] = {"torch": [], "native": []}
            for _ in range(6):  # the first round warms both up and is dropped
                for name, fn in (("torch", F.linear), ("native", linear)):
                    t0 = time.perf_counter()
                    fn(x, weight)
                    times[name].append(time.perf_counter() - t0)
            out.append(statistics.median(times["torch"][1:])
                       / statistics.median(times["native"][1:]))
    return out[0], out[1]


def fp32_gemm_timing() -> tuple[float, float]:
    """Time of torch's fp32 GEMM over the native kernel's at 4 and at 256 rows on this machine
    (> 1: torch's is slower), measured once per form (rank 0's under torch.distributed)."""
    small, large = _agreed("fp32", _fp32_gemm_timing)
    return small, large


def preferred_linear(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor],
                                                     torch.Tensor] | None:
    """What a ``dtype`` model's projections multiply with on the chosen form (module
    docstring); None (torch's) when the native kernels are not loaded."""
    if not status().available:
        return None
    if dtype == torch.float32:
        small, large = fp32_gemm_timing()
        return None if small <= 1.0 else linear if large > 1.0 else decode_linear
    if dtype not in WIDENED_DTYPES:
        return None
    if not bf16_dot():
        return linear
    return decode_linear if bf16_gemm_timing() < 1.0 else mixed_linear
