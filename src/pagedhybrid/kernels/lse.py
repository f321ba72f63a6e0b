"""The one log-sum-exp merge of partial attention states ``(out, lse)``.

Definitions (one query row, scores ``s_j = scale * q . k_j`` over the unmasked keys of a KV
block ``B``; natural log, softmax scale included):

    lse_B = log sum_j exp(s_j)            out_B = sum_j exp(s_j - lse_B) * v_j

A fully masked or empty block is ``(out = 0, lse = -inf)``.

Merge of two states (RL-Kernel ``_merge_two_states`` form), computed in the states' own dtype
(fp32 for attention-domain states; the CPU PagedAttention kernel merges its float64 tiles in
float64):

    L   = logaddexp(l_a, l_b)
    w_a = exp(l_a - L) if isfinite(L) else 0        w_b = exp(l_b - L) if isfinite(L) else 0
    out = w_a * o_a + w_b * o_b                     lse = L  (-inf when not finite)

``(0, -inf)`` is an exact identity of this merge (``logaddexp(l, -inf) == l``, weights 1 and 0),
so skipping a fully masked block and merging it give the same bits. ``+inf`` LSEs (FA2's
convention for an empty row) and NaN LSEs are turned into ``-inf`` (with out 0) on ingestion by
``normalize_partial``. A fold is a left fold (``fold_left``) in a fixed order: ascending global
block index for attention partials (``pagedhybrid.attention.lse.fold_states``), ascending tile
order inside a kernel; different orders or merge forms give different bits.

This module sits at the bottom of ``kernels`` (it imports nothing of pagedhybrid) so that the
kernels and ``pagedhybrid.attention`` share it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

NEG_INF = float("-inf")

__all__ = ["NEG_INF", "fold_left", "merge_states", "normalize_partial"]


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
    """Two states ``out [..., D]``, ``lse [...]`` (one float dtype) -> merged state."""
    big = torch.logaddexp(lse_a, lse_b)  # [...]
    fin = torch.isfinite(big)
    zero = torch.zeros_like(big)
    w_a = torch.where(fin, torch.exp(lse_a - big), zero)  # [...]
    w_b = torch.where(fin, torch.exp(lse_b - big), zero)  # [...]
    out = w_a[..., None] * out_a + w_b[..., None] * out_b  # [..., D]
    lse = torch.where(fin, big, torch.full_like(big, NEG_INF))
    return out, lse


def fold_left(states: Iterable[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_states`` folded left over ``(out, lse)`` states in the order given.

    The states must already follow the conventions (``normalize_partial``, or a kernel's own
    ``-inf`` masking) and share one dtype; one state comes back unchanged.
    """
    it = iter(states)
    try:
        out, lse = next(it)
    except StopIteration:
        raise ValueError("fold_left needs at least one partial state") from None
    for o, lb in it:
        out, lse = merge_states(out, lse, o, lb)
    return out, lse
