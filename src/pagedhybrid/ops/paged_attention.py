"""``com.microsoft.PagedAttention`` (SEPARATE K/V pages): contract and torch reference.

One call serves a packed batch of ``batch`` sequences: ``cumulative_sequence_length`` [B+1]
splits the ``num_tokens`` new tokens, ``past_seqlens`` [B] counts tokens already in the cache.

State layout: ``key_cache``/``value_cache`` ``[num_blocks, block_size, kv_num_heads, head_size]``
(pages are never zeroed). Token ``i`` of sequence ``b`` has absolute position
``p = past_seqlens[b] + i`` and lives in page ``block_table[b, p // block_size]`` at offset
``p % block_size`` (flat slot ``page * block_size + offset``).

Algorithm (the reference computes in float32, float64 for float64 inputs):

1. Split Q/K/V (``key``/``value`` absent = packed ``[Q | K | V]`` query rows).
2. ``q_norm_weight``/``k_norm_weight``: RMSNorm over each head's ``head_size`` channels with
   ``qk_norm_epsilon``, weight applied as a plain gain ``x / rms(x) * w`` (ORT's simplified
   LayerNorm), BEFORE RoPE; K is normed before its cache write.
3. ``do_rotary=1``: RoPE with ``cos_cache``/``sin_cache`` ``[max_pos, rotary_dim/2]`` rows at the
   token's absolute position ``p``, on channels ``[rotary_offset, rotary_offset + rotary_dim)``;
   ``rotary_interleaved=0`` rotates halves (x1 = first half, x2 = second half), ``=1`` rotates
   adjacent pairs (2i, 2i+1).
4. Write K/V into the pages in the cache element type at the slot derived above, or at
   ``slot_mapping[t]`` when given (``-1`` = no write); a quantized cache (int8 / float8e4m3fn)
   stores ``quantize(x, k_scale | v_scale)`` (``pagedhybrid.kvquant``: ORT's reciprocal
   multiply, round half to even, saturation).
5. Attention, reading EVERY key/value (this step's too) back from the pages through
   ``block_table`` after the write, as ORT's kernels do: query head ``h`` reads kv head
   ``h // (num_heads / kv_num_heads)``; logits ``scale * q.k`` (``scale=0`` means
   ``1/sqrt(head_size)``), then ``softcap * tanh(logit / softcap)`` when ``softcap > 0``.
   A query at position ``p`` of a sequence with ``past + new = L`` tokens sees keys ``j``
   with ``j <= p`` (``is_causal=1``) or ``j < L`` (``is_causal=0``: bidirectional within the
   step's block, all history visible), and, when ``local_window_size = w > 0``, only
   ``j >= p - w`` (w + 1 keys including itself: flash-attention's ``window_size_left``, as in
   ORT's CPU GroupQueryAttention and the CUDA PagedAttention tests; ORT's WebGPU kernel keeps
   only w keys, see ``kernels/onnxruntime/paged_attention.py``). With ``is_causal=0`` the
   window bounds the left side only. ``head_sink[h]`` is an extra raw (unscaled, uncapped)
   logit that enters only the softmax denominator. Quantized pages are read as
   ``float32(q) * scale``.
6. Output ``[num_tokens, num_heads*head_size]`` in the query's element type.

Caches are updated IN PLACE and also returned. ``token_count == 0`` returns an empty output and
leaves the caches untouched. ``attention_metadata`` bounds are validated (an underestimate is a
ContractViolation) but never change the result.

pagedhybrid extension: ``float`` (float32) and ``double`` inputs/caches are accepted besides
ORT's float16/bfloat16. Sub-byte (int4 / float4e2m1) caches and ``kv_cache_layout='LATENT'``
raise UnsupportedConfiguration.

Calling convention: ``paged_attention`` takes ``SPEC.signature()`` (the 17 inputs in ORT order,
then the 16 attributes keyword-only); it is the reference's entry point registered with
``SPEC.implement``, so it runs ``reference`` on ``validate_call(SPEC.bind(...))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedhybrid.kvquant import dequantize, is_quantized, quantize
from pagedhybrid.ops._paged_attention_contract import (
    INPUT_NAMES,
    SPEC,
    PagedAttentionDims,
    output_shapes,
    validate,
    validate_call,
)
from pagedhybrid.ops._paged_attention_recipes import conformance_recipes, make_inputs
from pagedhybrid.ops.spec import BoundCall

__all__ = [
    "INPUT_NAMES",
    "SPEC",
    "PagedAttentionDims",
    "conformance_recipes",
    "make_inputs",
    "output_shapes",
    "paged_attention",
    "reference",
    "validate",
    "validate_call",
]


@SPEC.implement("reference")
def paged_attention(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference PagedAttention; returns ``(output, key_cache, value_cache)``.

    The caches are updated in place (the returned caches are the same tensors). Inputs may be
    float16/bfloat16 (ORT's types) or float32/float64 (pagedhybrid extension).
    """
    return reference(call.inputs, validate_call(call))


