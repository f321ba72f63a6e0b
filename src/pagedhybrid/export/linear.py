"""Gated DeltaNet layer of the packed graph: ``VarlenCausalConvWithState`` then the packed
``com.microsoft.GatedDeltaNet`` with the kernel's Qwen gate arithmetic.

Per layer ``i`` (``Hk``/``Hv`` key/value heads of ``Dk``/``Dv``, ``conv_dim = 2·Hk·Dk + Hv·Dv``):

1. ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` as one MatMul, split: ``[N, conv_dim]``,
   ``z [N, Hv, Dv]``, ``b`` and ``a [N, Hv]`` (cast to float32 and passed **raw**).
2. ``VarlenCausalConvWithState(qkv, conv1d.weight [conv_dim, 1, K], cumulative_sequence_lengths,
   zero bias (as the genai builder writes it; CPU also accepts an empty slot),
   past_key_values.i.conv_state [B, conv_dim, K-1]; activation=silu)`` ->
   ``[N, conv_dim]``, ``present.i.conv_state``.
3. Split ``[Hk·Dk, Hk·Dk, Hv·Dv]`` -> ``q, k [N, Hk, Dk]``, ``v [N, Hv, Dv]``.
4. ``GatedDeltaNet(q, k, v, cumulative_sequence_lengths, a, b,
   past_key_values.i.recurrent_state float [B, Hv, Dv, Dk] (V-major, the op's own layout),
   A_log float [Hv], dt_bias float [Hv]; gate_activation=qwen, beta_activation=sigmoid,
   qk_l2_norm=1, update_rule=gated_delta, scale=0)``: the kernel computes
   ``g = -exp(A_log)·softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` itself, so the graph does
   not (no transformed gates).
5. ``GatedRMSNorm(core, norm.weight (raw), z; activation=silu, epsilon=rms_norm_eps)`` ->
   ``[N, Hv·Dv]`` -> ``out_proj``.
"""

from __future__ import annotations

import onnx_ir as ir

from pagedhybrid.export import constants as c
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.models.qwen35.config import Qwen35Config


def emit_gated_delta_net(b: GraphBuilder, config: Qwen35Config, i: int, x: ir.Value,
                         cu_seqlens: ir.Value, past_conv: ir.Value,
                         past_recurrent: ir.Value) -> ir.Value:
    """``x[N, hidden]`` (normalised) -> ``[N, hidden]``; emits ``present.i.conv_state`` and
    ``present.i.recurrent_state``."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    p, w = f"/model/layers.{i}/linear_attn", f"model.layers.{i}.linear_attn"
    qkv, z, beta, decay = b.fused_matmul(
        x, f"{w}.in_proj_qkvzba.weight",
        [f"{w}.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")],
        [config.conv_dim, hv * dv, hv, hv], f"{p}/in_proj")  # [N, conv_dim], [N, Hv*Dv], [N, Hv] x2
    z = b.reshape(z, [0, hv, dv], f"{p}/in_proj_z/Reshape")  # [N, Hv, Dv]
    beta = b.cast(beta, "float", f"{p}/in_proj_b/Cast")  # [N, Hv] raw b
    decay = b.cast(decay, "float", f"{p}/in_proj_a/Cast")  # [N, Hv] raw a
    bias = b.zeros(f"{w}.conv1d.bias", config.conv_dim)  # Qwen3.5's conv has no bias
    mixed, _ = b.op(
        c.VARLEN_CONV, [qkv, b.weight(f"{w}.conv1d.weight"), cu_seqlens, bias, past_conv],
        f"{p}/{c.VARLEN_CONV}", {"activation": "silu"}, domain=c.MS_DOMAIN,
        outputs=[None, c.PRESENT_CONV % i])  # [N, conv_dim], present conv
    q, k, v = b.op("Split", [mixed, b.const_i64([hk * dk, hk * dk, hv * dv])], f"{p}/SplitQKV",
                   {"axis": 1}, outputs=3)
    q = b.reshape(q, [0, hk, dk], f"{p}/q/Reshape")  # [N, Hk, Dk]
    k = b.reshape(k, [0, hk, dk], f"{p}/k/Reshape")  # [N, Hk, Dk]
    v = b.reshape(v, [0, hv, dv], f"{p}/v/Reshape")  # [N, Hv, Dv]
    core, _ = b.op(
        c.GATED_DELTA_NET,
        [q, k, v, cu_seqlens, decay, beta, past_recurrent, b.weight(f"{w}.A_log"),
         b.weight(f"{w}.dt_bias")],
        f"{p}/{c.GATED_DELTA_NET}",
        {"update_rule": "gated_delta", "gate_activation": "qwen", "beta_activation": "sigmoid",
         "qk_l2_norm": 1, "scale": 0.0},
        domain=c.MS_DOMAIN, outputs=[None, c.PRESENT_RECURRENT % i],
    )  # [N, Hv, Dv], present recurrent (float [B, Hv, Dv, Dk])
    y = b.op1("GatedRMSNorm", [core, b.weight(f"{w}.norm.weight"), z], f"{p}/norm/GatedRMSNorm",
              {"activation": "silu", "epsilon": float(config.rms_norm_eps)},
              domain=c.MS_DOMAIN)  # [N, Hv, Dv]
    y = b.reshape(y, [0, hv * dv], f"{p}/norm/Reshape")  # [N, Hv*Dv]
    return b.matmul(y, f"{w}.out_proj.weight", f"{p}/out_proj/MatMul")  # [N, hidden]
