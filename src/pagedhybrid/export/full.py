"""Full-attention layer of the packed graph: projections, norms and MRoPE outside the op, then
``com.microsoft.PagedAttention`` with SEPARATE page caches.

Per layer ``i`` (``N`` packed tokens, ``H`` query / ``Hkv`` KV heads of ``hd``):

1. ``q_proj | k_proj | v_proj`` as one MatMul, split; q -> ``[N, H, 2·hd]``, split per head into
   query | gate (HF ``view(..., 2·hd).chunk(2)``); k -> ``[N, Hkv, hd]``; v ``[N, Hkv·hd]``.
2. OffsetRMSNorm ``q_norm`` / ``k_norm`` per head (``SimplifiedLayerNormalization``, gain
   ``1 + w``), then interleaved partial MRoPE in float32: ``x·cos + (x @ R)·sin`` with per-channel
   cos/sin ``[N, 1, hd]`` computed once per graph (``rope_tables``; channels past ``rotary_dim``
   have cos 1, sin 0) and the constant rotate-half matrix ``R``. Norm before RoPE; the op's fused
   q/k-norm inputs stay empty so nothing is normalised twice.
3. ``PagedAttention`` (17 inputs: 0-7 ``q, k, v, past_key_values.i.key, .value,
   cumulative_sequence_lengths, past_sequence_lengths, block_table``, 8-13 empty, 14-15 empty or,
   with int8 / float8e4m3fn pages, the layer's calibrated ``k_scale`` / ``v_scale`` initializers
   (float ``[1]`` or ``[Hkv, 1, hd]``) with ``k_quant_type`` / ``v_quant_type`` PER_TENSOR |
   PER_CHANNEL (the cache type comes from the page buffers, as genai's builder does it), 16
   ``attention_metadata``; ``kv_cache_layout=SEPARATE``, ``do_rotary=0``, ``scale`` default
   ``1/sqrt(hd)``); outputs ``[N, H·hd]``, ``present.i.key``, ``present.i.value`` (aliases).
4. ``o_proj(attn · Sigmoid(gate))``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from pagedhybrid.export import constants as c
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.kvquant import KVScales, per_tensor
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.rope import inv_freq, mrope_plane_index


class RopeTables(NamedTuple):
    cos: ir.Value  # float [N, 1, hd]: cos of each channel's angle, 1 past rotary_dim
    sin: ir.Value  # float [N, 1, hd]: sin of each channel's angle, 0 past rotary_dim
    rotate_half: ir.Value  # float [hd, hd]: x @ R = [-x2, x1, 0] on the rotary channels


class PagedInputs(NamedTuple):
    cu_seqlens: ir.Value
    past_seqlens: ir.Value
    block_table: ir.Value
    attention_metadata: ir.Value


def rope_tables(b: GraphBuilder, config: Qwen35Config, position_ids: ir.Value) -> RopeTables:
    """Per-channel interleaved MRoPE angles over the whole head.

    Channel ``j < rotary_dim`` uses frequency ``j mod rd/2`` and the position plane
    ``mrope_plane_index`` of that frequency; channels ``>= rotary_dim`` get frequency 0
    (cos 1, sin 0), so one ``x·cos + (x @ R)·sin`` rotates the first ``rotary_dim`` channels and
    passes the rest through exactly.
    """
    p = "/model/rotary_emb"
    hd, rd = config.head_dim, config.rotary_dim
    pad = hd - rd
    planes = mrope_plane_index(config).tolist()
    plane = b.const_i64(planes + planes + [0] * pad)  # [hd]
    freq = inv_freq(config).numpy()
    freq = np.concatenate([freq, freq, np.zeros(pad, np.float32)])  # [hd]
    pos = b.op1("Gather", [position_ids, plane], f"{p}/GatherPlane", {"axis": 0})  # [hd, N]
    pos = b.op1("Transpose", [b.cast(pos, "float", f"{p}/Cast")], f"{p}/Transpose",
                {"perm": [1, 0]})  # [N, hd]
    angle = b.op1("Mul", [pos, b.const_f32("model.rotary_emb.channel_freq", freq)],
                  f"{p}/Mul")  # [N, hd]
    axes = b.const_i64([1])
    cos = b.op1("Unsqueeze", [b.op1("Cos", [angle], f"{p}/Cos"), axes], f"{p}/UnsqueezeCos")
    sin = b.op1("Unsqueeze", [b.op1("Sin", [angle], f"{p}/Sin"), axes], f"{p}/UnsqueezeSin")
    half = rd // 2
    rot = np.zeros((hd, hd), np.float32)  # out[:, i] = sum_j x[:, j] * rot[j, i]
    for i in range(half):
        rot[i + half, i] = -1.0  # out[i] = -x[i + rd/2]
        rot[i, i + half] = 1.0  # out[i + rd/2] = x[i]
    return RopeTables(cos, sin, b.const_f32("model.rotary_emb.rotate_half", rot))


def apply_rope(b: GraphBuilder, x: ir.Value, rope: RopeTables, name: str) -> ir.Value:
    """Rotate-half partial RoPE on ``x[N, h, hd]`` in float32 (HF ``apply_rotary_pos_emb``)."""
    xf = b.cast(x, "float", f"{name}/Cast")  # [N, h, hd]
    turned = b.op1("MatMul", [xf, rope.rotate_half], f"{name}/RotateHalf")  # [N, h, hd]
    out = b.op1("Add", [b.op1("Mul", [xf, rope.cos], f"{name}/MulCos"),
                        b.op1("Mul", [turned, rope.sin], f"{name}/MulSin")], f"{name}/Add")
    return b.cast(out, b.io_dtype, f"{name}/CastBack")  # [N, h, hd]


def emit_full_attention(b: GraphBuilder, config: Qwen35Config, i: int, x: ir.Value,
                        rope: RopeTables, paged: PagedInputs, past_key: ir.Value,
                        past_value: ir.Value, scales: KVScales | None = None,
                        layer: str | None = None) -> ir.Value:
    """``x[N, hidden]`` (normalised) -> ``[N, hidden]``; emits ``present.i.key/.value``. The
    weights are those of checkpoint layer ``layer`` (default ``model.layers.{i}``; the MTP
    head's ``mtp.layers.0``)."""
    h, hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = layer or f"model.layers.{i}"
    p = f"/model/layers.{i}/attn" if layer == f"model.layers.{i}" else f"/{layer}/attn"
    w = f"{layer}.self_attn"
    qg, k, v = b.fused_matmul(
        x, f"{w}.qkv_proj.weight", [f"{w}.{n}_proj.weight" for n in "qkv"],
        [2 * h * hd, hkv * hd, hkv * hd], f"{p}/qkv_proj")  # [N, 2*H*hd], [N, Hkv*hd] x2
    qg = b.reshape(qg, [0, h, 2 * hd], f"{p}/q_proj/Reshape")  # [N, H, 2*hd]
    query, gate = b.op("Split", [qg, b.const_i64([hd, hd])], f"{p}/SplitQueryGate",
                       {"axis": 2}, outputs=2)  # [N, H, hd] x2
    gate = b.reshape(gate, [0, h * hd], f"{p}/gate/Reshape")  # [N, H*hd]
    k = b.reshape(k, [0, hkv, hd], f"{p}/k_proj/Reshape")  # [N, Hkv, hd]
    q = b.offset_rms_norm(query, f"{w}.q_norm.weight", config.rms_norm_eps, f"{p}/q_norm")
    k = b.offset_rms_norm(k, f"{w}.k_norm.weight", config.rms_norm_eps, f"{p}/k_norm")
    q = apply_rope(b, q, rope, f"{p}/q_rotary")  # [N, H, hd]
    k = apply_rope(b, k, rope, f"{p}/k_rotary")  # [N, Hkv, hd]
    q = b.reshape(q, [0, h * hd], f"{p}/q/Reshape")  # [N, H*hd]
    k = b.reshape(k, [0, hkv * hd], f"{p}/k/Reshape")  # [N, Hkv*hd]
    operands: list[ir.Value | None] = [
        q, k, v, past_key, past_value, paged.cu_seqlens, paged.past_seqlens, paged.block_table,
    ]
    operands += [None] * len(c.PAGED_ATTENTION_EMPTY)
    attrs: dict[str, object] = {"num_heads": h, "kv_num_heads": hkv,
                                "kv_cache_layout": "SEPARATE", "do_rotary": 0}
    if scales is None:
        operands += [None, None]
    else:
        operands += [b.const_f32(c.K_SCALE % i, scales.k.numpy()),
                     b.const_f32(c.V_SCALE % i, scales.v.numpy())]
        quant = "PER_TENSOR" if per_tensor(scales) else "PER_CHANNEL"
        attrs |= {"k_quant_type": quant, "v_quant_type": quant}
    operands.append(paged.attention_metadata)
    attn, _, _ = b.op(
        c.PAGED_ATTENTION, operands, f"{p}/{c.PAGED_ATTENTION}", attrs,
        domain=c.MS_DOMAIN, outputs=[None, c.PRESENT_KEY % i, c.PRESENT_VALUE % i],
    )  # [N, H*hd], present key/value
    gated = b.op1("Mul", [attn, b.op1("Sigmoid", [gate], f"{p}/gate/Sigmoid")], f"{p}/gate/Mul")
    return b.matmul(gated, f"{w}.o_proj.weight", f"{p}/o_proj")  # [N, hidden]
