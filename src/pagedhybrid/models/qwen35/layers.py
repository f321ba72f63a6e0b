"""Small building blocks of the Qwen3.5 decoder (HF ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5MLP``).

* ``OffsetRMSNorm``: ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back. HF stores
  ``w`` zero-initialised; a checkpoint's value is used as is and the ``1 +`` is applied here.
* ``GatedRMSNorm`` (Gated DeltaNet output norm over ``Dv`` per head):
  ``y = o * rsqrt(mean(o^2) + eps) * w * silu(z)`` with the **raw** weight ``w``, fp32 math.
* ``MLP``: ``down(silu(gate(x)) * up(x))``.

Parameter names equal HF's so ``state_dict()`` keys are the checkpoint keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * self.weight.float() * F.silu(gate.float())
        return y.to(x.dtype)


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free projection (weights are loaded, never initialised)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.weight.requires_grad_(False)
    return layer


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype)
        self.up_proj = linear(hidden, intermediate, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
