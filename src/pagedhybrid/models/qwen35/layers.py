"""Small building blocks of the Qwen3.5 decoder (HF ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5MLP``).

* ``OffsetRMSNorm``: ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back. HF stores
  ``w`` zero-initialised; a checkpoint's value is used as is and the ``1 +`` is applied here.
* ``GatedRMSNorm`` (Gated DeltaNet output norm over ``Dv`` per head):
  ``y = o * rsqrt(mean(o^2) + eps) * w * silu(z)`` with the **raw** weight ``w``, fp32 math.
* ``MLP``: ``down(silu(gate(x)) * up(x))``; under tensor parallelism ``gate`` / ``up`` are
  column-parallel (rows ``[r * I / W, +I / W)``) and ``down`` row-parallel (its partial sums
  all-reduced), so each rank computes ``I / W`` intermediate channels.
* Projections are ``pagedhybrid.parallel.linear``'s (``ReplicatedLinear``,
  ``ColumnParallelLinear``, ``RowParallelLinear``): bias-free, the product is the kernel
  bundle's (``matmul``, set from ``Backend.linear`` when the model's backend is set; None =
  ``F.linear``); at TP world size 1 they are plain projections.
* SiLU and sigmoid are the kernel bundle's too (``pointwise``, set from ``Backend.pointwise``;
  torch's by default): the batch-invariant bundle's compute every element alike.

Parameter names equal HF's so ``state_dict()`` keys are the checkpoint keys.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedhybrid.kernels.backend import TORCH_POINTWISE, Pointwise
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    RowParallelLinear,
    Segment,
)


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


class MLP(nn.Module):
    pointwise: Pointwise = TORCH_POINTWISE  # the backend's silu (set with the model's backend)

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        channels = Segment(intermediate, intermediate, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden, channels, dtype, parallel)
        self.up_proj = ColumnParallelLinear(hidden, channels, dtype, parallel)
        self.down_proj = RowParallelLinear(channels, hidden, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.pointwise.silu(self.gate_proj(x)) * self.up_proj(x))
