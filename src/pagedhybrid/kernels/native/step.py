"""The native kernels behind the model's step seam (torch kernels for what they do not cover).

* attention -- the step's K/V written at ``meta.write_slots``; sequences with at most
  ``MAX_NATIVE_QUERY`` new tokens (decode, short continuations) run the native paged kernel in
  place over their pages; longer prefill chunks (compute-bound, GEMM-shaped) run the torch
  per-sequence SDPA path.
* causal conv / gated delta -- decode sequences are updated in place in their pool rows by the
  native kernels (a fresh sequence reads zeros, its row is only written); sequences with more
  than one new token run the torch stream conv / chunked WY form on their pool rows.
Mixed steps split by sequence; rows of the two groups are disjoint, so they never interact.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.cpu import step as torch_step
from pagedhybrid.kernels.native import KV_SPLIT, library
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.kvquant import KVScales

MAX_NATIVE_QUERY = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, meta: StepMetadata, scale: float,
              scales: KVScales | None = None, max_query: int = MAX_NATIVE_QUERY
              ) -> torch.Tensor:
    """Sequences with at most ``max_query`` new tokens on the native kernel, longer ones on the
    torch SDPA path."""
    torch_step.write_kv(k, v, key_cache, value_cache, meta, scales)
    short = meta.memo(f"native_short{max_query}", lambda: tuple(
        b for b in range(meta.batch) if 0 < meta.q_lens[b] <= max_query))
    long_ = tuple(b for b in range(meta.batch) if meta.q_lens[b] > max_query)
    n, hq, d = q.shape
    qf, vs, adt = torch_step.folded_query(q, key_cache, scales)  # int8 / fp8: scales folded
    out = (torch.empty(n, hq, d, dtype=torch.float32) if not long_ else
           torch_step.attend(qf.to(adt), key_cache, value_cache, meta, scale, long_, adt))
    if short:
        library().paged_attention(qf.contiguous(), key_cache, value_cache,  # type: ignore[attr-defined]
                              meta.block_table, meta.cu_seqlens_t, meta.past_t,
                              meta.seq_index(short), out, scale, KV_SPLIT)
    if vs is not None:
        out *= vs
    return out.to(q.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    silu = activation in ("silu", "swish")
    w = weight.view(weight.shape[0], weight.shape[-1])  # [C, K] (a view: [C, 1, K] contiguous)
    if meta.all_decode:
        y = torch.empty_like(x)
        library().causal_conv_decode(x.contiguous(), w, None, pool, meta.state_slots,  # type: ignore[attr-defined]
                                     meta.fresh_t, y, silu)
        torch_step.save_chunk_ends(pool, checkpoints, meta)
        return y
    y = torch.empty_like(x)
    if meta.decode:
        rows, sub = meta.subset(meta.decode)
        yd = torch.empty(rows.numel(), x.shape[1], dtype=x.dtype)
        library().causal_conv_decode(x.index_select(0, rows), w, None, pool, sub.state_slots,  # type: ignore[attr-defined]
                                     sub.fresh_t, yd, silu)
        torch_step.save_chunk_ends(pool, checkpoints, sub)
        y.index_copy_(0, rows, yd)
    rows, sub = meta.subset(meta.multi)
    y.index_copy_(0, rows, torch_step.conv_sequences(x.index_select(0, rows), weight, pool, sub,
                                                     activation, checkpoints))
    return y


def _gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                slots: torch.Tensor, fresh: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.float32)
    library().gated_delta_decode(q.float().contiguous(), k.float().contiguous(),  # type: ignore[attr-defined]
                             v.float().contiguous(), a.float().contiguous(),
                             b.float().contiguous(), a_log, dt_bias, pool, slots, fresh, out,
                             scale)
    return out


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None = None
                ) -> torch.Tensor:
    if meta.all_decode:
        o = _gdn_decode(q, k, v, a, b, a_log, dt_bias, pool, meta.state_slots, meta.fresh_t,
                        scale)
        torch_step.save_chunk_ends(pool, checkpoints, meta)
        return o
    out = torch.empty(v.shape, dtype=torch.float32)
    if meta.decode:
        rows, sub = meta.subset(meta.decode)
        out.index_copy_(0, rows, _gdn_decode(
            q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, pool, sub.state_slots,
            sub.fresh_t, scale))
        torch_step.save_chunk_ends(pool, checkpoints, sub)
    rows, sub = meta.subset(meta.multi)
    out.index_copy_(0, rows, torch_step.gated_delta(
        q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, pool, sub, scale,
        checkpoints))
    return out
