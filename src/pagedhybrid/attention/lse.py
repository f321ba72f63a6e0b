"""Attention-domain partial states ``(out, lse)`` and the pinned ``online_softmax_lse`` merge.

The state definitions, the merge formula (all fp32 here), its ``±inf`` rules and the left fold
live in ``pagedhybrid.kernels.lse`` (``normalize_partial``, ``merge_states``, ``fold_left``,
re-exported here) so the fast kernels use the very same merge. This module adds:

``fold_states`` folds ``(global_block_index, out, lse)`` states left in ascending global block
index after ``normalize_partial``; arrival order never matters, different orders give different
bits.

``attention_partial`` computes one partial state with contractions written as broadcast-multiply
plus an innermost ``sum`` (no BLAS call whose blocking could depend on thread count or shape).
Bitwise reproducibility across CP sizes comes from calling it with identical inputs and shapes
(``pagedhybrid.attention.cp_plan``); torch's vectorised elementwise kernels may round an element
differently depending on its position in a tensor, so the same row computed inside a
differently shaped batch is only equal within rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedhybrid.kernels.lse import NEG_INF, fold_left, merge_states, normalize_partial

__all__ = ["NEG_INF", "attention_partial", "fold_left", "fold_states", "merge_states",
           "normalize_partial"]


def fold_states(states: Iterable[tuple[int, torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left fold of ``(global_block_index, out, lse)`` states in ascending block index.

    Sorted first, so arrival order never matters; duplicate indices are an error.
    """
    items = sorted(states, key=lambda s: s[0])
    if not items:
        raise ValueError("fold_states needs at least one partial state")
    keys = [k for k, _, _ in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate global block indices in a fold: {keys}")
    return fold_left(normalize_partial(o, lb) for _, o, lb in items)


def attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial state of query rows against one KV block, fp32.

    q [R, Hq, D]; k, v [C, Hkv, D] with Hq % Hkv == 0 (query head h reads KV head h // (Hq/Hkv));
    allowed [R, C] bool (False: masked or padding). Returns out [R, Hq, D], lse [R, Hq].
    """
    group = q.shape[1] // k.shape[1]
    q = q.to(torch.float32)
    k = k.to(torch.float32).repeat_interleave(group, dim=1).permute(1, 0, 2)  # [Hq, C, D]
    v = v.to(torch.float32).repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, C]
    s = (q[:, :, None, :] * k[None]).sum(-1) * scale  # [R, Hq, C]
    s = s.masked_fill(~allowed[:, None, :], NEG_INF)
    m = s.amax(-1)  # [R, Hq]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = torch.exp(s - m[..., None]).sum(-1)  # [R, Hq]
    lse = torch.log(z) + m  # [R, Hq]; -inf for a fully masked row
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - shift[..., None])  # [R, Hq, C]; 0 where masked
    out = (p[:, :, None, :] * v[None]).sum(-1)  # [R, Hq, D]
    return out, lse
