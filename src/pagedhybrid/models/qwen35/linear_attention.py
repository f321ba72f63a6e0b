"""Gated DeltaNet layer of Qwen3.5 (HF ``Qwen3_5GatedDeltaNet``), one path for dense and packed.

Tokens come packed ``x[T, hidden]`` with ``cu_seqlens int32[B+1]`` (the dense path packs its
``B`` rows of ``S`` tokens as ``B`` sequences). Per layer:

1. ``qkv = in_proj_qkv(x)`` ``[T, conv_dim]``, ``z = in_proj_z(x)`` ``[T, Hv·Dv]``,
   ``b = in_proj_b(x)``, ``a = in_proj_a(x)`` ``[T, Hv]``.
2. Depthwise causal conv + SiLU over time per sequence, ``VarlenCausalConvWithState`` (no bias),
   carrying the last ``K-1`` inputs per channel: conv state ``[B, conv_dim, K-1]``.
3. Split ``[Hk·Dk, Hk·Dk, Hv·Dv]`` -> ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``.
4. Per-head L2 norm of q and k exactly as HF (and flash-linear-attention): in fp32,
   ``x * rsqrt(sum(x^2) + 1e-6)`` (the bundle's ``norms.l2``). The op contract's own
   ``qk_l2_norm=1`` is ONNX Runtime's (eps 1e-12), which drifts from HF when q/k are small, so
   the model normalises outside the op and calls it with ``qk_l2_norm=0``; q, k and v reach the
   op in fp32, as HF's rule casts them (lossless for v).
5. ``GatedDeltaNet`` (``gate_activation=qwen``: ``g = -exp(A_log)·softplus(a + dt_bias)`` in fp32;
   ``beta = sigmoid(b)``; scale ``Dk^-0.5``; value head ``hv`` reads key head ``hv // (Hv/Hk)``)
   with the fp32 recurrent state ``[B, Hv, Dv, Dk]`` (V-major). ``a`` and ``b`` are passed raw in
   fp32, ``A_log``/``dt_bias`` are fp32 parameters; the output is cast back to the model dtype.
6. Gated RMSNorm per value head with the raw weight, ``silu(z)`` gate; ``out_proj``.

The layer's program (``kernels/layer_spec.py``) runs them: ``project`` (1), ``gdn_mixer``
(``mix``: 2-6 before ``out_proj``) and ``project`` (``out_proj``).

Tensor parallelism (``ParallelConfig``, world size ``W``): a rank owns contiguous value heads
``[r·Hv/W, +Hv/W)`` and the key heads they read, ``[r·Hk/W, +Hk/W)`` (when ``Hk < W`` and
``W % Hk == 0``: the one key head ``r·Hk // W``, replicated), which keeps ``hv // (Hv/Hk)``
locally. ``in_proj_qkv`` and the depthwise ``conv1d`` hold the rank's rows of each of the
``[q | k | v]`` segments (a merged column-parallel split); ``in_proj_z``, ``in_proj_a``,
``in_proj_b``, ``A_log`` and ``dt_bias`` the rank's value heads; ``out_proj`` is row-parallel
over the value heads (partial sums all-reduced). The gated norm (per ``Dv``) is replicated. The
layer's conv channels and recurrent heads, hence its state pools, are the rank's.

Both operators run through the backend's step seam (``kernels.backend.Backend``: ``causal_conv``
and ``gated_delta`` on the step's ``StepMetadata``), which read and write this layer's rows of
the conv and recurrent state pools in place. A bundle with ``fused.mixer`` (the native one) runs
steps 2-6 up to ``out_proj`` of a decode-only step in one call, computing every bit as the
seam's kernels and its norms do one after the other (tests/kernels/test_native_cpu_forms.py,
``test_fused_gdn_decode_mixer_equals_the_separate_ops``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedhybrid.kernels import capsule as capsules
from pagedhybrid.kernels.backend import Backend
from pagedhybrid.kernels.capsule import Capsule
from pagedhybrid.kernels.registry import UsesKernels
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.layers import GatedRMSNorm
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    RowParallelLinear,
    Segment,
    shard_weight,
)

QK_L2_NORM_EPS = 1e-6  # HF ``l2norm`` / flash-linear-attention


class GatedDeltaNet(nn.Module, UsesKernels):  # its kernels' L2 norm of q / k

    def __init__(self, config: Qwen35Config, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        q = Segment(hk * dk, hk, "linear_num_key_heads", shared=True)  # also k
        v = Segment(hv * dv, hv, "linear_num_value_heads")
        per_head = Segment(hv, hv, v.field)  # one row per value head
        self.num_k_heads = parallel.local(hk, q.field, shared=True)
        self.num_v_heads = parallel.local(hv, v.field)
        self.head_k_dim, self.head_v_dim = dk, dv
        self.key_dim, self.value_dim = self.num_k_heads * dk, self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj_qkv = ColumnParallelLinear(hidden, (q, q, v), dtype, parallel)
        self.in_proj_z = ColumnParallelLinear(hidden, v, dtype, parallel)
        self.in_proj_b = ColumnParallelLinear(hidden, per_head, dtype, parallel)
        self.in_proj_a = ColumnParallelLinear(hidden, per_head, dtype, parallel)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=False, padding=self.kernel - 1, dtype=dtype)
        self.conv1d.weight.requires_grad_(False)  # [conv_dim, 1, K], weight holder only
        shard_weight(self.conv1d.weight, 0, (q, q, v), parallel)
        # Gate parameters stay fp32 whatever the model dtype (exp overflows in fp16).
        self.dt_bias = shard_weight(
            nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32),
                         requires_grad=False), 0, (per_head,), parallel)
        self.A_log = shard_weight(
            nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32),
                         requires_grad=False), 0, (per_head,), parallel)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(v, hidden, dtype, parallel)

    def mix(
        self,
        qkv: torch.Tensor,
        z: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        meta: StepMetadata,
        conv_pool: torch.Tensor,
        recurrent_pool: torch.Tensor,
        backend: Backend,
        checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
        capsule: Capsule | None = None,
    ) -> torch.Tensor:
        """The program's ``gdn_mixer`` (steps 2-6 before ``out_proj``): the projections'
        outputs ``qkv [T, conv_dim]``, ``z [T, Hv·Dv]``, ``a``, ``b [T, Hv]`` -> ``y [T,
        Hv·Dv]``; rows ``meta.state_slots`` of the conv pool ``[S, conv_dim, K-1]`` and the
        fp32 recurrent pool ``[S, Hv, Dv, Dk]`` advance in place (fresh sequences start from
        zero state); ``checkpoints`` -- this layer's (conv, recurrent) checkpoint pools, written
        where ``meta.checkpoints`` asks; ``capsule`` -- this layer's verify-step capsules: the
        rows of ``meta.verify`` sequences stay as they were and their compact state updates go
        there (``kernels/capsule.py``)."""
        ck_conv, ck_rec = checkpoints if checkpoints is not None else (None, None)
        t = qkv.shape[0]
        if backend.fused is not None:  # the mixer in one call, for a step of decodes
            y = backend.fused.mixer(qkv, z, a, b, self.conv1d.weight, conv_pool, self.A_log,
                                    self.dt_bias, recurrent_pool, self.norm.weight, meta,
                                    self.num_k_heads, self.head_k_dim ** -0.5, QK_L2_NORM_EPS,
                                    self.norm.eps, (ck_conv, ck_rec), capsule)  # [T, Hv*Dv] / None
            if y is not None:
                return y
        z = z.view(t, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        b, a = b.float(), a.float()
        mixed = capsules.causal_conv(backend.step.causal_conv, qkv, self.conv1d.weight, conv_pool,
                                     meta, "silu", ck_conv, capsule)  # [T, conv_dim]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = self.kernels.norms.l2(q.reshape(t, self.num_k_heads, self.head_k_dim),
                          QK_L2_NORM_EPS)  # fp32 [T, Hk, Dk]
        k = self.kernels.norms.l2(k.reshape(t, self.num_k_heads, self.head_k_dim),
                          QK_L2_NORM_EPS)  # fp32 [T, Hk, Dk]
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()  # fp32 [T, Hv, Dv]
        core = capsules.gated_delta(backend.step.gated_delta, backend.capture, q, k, v, a, b,
                                    self.A_log, self.dt_bias, recurrent_pool, meta,
                                    self.head_k_dim ** -0.5, ck_rec, capsule)  # fp32 [T, Hv, Dv]
        return self.norm(core.to(qkv.dtype), z).reshape(t, self.value_dim)  # [T, Hv*Dv]
