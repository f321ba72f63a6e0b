"""The torch kernels behind the model's step seam: metadata in, pools updated in place.

Each function is one layer's operator on a validated ``StepMetadata`` (no re-validation, no
per-layer host sync) with the state resident in its pool:

* ``attention(q [N, Hq, D], k, v [N, Hkv, D], key_cache, value_cache, meta, scale, scales)``
  -- writes the step's K/V at ``meta.write_slots`` (one ``index_copy_`` per cache; quantized by
  ORT's rule when the pages are int8 / float8e4m3fn and ``scales`` is the layer's
  ``KVScales``) and attends with the tiled decode / per-sequence prefill paths of
  ``paged_attention.py`` (scales folded into q and the output); returns ``[N, Hq, D]``.
* ``causal_conv(x [N, C], weight [C, 1, K], pool [S, C, K-1], meta, activation)`` -- decode
  sequences update their pool rows in place (a fresh one reads zeros); longer ones run the
  stream conv from their pool rows (zeros when fresh) and write the final states back.
* ``gated_delta(q, k [N, Hk, Dk], v [N, Hv, Dv], a, b [N, Hv], a_log, dt_bias, pool
  [S, Hv, Dv, Dk], meta, scale)`` -- the qwen gate and sigmoid beta, then the blocked recurrent
  step (decode) or the chunked WY form (prefill) directly on the pool rows; fresh rows are
  zeroed first (``index_fill_``) since the chunked form reads its initial state.

State checkpoints (``meta.checkpoints``, prefix caching) go into the layer's checkpoint pool
(``checkpoints``, same row layout as ``pool``): at the end of a sequence's chunk they are copies
of its pool row after the update; inside the chunk, the conv's is the window of the last K-1
inputs and the recurrence's is emitted by the chunked form as it passes the position (no second
pass over the tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedhybrid.kernels.cpu.gated_delta_net import CHUNK, forward
from pagedhybrid.kernels.cpu.paged_attention import TileContext, attend_decode, attend_prefill
from pagedhybrid.kernels.cpu.varlen_causal_conv import compute as conv_compute
from pagedhybrid.kernels.cpu.varlen_causal_conv import window
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.kvquant import KVScales, quantize, query_scales, scatter_rows
from pagedhybrid.ops.varlen_causal_conv import ConvDims


class StepDims(NamedTuple):
    """The fields of ``PagedAttentionDims`` the attention tiles (``TileContext``) read."""

    cu_seqlens: tuple[int, ...]
    q_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    total_lens: tuple[int, ...]
    block_size: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    batch: int
    scale: float
    attrs: dict[str, object]


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, meta: StepMetadata, scales: KVScales | None = None
             ) -> None:
    """The step's keys/values into their page slots (cache element type; quantized with the
    layer's ``scales`` for int8 / float8 pages)."""
    assert meta.write_slots is not None
    if scales is not None:
        k, v = quantize(k, scales.k, key_cache.dtype), quantize(v, scales.v, value_cache.dtype)
    scatter_rows(key_cache, meta.write_slots, k.to(key_cache.dtype))
    scatter_rows(value_cache, meta.write_slots, v.to(value_cache.dtype))


def folded_scales(q: torch.Tensor, key_cache: torch.Tensor, scales: KVScales
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(K's scale, V's) per query head ``[Hq, D]`` float32, memo-free (tiny)."""
    return query_scales(scales.k, scales.v, q.shape[1], key_cache.shape[2], q.shape[2])


def folded_query(q: torch.Tensor, key_cache: torch.Tensor, scales: KVScales | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """The native kernels' query (fp32, times K's scale for quantized pages), V's scale for the
    output (None: unquantized) and the type the torch tiles run in."""
    if scales is None:
        return q.float(), None, key_cache.dtype
    qs, vs = folded_scales(q, key_cache, scales)
    return q.float() * qs, vs, q.dtype


def attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           meta: StepMetadata, scale: float, seqs: tuple[int, ...] | None = None,
           adt: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of ``q [N, Hq, D]`` over the pages (already written); float32 out.
    ``seqs`` restricts the work to those sequences (other rows are left unwritten); tiles run
    in ``adt`` (default: the cache type)."""
    n, hq, d = q.shape
    hkv = key_cache.shape[2]
    dims = StepDims(meta.cu_seqlens, meta.q_lens, meta.past_lens, meta.total_lens,
                    meta.block_size, hq, hkv, d, meta.batch, scale,
                    {"softcap": 0.0, "local_window_size": -1, "is_causal": 1})
    cdt = torch.float32
    out = torch.empty(n, hq, d, dtype=cdt)
    lse = torch.empty(n, hq, dtype=cdt)
    ctx = TileContext(key_cache, value_cache, meta.block_table.long(), dims,  # type: ignore[arg-type]
                      cdt, adt or key_cache.dtype)
    todo = range(meta.batch) if seqs is None else seqs
    decode = [b for b in todo if meta.q_lens[b] == 1]
    if decode:
        attend_decode(ctx, q, decode, out, lse)
    for b in todo:
        if meta.q_lens[b] > 1:
            attend_prefill(ctx, q, b, out, lse)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, meta: StepMetadata, scale: float,
              scales: KVScales | None = None) -> torch.Tensor:
    write_kv(k, v, key_cache, value_cache, meta, scales)
    if scales is None:
        return attend(q.to(key_cache.dtype), key_cache, value_cache, meta, scale).to(q.dtype)
    qs, vs = folded_scales(q, key_cache, scales)
    out = attend((q.float() * qs).to(q.dtype), key_cache, value_cache, meta, scale,
                 adt=q.dtype)
    return (out * vs).to(q.dtype)


