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
against the native kernel on a [4096, 1024] weight at 4, 32 and 256 rows, medians of 5), because
torch's GEMM is MKL's and MKL's speed depends on the CPU's vendor, not its flags: on an Intel Xeon
it was as fast or faster at every size (``benchmarks/latency.py``: the native kernel made fp32
decode 1.2x and a 16-request batch 1.5x slower), on an AMD EPYC (AVX2) it ran 2 to 16 rows 15x
slower than one row and 3-5x slower than the native kernel (which stays within 2x of one row's
time up to 16 rows), and 256 rows 1.5x slower; on an AMX Xeon MKL ran 4 to 32 rows 1.2-1.9x
slower than the native kernel and 256 rows 1.05x faster (a batch of 8 fp32 sequences decoded at
134 tok/s with MKL from 8 rows on). So fp32 runs torch's GEMM (None) where it is the faster at 4
rows, else the native kernel (``decode_linear``) below ``DECODE_ROWS`` rows -- below
``WIDEN_ROWS`` where it is also the faster at 32 (``fp32_decode_rows``) -- or at every size
(``linear``) when it is also the faster at 256 rows. On a form with BF16 dot instructions
it depends on how good oneDNN's bf16 GEMM is on the machine, which the CPU flags do not tell.
Below ``PAIR_ROWS`` rows the native kernel runs, in bf16 pairs (below); from ``WIDEN_ROWS`` rows on
whichever of torch's
bf16 GEMM and ``linear``'s widened fp32 GEMM the first call timed faster (``bf16_gemm_timing``: a
[4096, 1024] bf16 weight at 256 rows, medians of 5, ~0.1 s once per process and form):
``decode_linear`` (torch's) or ``mixed_linear`` (the widened fp32 GEMM: an AVX512-BF16 Xeon without
AMX timed torch's bf16 GEMM 1.1-1.5x slower, and prefilled 512 tokens of the 0.8B geometry in 4.7 s
instead of 6.2).

bf16 pairs (``PAIR_ROWS``): on a form with BF16 dot instructions the native kernel multiplies
bf16 activations by bf16 weights in pairs (``vdpbf16ps``, ``csrc/gemm.h``), no widening, with
the weights as loaded -- so below ``PAIR_ROWS`` rows (every decode batch) bf16 projections run
it, from there on as above. It replaced holding the large bf16 weights in oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``, vLLM's CPU backend's choice), measured side by side on the
141M benchmark model (avx512_bf16 EPYC, 2 threads; ``benchmarks/weights.py``): one sequence
decoded 56-60 tok/s packed, 67-84 with the pairs on plain weights; 8 and 32 sequences within the
noise of each other (b32 700-708 packed, 697-700 plain); and a tied LM head no longer needs a
packed copy of the embedding table (the 0.8B geometry's 508 MB).
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
DECODE_ROWS = 8  # rows below which decode_linear runs the native kernel (fp32: fp32_decode_rows)
PAIR_ROWS = WIDEN_ROWS  # bf16 on a form with BF16 dot instructions: the same, for bf16 weights


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
    """The native kernel for fewer than ``DECODE_ROWS`` rows (``PAIR_ROWS`` for bf16 weights
    where the form multiplies bf16 pairs, ``fp32_decode_rows()`` for fp32 ones), torch's GEMM
    above."""
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
        if weight_dtype == torch.float32:
            limit = fp32_decode_rows()
        else:
            limit = PAIR_ROWS if weight_dtype == torch.bfloat16 and bf16_dot() else DECODE_ROWS
        return "native" if rows < limit else "torch"
    return None


def _run(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
         weight: torch.Tensor) -> torch.Tensor:
    form = product_form(matmul, weight.dtype, math.prod(x.shape[:-1]))
    if form == "native":
        return _product("linear", x, weight)
    return _widened_gemm(x, weight) if form == "widened" else F.linear(x, weight)


@functools.cache
def _bf16_gemm_timing(form: str) -> float:
    cpu = torch.device("cpu")  # also when called while a model is built on the meta device
    weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0),
                         device=cpu).bfloat16()
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1), device=cpu).bfloat16()
    # each product through the one dispatch (_run): decode_linear at 256 rows is torch's GEMM,
    # linear the widened GEMM
    times: dict[str, list[float]] = {"torch": [], "widened": []}
    for _ in range(6):  # the first round warms both up and is dropped
        for name, fn in (("torch", decode_linear), ("widened", linear)):
            t0 = time.perf_counter()
            fn(x, weight)
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
    """Time of torch's bf16 GEMM over the widened fp32 GEMM's at 256 rows on this machine
    (> 1: torch's is slower), measured once per form (rank 0's under torch.distributed): the
    figure the start-up line reports is the one the projections were chosen by."""
    return _agreed("bf16", lambda form: (_bf16_gemm_timing(form),))[0]


@functools.cache
def _fp32_gemm_timing(form: str) -> tuple[float, float, float]:
    with torch.device("cpu"):  # also when called while a model is built on the meta device
        weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
        out = []
        for rows in (4, 32, 256):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(1))
            times: dict[str, list[float]] = {"torch": [], "native": []}
            for _ in range(6):  # the first round warms both up and is dropped
                for name, fn in (("torch", F.linear), ("native", linear)):
                    t0 = time.perf_counter()
                    fn(x, weight)
                    times[name].append(time.perf_counter() - t0)
            out.append(statistics.median(times["torch"][1:])
                       / statistics.median(times["native"][1:]))
    return out[0], out[1], out[2]


def fp32_gemm_timing() -> tuple[float, float, float]:
    """Time of torch's fp32 GEMM over the native kernel's at 4, 32 and 256 rows on this machine
    (> 1: torch's is slower), measured once per form (rank 0's under torch.distributed)."""
    small, mid, large = _agreed("fp32", _fp32_gemm_timing)
    return small, mid, large


def fp32_decode_rows() -> int:
    """Rows below which ``decode_linear`` multiplies fp32 weights natively: ``WIDEN_ROWS`` where
    the native kernel was also the faster at 32 rows, else ``DECODE_ROWS``."""
    return WIDEN_ROWS if fp32_gemm_timing()[1] > 1.0 else DECODE_ROWS


def preferred_linear(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor],
                                                     torch.Tensor] | None:
    """What a ``dtype`` model's projections multiply with on the chosen form (module
    docstring); None (torch's) when the native kernels are not loaded."""
    if not status().available:
        return None
    if dtype == torch.float32:
        small, _, large = fp32_gemm_timing()
        return None if small <= 1.0 else linear if large > 1.0 else decode_linear
    if dtype not in WIDENED_DTYPES:
        return None
    if not bf16_dot():
        return linear
    return decode_linear if bf16_gemm_timing() < 1.0 else mixed_linear