# -- reference ----------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with a plain gain ``w``.  x: [N, H, D], w: [D]."""
    rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)  # [N, H, 1]
    return x / rms * w.to(x.dtype)  # [N, H, D]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          offset: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """Rotate channels [offset, offset+rotary_dim) of x [N, H, D] at ``positions`` [N]."""
    c = cos[positions].to(x.dtype)[:, None, :]  # [N, 1, R/2]
    s = sin[positions].to(x.dtype)[:, None, :]  # [N, 1, R/2]
    out = x.clone()
    rot = x[..., offset: offset + rotary_dim]  # [N, H, R]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # [N, H, R/2] each
        out[..., offset: offset + rotary_dim: 2] = x1 * c - x2 * s
        out[..., offset + 1: offset + rotary_dim: 2] = x2 * c + x1 * s
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]  # [N, H, R/2] each
        out[..., offset: offset + half] = x1 * c - x2 * s
        out[..., offset + half: offset + rotary_dim] = x2 * c + x1 * s
    return out


def reference(inputs: Sequence[torch.Tensor | None],
              dims: PagedAttentionDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference on already-validated inputs (``dims = validate_call(call)``)."""
    (query, key, value, key_cache, value_cache, _cu, _past, block_table, cos, sin, _slots,
     head_sink, q_norm, k_norm, k_scale, v_scale, _meta) = inputs
    assert query is not None and key_cache is not None and value_cache is not None
    n, hq, d = dims.num_tokens, dims.num_heads, dims.head_size
    cdt = torch.float64 if dims.dtype == torch.float64 else torch.float32
    if n == 0:
        return query.new_zeros((0, hq * d)), key_cache, value_cache

    # 1. split
    q, k, v = _split_qkv(query, key, value, dims, cdt)

    # 2. q/k RMSNorm, 3. RoPE at absolute positions
    q, k = _norm_and_rope(q, k, q_norm, k_norm, cos, sin, dims, cdt)

    # 4. write this step's K/V into the pages (in the cache's element type)
    quant = is_quantized(key_cache.dtype)
    _write_pages(k, v, key_cache, value_cache, k_scale, v_scale, quant, dims)

    # 5. attention per sequence, K/V read back from the pages
    out = _attend(q, key_cache, value_cache, k_scale, v_scale, block_table, head_sink, quant,
                  dims, cdt)

    # 6. back to the query dtype
    return out.reshape(n, hq * d).to(query.dtype), key_cache, value_cache


def _split_qkv(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               dims: PagedAttentionDims,
               cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: Q/K/V in ``cdt`` as ``[N, Hq, D]``, ``[N, Hkv, D]``, ``[N, Hkv, D]`` (packed
    ``[Q | K | V]`` query rows when key/value are absent)."""
    n, hq, hkv, d = dims.num_tokens, dims.num_heads, dims.kv_num_heads, dims.head_size
    if dims.packed_qkv:
        qkv = query.to(cdt)
        q_flat, k_flat, v_flat = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    else:
        assert key is not None and value is not None
        q_flat, k_flat, v_flat = query.to(cdt), key.to(cdt), value.to(cdt)
    q = q_flat.reshape(n, hq, d)  # [N, Hq, D]
    k = k_flat.reshape(n, hkv, d)  # [N, Hkv, D]
    v = v_flat.reshape(n, hkv, d)  # [N, Hkv, D]
    return q, k, v


def _norm_and_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, dims: PagedAttentionDims,
                   cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3: q/k RMSNorm, then RoPE at each token's absolute position."""
    a = dims.attrs
    if q_norm is not None:
        assert k_norm is not None
        q = _rms_norm(q, q_norm.to(cdt), a["qk_norm_epsilon"])
        k = _rms_norm(k, k_norm.to(cdt), a["qk_norm_epsilon"])
    positions = torch.tensor([dims.past_lens[b] + i for b in range(dims.batch)
                              for i in range(dims.q_lens[b])], dtype=torch.long)  # [N]
    if a["do_rotary"]:
        assert cos is not None and sin is not None
        args = (cos.to(cdt), sin.to(cdt), positions, a["rotary_offset"], dims.rotary_dim,
                bool(a["rotary_interleaved"]))
        q, k = _rope(q, *args), _rope(k, *args)
    return q, k


def _write_pages(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, quant: bool, dims: PagedAttentionDims) -> None:
    """Step 4: this step's K/V into the pages at ``dims.write_slots`` (in place), quantized
    for a quantized cache."""
    bs = dims.block_size
    if quant:
        assert k_scale is not None and v_scale is not None
        k_store, v_store = quantize(k, k_scale, key_cache.dtype), quantize(v, v_scale,
                                                                           key_cache.dtype)
    else:
        k_store, v_store = k.to(key_cache.dtype), v.to(value_cache.dtype)
    for t, slot in enumerate(dims.write_slots):
        if slot >= 0:
            key_cache[slot // bs, slot % bs] = k_store[t]
            value_cache[slot // bs, slot % bs] = v_store[t]


def _read_pages(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor,
                offs: torch.Tensor, quant: bool, cdt: torch.dtype) -> torch.Tensor:
    """The cache rows at ``(pages, offs)`` as ``[L, Hkv, D]`` in ``cdt`` (dequantized)."""
    rows = cache[pages, offs]
    return dequantize(rows, scale, cdt) if quant and scale is not None else rows.to(cdt)


def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_table: torch.Tensor,
            head_sink: torch.Tensor | None, quant: bool, dims: PagedAttentionDims,
            cdt: torch.dtype) -> torch.Tensor:
    """Step 5: attention per sequence, K/V read back from the pages; returns ``[N, Hq, D]``."""
    a = dims.attrs
    n, hq, hkv, d, bs = (dims.num_tokens, dims.num_heads, dims.kv_num_heads, dims.head_size,
                         dims.block_size)
    out = torch.zeros(n, hq, d, dtype=cdt)  # [N, Hq, D]
    group = hq // hkv
    table = block_table.to(torch.long)
    window = a["local_window_size"]
    sink = head_sink.to(cdt) if head_sink is not None else None  # [Hq]
    for b in range(dims.batch):
        q_len, past, start = dims.q_lens[b], dims.past_lens[b], dims.cu_seqlens[b]
        if q_len == 0:
            continue
        total = past + q_len
        kv_pos = torch.arange(total)  # [L]
        pages, offs = table[b, kv_pos // bs], kv_pos % bs  # [L], [L]
        kb = _read_pages(key_cache, k_scale, pages, offs, quant, cdt).repeat_interleave(
            group, dim=1)  # [L, Hq, D]
        vb = _read_pages(value_cache, v_scale, pages, offs, quant, cdt).repeat_interleave(
            group, dim=1)
        qb = q[start: start + q_len]  # [Q, Hq, D]
        logits = dims.scale * torch.einsum("qhd,lhd->hql", qb, kb)  # [Hq, Q, L]
        if a["softcap"] > 0:
            logits = a["softcap"] * torch.tanh(logits / a["softcap"])
        q_pos = past + torch.arange(q_len)[:, None]  # [Q, 1]
        visible = kv_pos[None, :] <= q_pos if a["is_causal"] else kv_pos[None, :] < total
        if window > 0:
            visible = visible & (kv_pos[None, :] >= q_pos - window)  # [Q, L]
        logits = logits.masked_fill(~visible[None], float("-inf"))  # [Hq, Q, L]
        m = logits.amax(dim=-1, keepdim=True)  # [Hq, Q, 1]
        if sink is not None:
            m = torch.maximum(m, sink[:, None, None])
        e = torch.exp(logits - m)  # [Hq, Q, L]
        denom = e.sum(dim=-1, keepdim=True)  # [Hq, Q, 1]
        if sink is not None:
            denom = denom + torch.exp(sink[:, None, None] - m)
        probs = e / denom  # [Hq, Q, L]
        out[start: start + q_len] = torch.einsum("hql,lhd->qhd", probs, vb)  # [Q, Hq, D]
    return out
