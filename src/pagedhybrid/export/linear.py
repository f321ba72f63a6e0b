"""Gated DeltaNet layer of the packed graph: ``VarlenCausalConvWithState`` then the packed
``com.microsoft.GatedDeltaNet`` with the kernel's Qwen gate arithmetic.

Per layer ``i`` (``Hk``/``Hv`` key/value heads of ``Dk``/``Dv``, ``conv_dim = 2·Hk·Dk + Hv·Dv``):

1. ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`` as one MatMul, split: ``[N, conv_dim]``,
   ``z [N, Hv, Dv]``, ``b`` and ``a [N, Hv]`` (cast to float32 and passed **raw**).
2. ``VarlenCausalConvWithState(qkv, conv1d.weight [conv_dim, 1, K], cumulative_sequence_lengths,
   zero bias (as the genai builder writes it; CPU also accepts an empty slot),
   past_key_values.i.conv_state [B, conv_dim, K-1]; activation=silu)`` ->
   ``[N, conv_dim]``, ``present.i.conv_state``.
3. Split ``[2·Hk·Dk, Hv·Dv]``; the q and k heads ``[N, 2·Hk, Dk]`` are L2-normalised per head
   in one pass as HF does, ``x * 1/sqrt(sum(x^2) + 1e-6)`` in float32
   (``GraphBuilder.l2_normalize``; the op's own ``qk_l2_norm=1`` uses eps 1e-12), then split
   into ``q, k [N, Hk, Dk]``; ``v [N, Hv, Dv]``. As in
   the torch model, q, k and v enter the op in float32 (no rounding of the normalised q/k back to
   the activation type) and its output is cast back before the norm.
4. ``GatedDeltaNet(q, k, v, cumulative_sequence_lengths, a, b,
   past_key_values.i.recurrent_state float [B, Hv, Dv, Dk] (V-major, the op's own layout),
   A_log float [Hv], dt_bias float [Hv]; gate_activation=qwen, beta_activation=sigmoid,
   qk_l2_norm=0, update_rule=gated_delta, scale=0)``: the kernel computes
   ``g = -exp(A_log)·softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` itself, so the graph does
   not (no transformed gates).
5. ``GatedRMSNorm(core, norm.weight (raw), z; activation=silu, epsilon=rms_norm_eps)`` ->
   ``[N, Hv·Dv]`` -> ``out_proj``.

With ``--state-update-capacity C`` both ops also take ``state_update_capture_count`` (and
GatedDeltaNet ``state_update_active``) and return their compact state updates as
``state_update.i.conv_value`` / ``state_update.i.recurrent_capsule`` (``emit_gated_delta_net``).
"""

from __future__ import annotations

import onnx_ir as ir

from pagedhybrid.export import constants as c
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.linear_attention import QK_L2_NORM_EPS


def emit_gated_delta_net(b: GraphBuilder, config: Qwen35Config, i: int, x: ir.Value,
                         cu_seqlens: ir.Value, past_conv: ir.Value, past_recurrent: ir.Value,
                         capture: tuple[ir.Value, ir.Value, int] | None = None) -> ir.Value:
    """``x[N, hidden]`` (normalised) -> ``[N, hidden]``; emits ``present.i.conv_state`` and
    ``present.i.recurrent_state``; with ``capture`` (the graph's capture count and active flag,
    and the capacity) also ``state_update.i.conv_value`` and ``state_update.i.recurrent_capsule``
    (both ops' compact state updates, ``state_update_capacity`` set on both nodes; the conv has
    no ``state_update_active`` input: ONNX Runtime's conv captures whenever it has a capacity)."""
    extra_in: list[ir.Value] = []
    cap_attr: dict[str, int] = {}
    conv_out: list[str | None] = [None, c.PRESENT_CONV % i]
    gdn_out: list[str | None] = [None, c.PRESENT_RECURRENT % i]
    if capture is not None:
        count, active, capacity = capture
        extra_in, cap_attr = [count, active], {"state_update_capacity": capacity}
        conv_out.append(c.STATE_UPDATE_CONV % i)
        gdn_out.append(c.STATE_UPDATE_RECURRENT % i)
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
    mixed = b.op(
        c.VARLEN_CONV,
        [qkv, b.weight(f"{w}.conv1d.weight"), cu_seqlens, bias, past_conv, *extra_in[:1]],
        f"{p}/{c.VARLEN_CONV}", {"activation": "silu", **cap_attr}, domain=c.MS_DOMAIN,
        outputs=conv_out)[0]  # [N, conv_dim] (present conv, conv values)
    qk, v = b.op("Split", [mixed, b.const_i64([2 * hk * dk, hv * dv])], f"{p}/SplitQKV",
                 {"axis": 1}, outputs=2)  # [N, 2*Hk*Dk], [N, Hv*Dv]
    qk = b.l2_normalize(b.reshape(qk, [0, 2 * hk, dk], f"{p}/qk/Reshape"), QK_L2_NORM_EPS,
                        f"{p}/qk/L2Norm")  # float [N, 2*Hk, Dk], q heads then k heads
    q, k = b.op("Split", [qk, b.const_i64([hk, hk])], f"{p}/qk/Split", {"axis": 1},
                outputs=2)  # float [N, Hk, Dk] x2
    v = b.reshape(v, [0, hv, dv], f"{p}/v/Reshape")  # [N, Hv, Dv]
    if b.io_dtype != "float":
        v = b.cast(v, "float", f"{p}/v/Cast")  # float [N, Hv, Dv]
    core = b.op(
        c.GATED_DELTA_NET,
        [q, k, v, cu_seqlens, decay, beta, past_recurrent, b.weight(f"{w}.A_log"),
         b.weight(f"{w}.dt_bias"), *extra_in],
        f"{p}/{c.GATED_DELTA_NET}",
        {"update_rule": "gated_delta", "gate_activation": "qwen", "beta_activation": "sigmoid",
         "qk_l2_norm": 0, "scale": 0.0, **cap_attr},
        domain=c.MS_DOMAIN, outputs=gdn_out,
    )[0]  # float [N, Hv, Dv] (present recurrent float [B, Hv, Dv, Dk], capsule)
    if b.io_dtype != "float":
        core = b.cast(core, b.io_dtype, f"{p}/{c.GATED_DELTA_NET}/Cast")  # [N, Hv, Dv]
    y = b.op1("GatedRMSNorm", [core, b.weight(f"{w}.norm.weight"), z], f"{p}/norm/GatedRMSNorm",
              {"activation": "silu", "epsilon": float(config.rms_norm_eps)},
              domain=c.MS_DOMAIN)  # [N, Hv, Dv]
    y = b.reshape(y, [0, hv * dv], f"{p}/norm/Reshape")  # [N, Hv*Dv]
    return b.matmul(y, f"{w}.out_proj.weight", f"{p}/out_proj")  # [N, hidden]
