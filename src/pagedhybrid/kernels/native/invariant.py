"""The batch-invariant step seam: every token's arithmetic is independent of its batch.

A token's logits must come out bitwise the same whatever else is in the step, where it sits in
the packed stream, how its prompt was chunked, whether it was preempted and recomputed, and
which pages it got. Each source of drift is replaced by a kernel with one fixed order per
output element:

* ``linear`` -- every projection and the LM head. fp32: ``linear_invariant`` (fixed per-element
  K order, no K split, register blocks that only share loads). bf16: oneDNN's bf16 GEMM (AMX or
  AVX512-BF16, whichever the CPU has), always called on tiles of exactly ``ROW_TILE`` rows (the
  last one zero-padded). Its kernel, blocking and K split are chosen by shape and thread count,
  so with the shape fixed a row's arithmetic is the same in every tile and at every position in
  it; rows never mix. (A plain ``torch.mm`` is not invariant: its kernel changes with M.) The K
  split does change with the thread count, so bf16 invariance holds for one
  ``torch.get_num_threads()`` -- the rollout and the recompute run in one process, or in
  processes with the same count. On a CPU form without BF16 dot instructions (``avx512``,
  ``avx2``: oneDNN emulates bf16 there, 2-4x slower than fp32) bf16 runs ``linear_invariant``
  too, its weights widened to fp32 in registers (``dense.invariant_linear``): invariant for
  any thread count;
* ``attention`` -- every sequence, decode or prefill of any length, on the native paged kernel:
  fixed KV splits of ``KV_SPLIT`` tokens from position 0 merged in split order, 16-key tiles
  from each split's start, each row's online softmax its own (rows that see no key of a tile
  are exact no-ops), so a row's result depends only on its query and keys ``0..p``;
* ``gated_delta`` / ``causal_conv`` -- the token-recurrent form for prefill too
  (``gated_delta_varlen`` / ``causal_conv_varlen`` run each token through the very function the
  decode kernels use); state checkpoints inside a chunk are taken between segments (the
  recurrence) or copied from the inputs (the conv window), so a prefix-cache hit restores the
  bits the recurrence had there;
* ``silu`` / ``sigmoid`` -- the MLP's and the gated norm's SiLU and the attention output gate
  (``pointwise.cpp``): torch's kernels for these run Sleef vectors over the tensor and libm on
  the scalar tail (of the tensor and of each thread's chunk), which round differently, so the
  last token of a step whose row width is not a multiple of the vector loop (Hv*Dv = 4*4, 2*8,
  4*20, ... in the gated norm) got other bits than the same token elsewhere; here every element
  runs the same lane code, the tail loaded zero-filled into a full vector.

* the RMS, gated RMS and q / k L2 norms -- the native ``norms.cpp`` ops the ``native`` bundle
  uses too: one thread reduces a row in one fixed order, whatever the batch.

What stays on torch is row-wise or element-wise with exactly rounded arithmetic (RoPE,
residuals, the per-row log-softmax of sampling), which does not mix rows; the tests check the
whole model bitwise, head dims and value / key head dims of any size included.
Speed (``benchmarks/engine.py --batch-invariant``, 2 cores): the fp32 linear kernel runs at the
FMA peak. On a Xeon that is torch's fp32 GEMM speed for decode batches, 0.85x for prefill, so
the fp32 mode cost nothing measurable (1.00x); on an AMD EPYC, where torch's fp32 GEMM is slower
(torch.profiler on 24 requests: 14.3 s in ``aten::mm`` vs 9.4 s in this kernel), the mode runs
1.48x the default's speed. In bf16 the fixed tiles cost the padding of the last tile and the
larger GEMM a whole prefill chunk would get (the own fp32-FMA kernel was 4-10x slower than
oneDNN's bf16 GEMMs there): 0.83x of the default's speed.
"""

from __future__ import annotations

import functools

import torch

from pagedhybrid.kernels.cpu import seam as torch_seam
from pagedhybrid.kernels.native import dense, library
from pagedhybrid.kernels.native import seam as native_seam
from pagedhybrid.kernels.step import StepMetadata

DTYPES = (torch.float32, torch.bfloat16)


