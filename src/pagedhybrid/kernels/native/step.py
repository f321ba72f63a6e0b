"""The native kernels behind the model's step seam (torch kernels for what they do not cover).

* attention -- the step's K/V written at ``meta.write_slots``; sequences with at most
  ``MAX_NATIVE_QUERY`` new tokens (decode, short continuations) run the native paged kernel in
  place over their pages; longer prefill chunks (compute-bound, GEMM-shaped) run the torch
  per-sequence SDPA path.
* causal conv / gated delta -- decode sequences are updated in place in their pool rows by the
  native kernels (a fresh sequence reads zeros, its row is only written); the conv of chunks of
  at most ``MAX_NATIVE_QUERY`` tokens runs the same per-token kernel (``conv_varlen``); longer
  chunks run the torch stream conv, and every chunk the chunked WY form, on their pool rows.
Mixed steps split by sequence; rows of the two groups are disjoint, so they never interact.
* gdn_decode -- a step of decode sequences (and verify chunks, captured) only: the whole Gated
  DeltaNet mixer between the
  input projections and ``out_proj`` (conv + SiLU, q / k L2 norms, the recurrent step, the gated
  RMS norm) in one native call, bit for bit what the separate kernels above and the native
  norms compute in turn (``csrc/state_updates.cpp`` ``gdn_decode_mixer``; the projections may
  be row views); other steps return None and the layer runs them op by op.
* gdn_decode_layer -- a whole Gated DeltaNet decoder layer (norms, projections, the mixer, the
  residuals and the MLP) of a decode-only step in one native call (``csrc/decode_layer.cpp``),
  bit for bit the layer's modules when the bundle's products at this batch are the native
  ``linear`` kernel or torch's GEMM (``dense.product_form``); None otherwise.
* attention_decode_layer -- the same for a full-attention layer over pages in the model dtype
  (quantized pages: None).
* CAPTURE -- a speculative verify step's recurrent state (``kernels/capsule.py``): the verify
  sequences' tokens through the per-token kernel on copies of their rows, capturing decay, key
  and delta (``gated_delta_capture``), and the accepted tokens replayed into the rows
  (``gated_delta_replay``), each bit for bit what the in-place kernels compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedhybrid.kernels.capsule import Capsule, StateCapture
from pagedhybrid.kernels.cpu import step as torch_step
from pagedhybrid.kernels.native import KV_SPLIT, dense, library
from pagedhybrid.kernels.native import quant as native_quant
from pagedhybrid.kernels.step import AttentionLayerWeights, GdnLayerWeights, StepMetadata
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
    short = meta.memo("conv_short", lambda: tuple(
        b for b in meta.multi if meta.q_lens[b] <= MAX_NATIVE_QUERY))
    for group, conv in ((short, conv_varlen), (tuple(b for b in meta.multi if b not in short),
                                               torch_step.conv_sequences)):
        if group:
            rows, sub = meta.subset(group)
            y.index_copy_(0, rows, conv(x.index_select(0, rows), weight, pool, sub, activation,
                                        checkpoints))
    return y


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """Every token of every sequence through the decode kernel's per-token conv, in place
    (``causal_conv_varlen``); checkpoints inside a chunk are copied from the inputs."""
    silu = activation in ("silu", "swish")
    w = weight.view(weight.shape[0], weight.shape[-1])  # [C, K]
    x = x.contiguous()
    init = (torch_step.initial_conv_rows(pool, meta)
            if checkpoints is not None and torch_step.inner_checkpoints(meta) else None)
    y = torch.empty_like(x)
    library().causal_conv_varlen(x, w, None, pool, meta.state_slots, meta.fresh_t,  # type: ignore[attr-defined]
                                 meta.cu_seqlens_t, y, silu)
    if init is not None:
        torch_step.save_inner_conv_checkpoints(x, init, meta, checkpoints)
    torch_step.save_chunk_ends(pool, checkpoints, meta)
    return y


FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _native_product(h: torch.Tensor, meta: StepMetadata,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                    quantized: bool = False) -> bool | None:
    """Whether a fused decode layer multiplies with the native kernel (True) or torch's GEMM
    (False), as ``matmul`` does at this batch (int8 / int4 weights: as ``quant.linear`` does);
    None when it cannot fuse the step (not decodes and verify chunks only, a dtype it does not
    fuse, another product form)."""
    if not meta.decode_or_verify or h.dtype not in FUSED_DTYPES:
        return None
    if quantized:  # the integer kernel, as quant.linear below its prefill form
        return True if h.shape[0] < native_quant.DEQUANT_ROWS else None
    return {"native": True, "torch": False}.get(dense.product_form(matmul, h.dtype, h.shape[0]))


def _save_chunk_ends(conv_pool: torch.Tensor, pool: torch.Tensor,
                     checkpoints: tuple[torch.Tensor | None, torch.Tensor | None],
                     meta: StepMetadata) -> None:
    torch_step.save_chunk_ends(conv_pool, checkpoints[0], meta)
    torch_step.save_chunk_ends(pool, checkpoints[1], meta)


def _chunks(meta: StepMetadata, capsule: Capsule | None) -> dict[str, torch.Tensor] | None:
    """The fused mixer's arguments for a step of decodes and verify chunks ({} for a
    decode-only step); None when it cannot fuse the step."""
    if meta.all_decode:
        return {}
    if not meta.decode_or_verify or capsule is None:
        return None
    return {"cu_seqlens": meta.cu_seqlens_t, "verify": meta.verify_mask,
            "capsule_conv": capsule.conv, "decay": capsule.decay, "key": capsule.key,
            "delta": capsule.delta}


def gdn_decode(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               conv_weight: torch.Tensor, conv_pool: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, pool: torch.Tensor, norm_weight: torch.Tensor,
               meta: StepMetadata, key_heads: int, scale: float, l2_eps: float, norm_eps: float,
               checkpoints: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
               capsule: Capsule | None = None) -> torch.Tensor | None:
    """The gated-norm output ``[N, Hv·Dv]`` (model dtype) of a step of decodes (and verify
    chunks, captured into ``capsule``) from the layer's projections ``qkv [N, C]``,
    ``z [N, Hv·Dv]``, ``a``, ``b [N, Hv]`` (row views are fine), the decoding sequences' conv and
    recurrent rows advanced in place and the step's chunk-end checkpoints written; None when the
    step has other chunks or the dtype is not fused (float32, bfloat16)."""
    chunks = _chunks(meta, capsule)
    if chunks is None or qkv.dtype not in FUSED_DTYPES or z.dtype != qkv.dtype:
        return None
    out = torch.empty(qkv.shape[0], z.shape[-1], dtype=qkv.dtype)
    library().gdn_decode_mixer(qkv, z, a, b, conv_weight.view(conv_weight.shape[0], -1),  # type: ignore[attr-defined]
                               conv_pool, a_log, dt_bias, pool, meta.state_slots, meta.fresh_t,
                               norm_weight, out, key_heads, scale, l2_eps, norm_eps, **chunks)
    _save_chunk_ends(conv_pool, pool, checkpoints, meta)
    return out


def gdn_decode_layer(h: torch.Tensor, w: GdnLayerWeights, conv_pool: torch.Tensor,
                     pool: torch.Tensor, meta: StepMetadata,
                     matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                     checkpoints: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                     capsule: Capsule | None = None) -> torch.Tensor | None:
    """The residual stream ``[N, hidden]`` after the whole layer for a step of decodes (and
    verify chunks, captured into ``capsule``; their rows unchanged) -- the pools advanced in
    place, chunk-end checkpoints written -- computed as the layer's modules do with ``matmul``;
    None when the step, the dtype or ``matmul``'s form at this batch is not one it fuses."""
    native = _native_product(h, meta, matmul, bool(w.quant))
    chunks = _chunks(meta, capsule)
    if native is None or chunks is None:
        return None
    out = library().gdn_decode_layer(  # type: ignore[attr-defined]
        h, w.input_norm, w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a,
        w.conv.view(w.conv.shape[0], -1), conv_pool, w.a_log, w.dt_bias, pool, meta.state_slots,
        meta.fresh_t, w.gated_norm, w.out_proj, w.post_norm, w.gate_proj, w.up_proj,
        w.down_proj, w.key_heads, w.scale, w.l2_eps, w.gated_eps, w.rms_eps, native, w.quant,
        w.quant_bits, **chunks)
    _save_chunk_ends(conv_pool, pool, checkpoints, meta)
    return out


