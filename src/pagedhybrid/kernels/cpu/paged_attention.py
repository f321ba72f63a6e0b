"""Fast CPU ``com.microsoft.PagedAttention`` (SEPARATE K/V pages): tiled page reads + SDPA.

Same contract, signature and validation as ``pagedhybrid.ops.paged_attention``:
``paged_attention`` is the ``torch`` implementation registered with ``SPEC.implement`` (it takes
``SPEC.signature()`` and receives the ``BoundCall``; ``validate_call`` gives the derived dims);
``compute(inputs, dims)`` is the fast path on a validated call, so a caller that runs many layers
over the same batch metadata can validate once per step.

Cache layout (the contract's): ``key_cache``/``value_cache`` ``[num_blocks, block_size,
kv_num_heads, head_size]``; position ``p`` of sequence ``b`` is page ``block_table[b, p // bs]``,
offset ``p % bs``.

Steps:

1. Split Q/K/V, q/k RMSNorm and RoPE (the reference's vectorised helpers, float32 / float64).
2. Write this step's K/V with one ``index_copy_`` per cache into the flat ``[slots, Hkv, D]``
   view (slots from ``validate``: ``slot_mapping`` or derived; ``-1`` skipped).
3. Decode sequences (one new token): sorted by length and cut into tiles of (sequence group x page
   range) of about ``TILE_BYTES`` of K+V. Each tile's pages are gathered with ``index_select``
   (whole pages, the fast row copy) into reused scratch and transposed in cache to head-major
   ``[Hkv, W, D]`` (no copy of the whole context is ever materialised), then attended with
   ``_scaled_dot_product_flash_attention_for_cpu`` with GQA folded into the query axis: the
   ``G = Hq/Hkv`` query heads of a kv head are ``G`` query rows over that kv head, so every K/V
   row is read once for all of them and K/V are never repeated. Tiles return ``(out, lse)``
   (``lse = -inf`` for a row that sees no key of the tile); per sequence group they are folded
   left in ascending page order with ``pagedhybrid.kernels.lse.merge_states``, the package's one
   merge. A key mask (length, window) is built only for tiles that need one.
4. Prefill / chunked-prefill sequences (more than one new token), one at a time: the context's
   pages are gathered once into ``[Hkv, L, D]`` (attention is compute-bound here) and attended
   with native GQA in two SDPA calls merged by ``merge_states`` (history first): the history
   ``[0, past)`` unmasked and the step's own keys with ``is_causal`` (top-left aligned == the
   contract's alignment). Sliding windows and ``is_causal=0`` use an explicit mask (query rows
   in blocks) instead.
5. ``head_sink`` enters the merged lse as one more logit: ``out *= exp(lse - logaddexp(lse, s))``.

Quantized pages (int8 / float8e4m3fn, ``pagedhybrid.kvquant``): the write quantizes by ORT's
rule; tiles are converted from the stored type while they are gathered (never the whole
context), K's scale is folded into the query and V's into the output, and the tiles run in the
query's type.

``softcap > 0`` cannot be expressed through SDPA: those tiles use float32 matmul/tanh/softmax
(same tiling and merging, GQA by grouping query heads per kv head, no K/V repeat). Every
contract feature runs here; nothing is delegated to the reference.

Precision: tiles run in the cache type with float32 accumulation inside SDPA (float64 for double
caches); q is rounded to the cache type as ONNX Runtime's kernels do. float32/float64 results
match the reference to summation order; bf16/fp16 results differ from the all-float32 reference
by about 2 ulps of the output type (probabilities and tile partials are rounded to bf16).
Merging, the sink and the output are float32 (float64 for double caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedhybrid.kernels.lse import NEG_INF, fold_left, merge_states
from pagedhybrid.kernels.registry import OpCoverage
from pagedhybrid.kvquant import is_quantized, quantize, query_scales, scatter_rows
from pagedhybrid.ops.paged_attention import (
    SPEC,
    PagedAttentionDims,
    _rms_norm,
    _rope,
    validate_call,
)
from pagedhybrid.ops.spec import BoundCall

__all__ = ["COVERAGE", "TileContext", "attend_decode", "attend_prefill", "compute",
           "paged_attention"]

TILE_BYTES = 1 << 20  # K+V bytes (cache type) gathered per decode tile (~L2 size)
_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

COVERAGE = OpCoverage(
    op="com.microsoft.PagedAttention",
    dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
    features=("decode", "prefill", "chunked_prefill", "gqa", "packed_qkv", "slot_mapping",
              "is_causal:0/1", "local_window_size", "softcap", "head_sink", "qk_norm",
              "do_rotary", "rotary_interleaved", "rotary_offset", "attention_metadata",
              "zero_length_queries", "int8_cache", "fp8_e4m3_cache", "per_tensor_scales",
              "per_channel_scales"),
    delegated={},
    paths={"decode": "tiles of (sequence group x page range), index_select into a reused "
                     "buffer + SDPA with GQA folded into the query axis, lse merge",
           "prefill": "per sequence: gathered context, native-GQA SDPA, history + causal "
                      "block merged by lse (explicit mask for windows / is_causal=0)",
           "softcap": "same tiling with a matmul/tanh/softmax tile instead of SDPA"},
)


@SPEC.implement("torch")
def paged_attention(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fast PagedAttention; returns ``(output, key_cache, value_cache)`` (caches in place)."""
    return compute(call.inputs, validate_call(call))