# -- state checkpoints ---------------------------------------------------------------------------
def save_chunk_ends(pool: torch.Tensor, checkpoints: torch.Tensor | None, meta: StepMetadata
                    ) -> None:
    """Checkpoints at the end of their sequence's chunk: the pool rows, after the update."""
    ends = [(b, r) for b, o, r in meta.checkpoints if o == meta.q_lens[b]]
    if checkpoints is None or not ends:
        return
    rows = torch.tensor([r for _, r in ends])
    checkpoints.index_copy_(0, rows, pool.index_select(0, meta.state_slots[[b for b, _ in ends]]))


def inner_checkpoints(meta: StepMetadata) -> list[tuple[int, int, int]]:
    """Checkpoints strictly inside their sequence's chunk."""
    return [(b, o, r) for b, o, r in meta.checkpoints if o < meta.q_lens[b]]


# -- conv ----------------------------------------------------------------------------------------
def _conv_dims(x: torch.Tensor, weight: torch.Tensor, cu: tuple[int, ...], activation: str
               ) -> ConvDims:
    k = weight.shape[-1]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    return ConvDims(total_tokens=x.shape[0], channels=x.shape[1], batch=len(cu) - 1,
                    kernel_size=k, dilation=1, state_len=k - 1, cu_seqlens=cu,
                    dtype=x.dtype, compute_dtype=ct, attrs={"activation": activation})


def conv_decode(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                slots: torch.Tensor, fresh: torch.Tensor, activation: str) -> torch.Tensor:
    """One token per sequence (``x [n, C]``), pool rows ``slots`` updated in place."""
    state = pool.index_select(0, slots)  # [n, C, K-1]
    state[fresh] = 0
    w = weight[:, 0, :].to(torch.float32)  # [C, K]
    xf = x.to(torch.float32)
    y = xf * w[:, -1] + (state.to(torch.float32) * w[:, :-1]).sum(-1)  # [n, C]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    pool.index_copy_(0, slots, torch.cat([state[:, :, 1:], x[:, :, None]], dim=2))
    return y.to(x.dtype)


def conv_sequences(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                   meta: StepMetadata, activation: str,
                   checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """The stream conv of whole chunks from their pool rows; final states written back, and
    checkpoints inside the chunks taken from the inputs (the last K-1 before the position)."""
    init = initial_conv_rows(pool, meta)  # [b, C, K-1]
    y, final = conv_compute(x, weight, None, init,
                            _conv_dims(x, weight, meta.cu_seqlens, activation))
    save_inner_conv_checkpoints(x, init, meta, checkpoints)
    pool.index_copy_(0, meta.state_slots, final.to(pool.dtype))
    save_chunk_ends(pool, checkpoints, meta)
    return y


def initial_conv_rows(pool: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """The sequences' conv states before the step ``[b, C, K-1]`` (zeros when fresh), a copy."""
    init = pool.index_select(0, meta.state_slots)
    init[meta.fresh_t] = 0
    return init


def save_inner_conv_checkpoints(x: torch.Tensor, init: torch.Tensor, meta: StepMetadata,
                                checkpoints: torch.Tensor | None) -> None:
    """Conv checkpoints inside the chunks: the last K-1 inputs before each position, copied
    from the step's inputs ``x`` and the initial states ``init`` (exact row copies)."""
    inner = inner_checkpoints(meta)
    if checkpoints is None or not inner:
        return
    sl = init.shape[-1]
    seq = torch.tensor([b for b, _, _ in inner])
    pos = torch.tensor([o for _, o, _ in inner])[:, None] + torch.arange(-sl, 0)  # [R, L]
    state_rows = init.permute(0, 2, 1).reshape(-1, init.shape[1])  # [b*L, C]
    win = window(x, state_rows, torch.tensor(meta.cu_seqlens), seq, pos, sl)  # [R, L, C]
    checkpoints.index_copy_(0, torch.tensor([r for _, _, r in inner]),
                            win.permute(0, 2, 1).to(checkpoints.dtype))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    if meta.all_decode:
        y = conv_decode(x, weight, pool, meta.state_slots, meta.fresh_t, activation)
        save_chunk_ends(pool, checkpoints, meta)
        return y
    return conv_sequences(x, weight, pool, meta, activation, checkpoints)


# -- gated delta net -----------------------------------------------------------------------------
def qwen_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (the contract's qwen
    gate and sigmoid beta, fp32)."""
    g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None = None
                ) -> torch.Tensor:
    g, beta = qwen_gates(a, b, a_log, dt_bias)
    if any(meta.fresh):
        pool.index_fill_(0, meta.state_slots[meta.fresh_t], 0.0)
    emit: dict[int, list[tuple[int, torch.Tensor]]] = {}
    if checkpoints is not None:
        for s, o, r in inner_checkpoints(meta):
            emit.setdefault(s, []).append((o, checkpoints[r]))
    o = forward(q.float(), k.float(), v.float(), g, beta, pool, meta.cu_seqlens, "gated_delta",
                scale, CHUNK, state_rows=meta.state_slots, emit=emit)
    save_chunk_ends(pool, checkpoints, meta)
    return o
