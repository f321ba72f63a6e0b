"""Attention-domain partial states ``(out, lse)`` and the pinned ``online_softmax_lse`` merge.

Definitions (one query row, scores ``s_j = scale * q . k_j`` over the unmasked keys of a KV
block ``B``; natural log, softmax scale included, fp32):

    lse_B = log sum_j exp(s_j)            out_B = sum_j exp(s_j - lse_B) * v_j

A fully masked or empty block is ``(out = 0, lse = -inf)``.

Merge of two states (all fp32, RL-Kernel ``_merge_two_states`` form):

    L   = logaddexp(l_a, l_b)
    w_a = exp(l_a - L) if isfinite(L) else 0        w_b = exp(l_b - L) if isfinite(L) else 0
    out = w_a * o_a + w_b * o_b                     lse = L  (-inf when not finite)

``(0, -inf)`` is an exact identity of this merge (``logaddexp(l, -inf) == l``, weights 1 and 0),
so skipping a fully masked block and merging it give the same bits. ``+inf`` LSEs (FA2's
convention for an empty row) are turned into ``-inf`` on ingestion. A fold is a left fold in
ascending global block index; different orders or merge forms give different bits.

``attention_partial`` computes one partial state with contractions written as broadcast-multiply
plus an innermost ``sum`` (no BLAS call whose blocking could depend on thread count or shape).
Bitwise reproducibility across CP sizes comes from calling it with identical inputs and shapes
(``pagedhybrid.parallel.cp_plan``); torch's vectorised elementwise kernels may round an element
differently depending on its position in a tensor, so the same row computed inside a
differently shaped batch is only equal within rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

NEG_INF = float("-inf")


def normalize_partial(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies with the ±inf conventions: ``+inf``/NaN LSE -> ``-inf`` with out 0."""
    out = out.to(torch.float32)
    lse = lse.to(torch.float32)
    empty = ~torch.isfinite(lse) & ~torch.isneginf(lse)  # +inf or NaN
    lse = torch.where(empty, torch.full_like(lse, NEG_INF), lse)
    out = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(out), out)
    return out, lse


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 states ``out [..., D]``, ``lse [...]`` -> merged state (formula above)."""
    big = torch.logaddexp(lse_a, lse_b)  # [...]
    fin = torch.isfinite(big)
    zero = torch.zeros_like(big)
    w_a = torch.where(fin, torch.exp(lse_a - big), zero)  # [...]
    w_b = torch.where(fin, torch.exp(lse_b - big), zero)  # [...]
    out = w_a[..., None] * out_a + w_b[..., None] * out_b  # [..., D]
    lse = torch.where(fin, big, torch.full_like(big, NEG_INF))
    return out, lse


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
    out, lse = normalize_partial(items[0][1], items[0][2])
    for _, o, lb in items[1:]:
        o, lb = normalize_partial(o, lb)
        out, lse = merge_states(out, lse, o, lb)
    return out, lse


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