ROW_TILE = 64  # bf16 GEMM tile: pads decode batches a little, keeps prefill near full speed


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` with the invariant kernel, in ``x``'s dtype."""
    if weight.dtype != torch.bfloat16 or not dense.bf16_dot():
        # fp32 FMAs in one fixed order; bf16 weights widened to fp32 in registers
        return dense.invariant_linear(x.to(weight.dtype), weight).to(x.dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).to(weight.dtype).contiguous()
    m, n = x2.shape[0], weight.shape[0]
    pad = -m % ROW_TILE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    out = torch.empty(m + pad, n, dtype=torch.bfloat16)
    wt = weight.t()
    for lo in range(0, m + pad, ROW_TILE):
        torch.mm(x2[lo:lo + ROW_TILE], wt, out=out[lo:lo + ROW_TILE])
    return out[:m].to(x.dtype).view(*lead, n)


def _pointwise(op: str, x: torch.Tensor) -> torch.Tensor:
    xf = x.float().contiguous()
    out = torch.empty_like(xf)
    getattr(library(), op)(xf, out)
    return out.to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` elementwise (fp32 math, ``x``'s dtype), every element alike."""
    return _pointwise("silu_invariant", x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` elementwise (fp32 math, ``x``'s dtype), every element alike."""
    return _pointwise("sigmoid_invariant", x)


# every sequence on the native kernel, whatever its query length
attention = functools.partial(native_seam.attention, max_query=1 << 62)


causal_conv = native_seam.conv_varlen  # the token-recurrent conv, prefill included


def _gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
         fresh: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.float32)
    library().gated_delta_varlen(q.float().contiguous(), k.float().contiguous(),  # type: ignore[attr-defined]
                                 v.float().contiguous(), a.float().contiguous(),
                                 b.float().contiguous(), a_log, dt_bias, pool, slots, fresh, cu,
                                 out, scale)
    return out


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None = None
                ) -> torch.Tensor:
    inner = torch_seam.inner_checkpoints(meta) if checkpoints is not None else []
    if not inner:
        out = _gdn(q, k, v, a, b, a_log, dt_bias, pool, meta.state_slots, meta.fresh_t,
                   meta.cu_seqlens_t, scale)
        torch_seam.save_chunk_ends(pool, checkpoints, meta)
        return out
    assert checkpoints is not None
    # Segments between a sequence's inner checkpoints, run phase by phase: phase p advances
    # every sequence through its p-th segment, then the states of the checkpoints ending there
    # are copied out; the recurrence (and so every bit) is the unsegmented one.
    cuts = {s: sorted(o for s2, o, _ in inner if s2 == s) for s, _, _ in inner}
    rows_of = {(s, o): r for s, o, r in inner}
    out = torch.empty(v.shape, dtype=torch.float32)
    start = [0] * meta.batch
    for p in range(1 + max(len(c) for c in cuts.values())):
        end = [cuts[s][p] if p < len(cuts.get(s, ())) else
               (meta.q_lens[s] if p <= len(cuts.get(s, ())) else start[s])
               for s in range(meta.batch)]
        rows = torch.cat([torch.arange(meta.cu_seqlens[s] + start[s], meta.cu_seqlens[s] + end[s])
                          for s in range(meta.batch)])
        cu = torch.tensor([0, *torch.tensor([e - s0 for s0, e in zip(start, end, strict=True)])
                           .cumsum(0).tolist()], dtype=torch.int32)
        fresh = meta.fresh_t & (p == 0)
        out.index_copy_(0, rows, _gdn(q[rows], k[rows], v[rows], a[rows], b[rows], a_log,
                                      dt_bias, pool, meta.state_slots, fresh, cu, scale))
        done = [(s, rows_of[(s, end[s])]) for s in range(meta.batch)
                if p < len(cuts.get(s, ())) and (s, end[s]) in rows_of]
        if done:
            checkpoints.index_copy_(0, torch.tensor([r for _, r in done]), pool.index_select(
                0, meta.state_slots[[s for s, _ in done]]))
        start = end
    torch_seam.save_chunk_ends(pool, checkpoints, meta)
    return out
