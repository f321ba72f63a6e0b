"""Full-attention layer of Qwen3.5 (HF ``Qwen3_5Attention``), dense and packed paged.

Per token ``x[hidden]``:

1. ``q_proj`` gives ``2·H·hd`` values, viewed ``[H, 2·hd]`` and split per head into
   ``query | gate`` (``gate`` flattened back to ``[H·hd]``); ``k_proj``/``v_proj`` give
   ``[Hkv, hd]``.
2. OffsetRMSNorm ``q_norm`` / ``k_norm`` per head (``1 + w``).
3. Interleaved partial MRoPE on the first ``rotary_dim`` channels (``rope.py``).
4. Causal GQA attention, scale ``hd^-0.5``; query head ``h`` reads KV head ``h // (H/Hkv)``.
   Dense path (``attend_dense``): plain torch over a contiguous cache ``[B, L, Hkv, hd]``
   (fp32 math).
   Packed path (``attend``): the backend's paged attention on the step's ``StepMetadata`` (the
   ``PagedAttention`` contract with norms and RoPE done outside the op, ``do_rotary=0``, exactly
   as the export does); the step's K/V are written into the pages in place (quantized by the
   contract's rule for int8 / float8 pages, with the layer's calibrated scales).
5. ``o_proj(attn · sigmoid(gate))``.

The layer's program (``kernels/layer_spec.py``) runs these steps: ``project`` (``q_proj``,
``k_proj``, ``v_proj``), ``attend`` (2-4 and the gate) and ``project`` (``o_proj``).

Tensor parallelism (``ParallelConfig``, world size ``W``): a rank owns contiguous query heads
``[r·H/W, +H/W)`` -- ``q_proj`` column-parallel by head (each head's ``query | gate`` rows stay
together) -- and the KV heads they read, ``k_proj`` / ``v_proj`` column-parallel by KV head
(``[r·Hkv/W, +Hkv/W)``; when ``Hkv < W`` and ``W % Hkv == 0`` each rank holds the one KV head
``r·Hkv // W`` its queries read, replicated). ``o_proj`` is row-parallel over the query heads
(partial sums all-reduced). The layer's head counts (``num_heads``, ``num_kv_heads``) and its
pages are the rank's; the GQA mapping ``kv = h // (H/Hkv)`` holds locally.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedhybrid.kernels.registry import Backend, UsesKernels
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.kvquant import KVScales
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.layers import OffsetRMSNorm
from pagedhybrid.models.qwen35.rope import apply_rope
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    RowParallelLinear,
    Segment,
)


class FullAttention(nn.Module, UsesKernels):

    def __init__(self, config: Qwen35Config, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        h, hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden = config.hidden_size
        heads = Segment(h * hd, h, "num_attention_heads")
        kv_heads = Segment(hkv * hd, hkv, "num_key_value_heads", shared=True)
        self.num_heads = parallel.local(h, heads.field)
        self.num_kv_heads = parallel.local(hkv, kv_heads.field, shared=True)
        self.head_dim = hd
        self.q_proj = ColumnParallelLinear(hidden, heads._replace(size=2 * h * hd), dtype,
                                           parallel)  # per head [query | gate]
        self.k_proj = ColumnParallelLinear(hidden, kv_heads, dtype, parallel)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads, dtype, parallel)
        self.o_proj = RowParallelLinear(heads, hidden, dtype, parallel)
        self.q_norm = OffsetRMSNorm(hd, config.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(hd, config.rms_norm_eps, dtype)

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' outputs (``q_proj``'s ``[T, 2·H·hd]``, ``k_proj`` / ``v_proj``'s
        ``[T, Hkv·hd]``) -> q ``[T, H, hd]``, k ``[T, Hkv, hd]`` (normed, rotated), v
        ``[T, Hkv, hd]``, gate ``[T, H·hd]``."""
        t = q.shape[0]
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        query, gate = q.view(t, h, 2 * hd).chunk(2, dim=-1)  # [T, H, hd] x2
        gate = gate.reshape(t, h * hd)  # [T, H*hd]
        q = apply_rope(self.q_norm(query), cos, sin)  # [T, H, hd]
        k = apply_rope(self.k_norm(k.view(t, hkv, hd)), cos, sin)  # [T, Hkv, hd]
        return q, k, v.view(t, hkv, hd), gate

    def gated(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return attn * self.kernels.pointwise.sigmoid(gate)  # [T, H*hd]

    def attend_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, batch: int, past_key: torch.Tensor | None,
                     past_value: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The program's ``attend`` over a contiguous cache: the projections' outputs of
        ``batch`` rows of ``S`` tokens -> (the gated attention ``[B*S, H·hd]``, keys, values
        ``[B, L, Hkv, hd]``)."""
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v, gate = self.prepare(q, k, v, cos, sin)
        b, s = batch, q.shape[0] // batch
        q = q.view(b, s, h, hd)
        k = k.view(b, s, hkv, hd)
        v = v.view(b, s, hkv, hd)
        if past_key is not None and past_value is not None:
            k = torch.cat((past_key, k), dim=1)  # [B, L, Hkv, hd]
            v = torch.cat((past_value, v), dim=1)
        big_l, past = k.shape[1], k.shape[1] - s
        group = h // hkv
        kf = k.float().repeat_interleave(group, dim=2)  # [B, L, H, hd]
        vf = v.float().repeat_interleave(group, dim=2)
        scores = torch.einsum("bshd,blhd->bhsl", q.float(), kf) * hd ** -0.5  # [B, H, S, L]
        allowed = (torch.arange(big_l, device=q.device)[None, :]
                   <= torch.arange(s, device=q.device)[:, None] + past)  # [S, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn = torch.einsum("bhsl,blhd->bshd", probs, vf).to(gate.dtype)  # [B, S, H, hd]
        return self.gated(attn.reshape(b * s, h * hd), gate), k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, meta: StepMetadata, key_cache: torch.Tensor,
               value_cache: torch.Tensor, backend: Backend, scales: KVScales | None = None
               ) -> torch.Tensor:
        """The program's ``attend`` on the pages: the projections' outputs of ``N`` packed
        tokens -> the gated attention ``[N, H·hd]``; this layer's pages are written in place
        (quantized with ``scales`` when they are int8 / float8)."""
        n = q.shape[0]
        q, k, v, gate = self.prepare(q, k, v, cos, sin)
        attn = backend.step.attention(q, k, v, key_cache, value_cache, meta,
                                      self.head_dim ** -0.5, scales)  # [N, H, hd]
        return self.gated(attn.reshape(n, -1), gate)
