"""The mixture-of-experts feed-forward on the native kernel (``csrc/moe.cpp``).

``experts(x, index, weights, gate_up, down, shared)`` is one layer's routed experts -- and, when
``shared`` holds the shared expert's four weights, the shared expert and its sigmoid gate fused
in -- in one call: the (token, slot) pairs sorted by expert once, each expert's rows multiplied
with its weights read in place, the weighted rows summed back per token in ascending expert
order (transformers' order), the shared row last. The fast form (``invariant=False``) multiplies
experts with many rows (prefill) with a packed micro-kernel; the invariant form streams every
product in one fixed reduction order per element, so a token's result does not depend on which
other tokens share its experts (the ``native_batch_invariant`` bundle's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedhybrid.kernels.native import library


def experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
            gate_up: torch.Tensor, down: torch.Tensor,
            shared: Sequence[torch.Tensor] | None = None, *,
            invariant: bool = False) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{index[t, j]}(x[t])`` (+ ``sigmoid(shared_gate . x[t]) *
    shared_expert(x[t])`` when ``shared`` = (gate_proj [Is, H], up_proj [Is, H], down_proj
    [H, Is], shared_gate [1, H])) for every row ``t`` of ``x [T, H]``; ``index`` [T, k] expert
    ids, ``weights`` [T, k] their routing weights, ``gate_up`` [E, 2I, H] and ``down``
    [E, H, I] the experts' weights. Out: [T, H] in ``x``'s dtype."""
    x2 = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x2)
    library().moe_experts(  # type: ignore[attr-defined]
        x2, index if index.is_contiguous() else index.contiguous(),
        weights.to(x.dtype).contiguous(), gate_up, down,
        *(shared if shared is not None else (None,) * 4), out, invariant)
    return out


def invariant_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor,
                      shared: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``experts`` in its batch-invariant form."""
    return experts(x, index, weights, gate_up, down, shared, invariant=True)
