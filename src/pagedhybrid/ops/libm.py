"""libm's float32 ``expf`` / ``log1pf``, elementwise: the functions ONNX Runtime's CPU kernel calls.

torch's and numpy's vectorised float32 exp / log1p differ from the C library's in the last bit
for about 1-5% of inputs, so a result that must equal ONNX Runtime's bit for bit (the
GatedDeltaNet reference and its compact state updates) calls libm itself, one element at a time
through ctypes (about 0.4 us an element: references and short captures only, never a fast path).
Tensors of another dtype (the float64 extension) go to torch's functions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch

__all__ = ["expf", "log1pf"]

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))


def _elementwise(name: str, fallback: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(_LIBM, name)
    fn.restype, fn.argtypes = ctypes.c_float, (ctypes.c_float,)

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return fallback(x)
        return torch.tensor(list(map(fn, x.flatten().tolist())),
                            dtype=torch.float32).reshape(x.shape)

    apply.__doc__ = f"``{name}`` of each element of a float32 tensor (torch's for other dtypes)."
    return apply


expf = _elementwise("expf", torch.exp)
log1pf = _elementwise("log1pf", torch.log1p)