def compute(inputs: Sequence[torch.Tensor | None], dims: PagedAttentionDims
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast path on already-validated inputs (``dims = validate_call(call)``)."""
    (query, key, value, key_cache, value_cache, _cu, _past, block_table, cos, sin, _slots,
     head_sink, q_norm, k_norm, k_scale, v_scale, _meta) = inputs
    assert query is not None and key_cache is not None and value_cache is not None
    a = dims.attrs
    n, hq, hkv, d = dims.num_tokens, dims.num_heads, dims.kv_num_heads, dims.head_size
    quant = is_quantized(key_cache.dtype)
    cdt = torch.float64 if dims.dtype == torch.float64 else torch.float32
    if n == 0:
        return query.new_zeros((0, hq * d)), key_cache, value_cache

    # 1. split, q/k norm, RoPE at absolute positions
    if dims.packed_qkv:
        q_flat, k_flat, v_flat = query.split([hq * d, hkv * d, hkv * d], dim=1)
    else:
        assert key is not None and value is not None
        q_flat, k_flat, v_flat = query, key, value
    q = q_flat.to(cdt).reshape(n, hq, d)  # [N, Hq, D]
    k = k_flat.to(cdt).reshape(n, hkv, d)  # [N, Hkv, D]
    v = v_flat.reshape(n, hkv, d)  # [N, Hkv, D] (only written to the cache)
    if q_norm is not None:
        assert k_norm is not None
        q = _rms_norm(q, q_norm.to(cdt), a["qk_norm_epsilon"])
        k = _rms_norm(k, k_norm.to(cdt), a["qk_norm_epsilon"])
    q_lens = torch.tensor(dims.q_lens, dtype=torch.long)  # [B]
    past = torch.tensor(dims.past_lens, dtype=torch.long)  # [B]
    tok_seq = torch.repeat_interleave(torch.arange(dims.batch), q_lens)  # [N]
    starts = torch.tensor(dims.cu_seqlens[:-1], dtype=torch.long)  # [B]
    positions = past[tok_seq] + torch.arange(n) - starts[tok_seq]  # [N] absolute positions
    if a["do_rotary"]:
        assert cos is not None and sin is not None
        args = (cos.to(cdt), sin.to(cdt), positions, a["rotary_offset"], dims.rotary_dim,
                bool(a["rotary_interleaved"]))
        q, k = _rope(q, *args), _rope(k, *args)

    # 2. write this step's K/V (cache element type) in one scatter per cache
    slots = torch.tensor(dims.write_slots, dtype=torch.long)  # [N]
    keep = slots >= 0
    if bool(keep.any()):
        idx = slots[keep]
        if quant:
            assert k_scale is not None and v_scale is not None
            kw, vw = quantize(k[keep], k_scale, key_cache.dtype), quantize(
                v[keep], v_scale, key_cache.dtype)
        else:
            kw, vw = k[keep].to(key_cache.dtype), v[keep].to(value_cache.dtype)
        scatter_rows(key_cache, idx, kw)
        scatter_rows(value_cache, idx, vw)
    if quant:  # fold the scales: q . (s k) = (q s) . k and sum p (s v) = s sum p v
        assert k_scale is not None and v_scale is not None
        qs, vs = query_scales(k_scale, v_scale, hq, hkv, d)  # [Hq, D] each
        q = q * qs.to(cdt)

    # 3./4. attention
    out = torch.empty(n, hq, d, dtype=cdt)  # [N, Hq, D]
    lse = torch.empty(n, hq, dtype=cdt)  # [N, Hq]
    table = block_table.to(torch.long)  # [B, M]
    ctx = TileContext(key_cache, value_cache, table, dims, cdt,
                      dims.dtype if quant else key_cache.dtype)
    decode = [b for b in range(dims.batch) if dims.q_lens[b] == 1]
    if decode:
        attend_decode(ctx, q, decode, out, lse)
    for b in range(dims.batch):
        if dims.q_lens[b] > 1:
            attend_prefill(ctx, q, b, out, lse)

    # 5. head sink: one more logit in the denominator
    if head_sink is not None:
        sink = head_sink.to(cdt)[None, :]  # [1, Hq]
        out *= torch.exp(lse - torch.logaddexp(lse, sink))[..., None]
    if quant:
        out *= vs.to(cdt)
    return out.reshape(n, hq * d).to(query.dtype), key_cache, value_cache


class TileContext:
    """Per-call constants shared by the tile functions."""

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                 dims: PagedAttentionDims, cdt: torch.dtype, adt: torch.dtype) -> None:
        self.table, self.dims, self.cdt = table, dims, cdt
        # attention tiles run in ``adt`` (fp32 accumulation): the cache type, or the query's
        # for a quantized cache (tiles are converted as they are gathered)
        self.adt = adt
        a = dims.attrs
        self.scale, self.softcap = dims.scale, float(a["softcap"])
        self.window, self.causal = int(a["local_window_size"]), bool(a["is_causal"])
        self.bs, self.hkv, self.d = dims.block_size, dims.kv_num_heads, dims.head_size
        self.group = dims.num_heads // dims.kv_num_heads
        self.kc, self.vc = key_cache, value_cache

    def gather(self, pages: torch.Tensor, buf: tuple[torch.Tensor, ...] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``[P']`` -> K, V ``[Hkv, P', bs, D]`` contiguous (head-major).

        ``index_select`` along the page axis (contiguous pages, the fast copy), then one
        transposing copy of the (cache-resident) tile; ``buf`` = (raw K, raw V, K, V) scratch.
        """
        if buf is None:
            return (self.kc.index_select(0, pages).permute(2, 0, 1, 3).to(self.adt).contiguous(),
                    self.vc.index_select(0, pages).permute(2, 0, 1, 3).to(self.adt).contiguous())
        rk = torch.index_select(self.kc, 0, pages, out=buf[0])  # [P', bs, Hkv, D]
        rv = torch.index_select(self.vc, 0, pages, out=buf[1])
        return buf[2].copy_(rk.permute(2, 0, 1, 3)), buf[3].copy_(rv.permute(2, 0, 1, 3))


# -- decode --------------------------------------------------------------------------------------
def attend_decode(ctx: TileContext, q: torch.Tensor, seqs: list[int], out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """All single-token sequences: (sequence group x page range) tiles merged by lse."""
    dims, bs, hkv, d, g = ctx.dims, ctx.bs, ctx.hkv, ctx.d, ctx.group
    order = sorted(seqs, key=lambda b: -dims.total_lens[b])
    tile_tokens = max(bs, TILE_BYTES // (2 * hkv * d * ctx.adt.itemsize))
    i = 0
    while i < len(order):
        longest = dims.total_lens[order[i]]
        pages_longest = -(-longest // bs)
        n_seq = max(1, min(len(order) - i, tile_tokens // (pages_longest * bs)))
        grp = order[i: i + n_seq]
        i += n_seq
        w_pages = max(1, min(pages_longest, tile_tokens // (n_seq * bs)))
        rows = torch.tensor([dims.cu_seqlens[b] for b in grp])  # [n] token rows
        tot_list = [dims.total_lens[b] for b in grp]
        totals = torch.tensor(tot_list)  # [n]
        shortest = min(tot_list)
        qg = q[rows].reshape(n_seq, hkv, g, d).to(ctx.adt)  # [n, Hkv, G, D]: GQA as queries
        pages_all = ctx.table[grp][:, :pages_longest].clamp(min=0)  # [n, pages]; -1 -> page 0
        raw, head = (n_seq * w_pages, bs, hkv, d), (hkv, n_seq * w_pages, bs, d)
        buf = [torch.empty(raw, dtype=ctx.kc.dtype), torch.empty(raw, dtype=ctx.kc.dtype),
               torch.empty(head, dtype=ctx.adt), torch.empty(head, dtype=ctx.adt)]
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # tile (out, lse), cdt
        for p0 in range(0, pages_longest, w_pages):
            p1 = min(pages_longest, p0 + w_pages)
            wp, m = p1 - p0, n_seq * (p1 - p0)
            mask = any_key = None
            if shortest < p1 * bs or (ctx.window > 0 and p0 * bs < longest - 1 - ctx.window):
                kpos = p0 * bs + torch.arange(wp * bs)  # [W] key positions of the tile
                visible = kpos[None, :] < totals[:, None]  # [n, W]
                if ctx.window > 0:
                    visible &= kpos[None, :] >= (totals - 1 - ctx.window)[:, None]
                any_key = visible.any(dim=1)  # [n]
                if not bool(any_key.any()):
                    continue
                mask = visible[:, None, None, :]  # [n, 1, 1, W]
            pages = pages_all[:, p0:p1].flatten()  # [n*wp]
            kt, vt = ctx.gather(pages, (buf[0][:m], buf[1][:m], buf[2][:, :m], buf[3][:, :m]))
            kt = kt.view(hkv, n_seq, wp * bs, d).transpose(0, 1)  # [n, Hkv, W, D] view
            vt = vt.view(hkv, n_seq, wp * bs, d).transpose(0, 1)
            o_t, l_t = _tile(ctx, qg, kt, vt, mask)  # [n, Hkv, G, D], [n, Hkv, G]
            if any_key is not None:
                l_t = l_t.masked_fill(~any_key[:, None, None], NEG_INF)
            parts.append((o_t.to(ctx.cdt), l_t))
        o_g, l_g = fold_left(parts)  # ascending page order
        out[rows] = o_g.reshape(n_seq, hkv * g, d)
        lse[rows] = l_g.reshape(n_seq, hkv * g)


# -- prefill -------------------------------------------------------------------------------------
def attend_prefill(ctx: TileContext, q: torch.Tensor, b: int, out: torch.Tensor,
                   lse: torch.Tensor) -> None:
    """One sequence with more than one new token: its whole context, native GQA."""
    dims, bs = ctx.dims, ctx.bs
    q_len, past, start = dims.q_lens[b], dims.past_lens[b], dims.cu_seqlens[b]
    total = past + q_len
    n_pages = -(-total // bs)
    kc, vc = ctx.gather(ctx.table[b, :n_pages])  # [Hkv, n_pages, bs, D]
    hkv, d = ctx.hkv, ctx.d
    kc = kc.view(1, hkv, n_pages * bs, d)[:, :, :total]  # [1, Hkv, L, D]
    vc = vc.view(1, hkv, n_pages * bs, d)[:, :, :total]
    qb = q[start: start + q_len].transpose(0, 1)[None].to(ctx.adt)  # [1, Hq, Q, D]
    qpos = past + torch.arange(q_len)  # [Q]
    kpos = torch.arange(total)  # [L]
    if ctx.window > 0 or not ctx.causal or ctx.softcap > 0:
        visible = kpos[None, :] <= qpos[:, None] if ctx.causal else \
            torch.ones(q_len, total, dtype=torch.bool)
        if ctx.window > 0:
            visible &= kpos[None, :] >= (qpos - ctx.window)[:, None]
        o_b, l_b = _tile_rows(ctx, qb, kc, vc, visible)
    else:  # causal without window: unmasked history + causal block, merged by lse
        o_b, l_b = _tile(ctx, qb, kc[:, :, past:], vc[:, :, past:], None, causal=True)
        if past > 0:
            o_h, l_h = _tile(ctx, qb, kc[:, :, :past], vc[:, :, :past], None)
            o_b, l_b = merge_states(o_h.to(ctx.cdt), l_h, o_b.to(ctx.cdt), l_b)
    out[start: start + q_len] = o_b[0].transpose(0, 1).to(ctx.cdt)  # [Q, Hq, D]
    lse[start: start + q_len] = l_b[0].transpose(0, 1)


def _tile_rows(ctx: TileContext, qb: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention for query rows (blocks of rows, so the mask/logits stay small)."""
    q_len = qb.shape[2]
    rows = max(1, (1 << 22) // max(1, kc.shape[2] * qb.shape[1]))
    outs, lses = [], []
    for r0 in range(0, q_len, rows):
        vis = visible[r0: r0 + rows]  # [r, L]
        o_r, l_r = _tile(ctx, qb[:, :, r0: r0 + rows], kc, vc, vis[None, None])
        l_r = l_r.masked_fill(~vis.any(dim=1)[None, None], NEG_INF)
        outs.append(o_r)
        lses.append(l_r)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# -- tiles ---------------------------------------------------------------------------------------
def _tile(ctx: TileContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          visible: torch.Tensor | None, causal: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[n, Hq', Q, D]`` over k/v ``[n, Hkv, L, D]`` -> (out, lse ``[n,Hq',Q]``).

    ``visible`` (bool, broadcastable to ``[n, Hq', Q, L]``) or ``causal`` (top-left) mask keys;
    rows with no visible key come back with garbage and must be masked by the caller.
    """
    if ctx.softcap > 0:
        return _tile_softcap(ctx, q, k, v, visible, causal)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, NEG_INF)
    o, lse = _SDPA(q, k, v, 0.0, causal, attn_mask=mask, scale=ctx.scale)
    return o, lse.to(ctx.cdt)


def _tile_softcap(ctx: TileContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  visible: torch.Tensor | None, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Matmul tile with ``softcap * tanh(logit / softcap)``; GQA by grouping query heads."""
    q, k, v = q.to(ctx.cdt), k.to(ctx.cdt), v.to(ctx.cdt)  # softcap tiles: float32 logits
    n, hq, q_len, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(n, hkv, g * q_len, d)  # [n, Hkv, G*Q, D] (query head h -> kv head h // G)
    logits = (qg @ k.transpose(-1, -2)) * ctx.scale  # [n, Hkv, G*Q, L]
    logits = (ctx.softcap * torch.tanh(logits / ctx.softcap)).view(n, hkv, g, q_len, total)
    if causal:
        visible = torch.ones(q_len, total, dtype=torch.bool).tril()  # [Q, L]
    if visible is not None:  # broadcastable to [n, 1, Q, L] -> [n, 1, 1, Q, L]
        vis = visible.unsqueeze(-3) if visible.dim() >= 3 else visible
        logits = logits.masked_fill(~vis, NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [n, Hkv, G, Q]
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    o = probs.view(n, hkv, g * q_len, total) @ v  # [n, Hkv, G*Q, D]
    return o.view(n, hq, q_len, d), lse.reshape(n, hq, q_len)
