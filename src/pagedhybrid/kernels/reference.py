"""The op references behind the model's step seam: the declared slow path.

Each step function calls its contract's torch reference (``pagedhybrid.ops``) with full
validation, gathering the sequences' state rows out of the pool (zeros when fresh) and writing
the final states back -- the copies the fast paths avoid. Exact semantics, for verification. It
cannot emit intermediate states, so it refuses state checkpoints (prefix caching).
"""

from __future__ import annotations

import torch

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.kvquant import KVScales, per_tensor
from pagedhybrid.ops import gated_delta_net, paged_attention, varlen_causal_conv


def _no_checkpoints(meta: StepMetadata) -> None:
    if meta.checkpoints:
        raise UnsupportedConfiguration("the reference kernels cannot emit intermediate states "
                                       "(state checkpoints for prefix caching)")


def _rows(pool: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    init = pool.index_select(0, meta.state_slots)
    init[meta.fresh_t] = 0
    return init


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, meta: StepMetadata, scale: float,
              scales: KVScales | None = None) -> torch.Tensor:
    n, hq, d = q.shape
    quant = "NONE" if scales is None else "PER_TENSOR" if per_tensor(scales) else "PER_CHANNEL"
    out, _, _ = paged_attention(
        q.reshape(n, hq * d), k.reshape(n, -1), v.reshape(n, -1), key_cache, value_cache,
        meta.cu_seqlens_t, meta.past_t, meta.block_table,
        k_scale=None if scales is None else scales.k,
        v_scale=None if scales is None else scales.v, num_heads=hq,
        kv_num_heads=key_cache.shape[2], scale=scale, k_quant_type=quant, v_quant_type=quant)
    return out.view(n, hq, d)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    _no_checkpoints(meta)
    y, final = varlen_causal_conv(x, weight, meta.cu_seqlens_t, None, _rows(pool, meta),
                                  activation=activation)
    pool.index_copy_(0, meta.state_slots, final.to(pool.dtype))
    return y


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None = None
                ) -> torch.Tensor:
    _no_checkpoints(meta)
    o, final = gated_delta_net(q, k, v, meta.cu_seqlens_t, a, b, _rows(pool, meta), a_log,
                               dt_bias, gate_activation="qwen", beta_activation="sigmoid",
                               qk_l2_norm=0, scale=scale)
    pool.index_copy_(0, meta.state_slots, final)
    return o
