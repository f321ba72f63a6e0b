"""The layers' row-wise norms on the native kernels (``csrc/norms.cpp``): one op per norm.

The torch forms (``kernels.registry.TORCH_NORMS``) spend ~10 dispatcher calls on each norm (the
fp32 widening, square, mean, rsqrt, products, the rounding back); at decode, where each is a few
hundred elements, those calls are the cost. Here each norm is one call that reads its rows in
their dtype (twice: the sum of squares, then the scaling), reduces each row on one thread in a
fixed order and writes the result rounded once (so a row's bits never depend on the batch: the
batch-invariant bundle uses these too). Inputs of other dtypes (fp16) take the torch forms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedhybrid.kernels.native import library
from pagedhybrid.kernels.registry import TORCH_NORMS, Norms

_NATIVE = (torch.float32, torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _weight(w: torch.Tensor) -> torch.Tensor:
    return w if w.is_contiguous() else w.contiguous()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    if x.dtype not in _NATIVE or w.dtype not in _NATIVE:
        return TORCH_NORMS.rms(x, w, eps, offset)
    x2 = _rows(x)
    out = torch.empty_like(x2)
    library().rms_norm(x2, _weight(w), out, eps, offset)
    return out.view(x.shape)


def gated(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float,
          silu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if x.dtype not in _NATIVE or w.dtype not in _NATIVE or gate.dtype != x.dtype:
        return TORCH_NORMS.gated(x, gate, w, eps, silu)
    x2 = _rows(x)
    out = torch.empty_like(x2)
    library().gated_rms_norm(x2, _rows(gate), _weight(w), out, eps)
    return out.view(x.shape)


def l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _NATIVE:
        return TORCH_NORMS.l2(x, eps)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.float32)
    library().l2_normalize(x2, out, eps)
    return out.view(x.shape)


NATIVE_NORMS = Norms(rms, gated, l2)