def attention_decode_layer(h: torch.Tensor, w: AttentionLayerWeights, cos: torch.Tensor,
                           sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           meta: StepMetadata,
                           matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                           scales: KVScales | None = None) -> torch.Tensor | None:
    """The residual stream ``[N, hidden]`` after the whole layer for a step of decodes and
    verify chunks (the step's K/V written to their pages), computed as the layer's modules do
    with ``matmul``;
    None when the step, the dtype, the pages (quantized) or ``matmul``'s form at this batch is
    not one it fuses."""
    native = _native_product(h, meta, matmul, bool(w.quant))
    if native is None or scales is not None or key_cache.dtype != h.dtype:
        return None
    assert meta.write_slots is not None
    return library().attention_decode_layer(  # type: ignore[attr-defined]
        h, w.input_norm, w.q_proj, w.k_proj, w.v_proj, w.q_norm, w.k_norm, cos, sin, key_cache,
        value_cache, meta.write_slots, meta.block_table, meta.cu_seqlens_t, meta.past_t,
        meta.seq_index(tuple(range(meta.batch))), w.o_proj, w.post_norm, w.gate_proj, w.up_proj,
        w.down_proj, w.heads, w.kv_heads, w.scale, w.rms_eps, KV_SPLIT, native, w.quant,
        w.quant_bits)


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


def _capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
             meta: StepMetadata, scale: float, capsule: Capsule) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.float32)
    library().gated_delta_capture(q.float().contiguous(), k.float().contiguous(),  # type: ignore[attr-defined]
                                  v.float().contiguous(), a.float().contiguous(),
                                  b.float().contiguous(), a_log, dt_bias, pool,
                                  meta.state_slots, meta.fresh_t, meta.cu_seqlens_t, out, scale,
                                  capsule.decay, capsule.key, capsule.delta)
    return out


def _replay(pool: torch.Tensor, slots: torch.Tensor, capsule: Capsule, begin: torch.Tensor,
            end: torch.Tensor) -> None:
    library().gated_delta_replay(pool, slots, capsule.decay, capsule.key, capsule.delta,  # type: ignore[attr-defined]
                                 begin, end)


CAPTURE = StateCapture(_capture, _replay)
