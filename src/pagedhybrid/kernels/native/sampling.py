"""The sampler's greedy pick, ``greedy_rows``: per row of fp32 logits ``[R, V]`` the index of
the first maximum (``torch.argmax``'s rule), ``-1`` where the row holds a NaN or an infinity.
One native pass per row (``csrc/sampling.cpp``) where ``argmax`` plus the finite check cost
torch three ops and a host copy; the same rule in torch ops where the library is not loaded."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedhybrid.kernels.native import library, status


@functools.cache
def _op() -> Any:
    """The native op, looked up once (None: the library is not loaded)."""
    return library().greedy_rows if status().available else None


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: each row's first maximum, ``-1`` for a row with a non-finite value."""
    op = _op()
    if op is not None and logits.dtype == torch.float32 and logits.shape[1] > 0:
        return op(logits.contiguous())  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).masked_fill_(~torch.isfinite(logits).all(dim=-1), -1)
