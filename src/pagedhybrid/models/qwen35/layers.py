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
  torch's by default): the batch-invariant bundle's compute every element alike. So are the two
  norms' arithmetic (``norms``, from ``Backend.norms``: torch's formulas above by default, one
  native call per norm in the native bundles).

Parameter names equal HF's so ``state_dict()`` keys are the checkpoint keys.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedhybrid.kernels.registry import TORCH_NORMS, TORCH_POINTWISE, Norms, Pointwise
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    RowParallelLinear,
    Segment,
)


class OffsetRMSNorm(nn.Module):
    norms: Norms = TORCH_NORMS  # the backend's (set with the model's backend)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norms.rms(x, self.weight, self.eps, True)


class GatedRMSNorm(nn.Module):
    pointwise: Pointwise = TORCH_POINTWISE  # the backend's silu (set with the model's backend)
    norms: Norms = TORCH_NORMS

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.norms.gated(x, gate, self.weight, self.eps, self.pointwise.silu)


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
