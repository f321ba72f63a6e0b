"""Small building blocks of the Qwen3.5 decoder (HF ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5MLP``).

* ``OffsetRMSNorm``: ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back. HF stores
  ``w`` zero-initialised; a checkpoint's value is used as is and the ``1 +`` is applied here.
* ``GatedRMSNorm`` (Gated DeltaNet output norm over ``Dv`` per head):
  ``y = o * rsqrt(mean(o^2) + eps) * w * silu(z)`` with the **raw** weight ``w``, fp32 math.
* ``MLP``: ``down(silu(gate(x)) * up(x))``.
* ``Linear``: a bias-free projection whose product is the kernel bundle's (``matmul``, set from
  ``Backend.linear`` when the model's backend is set; None = ``F.linear``).
* SiLU and sigmoid are the kernel bundle's too (``pointwise``, set from ``Backend.pointwise``;
  torch's by default): the batch-invariant bundle's compute every element alike.

Parameter names equal HF's so ``state_dict()`` keys are the checkpoint keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedhybrid.kernels.backend import TORCH_POINTWISE, Pointwise

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    pointwise: Pointwise = TORCH_POINTWISE  # the backend's silu (set with the model's backend)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * self.weight.float() * self.pointwise.silu(gate.float())
        return y.to(x.dtype)


class Linear(nn.Linear):
    matmul: Matmul | None = None  # the backend's product (None: F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x)


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ module.weight^T`` with the module's ``matmul`` (``F.linear`` when None)."""
    mm = getattr(module, "matmul", None)
    return F.linear(x, module.weight) if mm is None else mm(x, module.weight)


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> Linear:
    """A bias-free projection (weights are loaded, never initialised)."""
    layer = Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.weight.requires_grad_(False)
    return layer


class MLP(nn.Module):
    pointwise: Pointwise = TORCH_POINTWISE  # the backend's silu (set with the model's backend)

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype)
        self.up_proj = linear(hidden, intermediate, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.pointwise.silu(self.gate_proj(x)) * self.up_proj(x))
