"""The sampler's greedy pick, ``greedy_rows``: per row of fp32 logits ``[R, V]`` the index of
the first maximum (``torch.argmax``'s rule), ``-1`` where the row holds a NaN or an infinity.
One native pass per row (``csrc/sampling.cpp``) where ``argmax`` plus the finite check cost
torch three ops and a host copy; the same rule in torch ops where the library is not loaded.

Grammar masks come packed (int32 ``[R, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32``
allows token ``t``: llguidance's layout) and stay packed: ``greedy_rows(logits, allowed)``
takes the maximum over the allowed tokens (``-1`` also where none is allowed),
``apply_token_bitmask_`` writes ``-inf`` over the refused ones in place, and
``unpack_bitmask`` is the bool ``[R, V]`` form for whoever needs one.

``top_rows(logits, rows, k)`` is some rows' ``k`` best tokens in the order the greedy pick
breaks ties (by value, then by id): exactly the first ``k`` of that order, so the first of them
a grammar allows is the masked argmax (``torch.topk`` leaves the order of ties open, and costs
~70 us for 5 rows of 4,096 where the native pass costs a few)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native import library, status


@functools.cache
def _op(name: str) -> Any:
    """The native op ``name``, looked up once (None: the library is not loaded)."""
    return getattr(library(), name) if status().available else None


def greedy_rows(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[R]``: each row's first maximum (over the tokens the packed mask ``allowed``
    allows, when given), ``-1`` for a row with a non-finite value or nothing allowed."""
    op = _op("greedy_rows")
    if op is not None and logits.dtype == torch.float32 and logits.shape[1] > 0:
        return op(logits.contiguous(), allowed)  # type: ignore[no-any-return]
    bad = ~torch.isfinite(logits).all(dim=-1)
    if allowed is not None:
        ok = unpack_bitmask(allowed, logits.shape[1])
        logits, bad = logits.masked_fill(~ok, float("-inf")), bad | ~ok.any(dim=-1)
    return logits.argmax(dim=-1).masked_fill_(bad, -1)


def apply_token_bitmask_(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` (fp32 ``[R, V]``) with ``-inf`` over the tokens the packed mask refuses, in
    place."""
    op = _op("apply_token_bitmask_")
    if op is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        op(logits, allowed)
        return logits
    return logits.masked_fill_(~unpack_bitmask(allowed, logits.shape[1]), float("-inf"))


def top_rows(logits: torch.Tensor, rows: list[int], k: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values and int64 ids ``[len(rows), k]``: the ``k`` best tokens of each of the
    rows ``rows`` of ``logits [R, V]`` (no NaN), best first, by value then by id."""
    op = _op("top_rows")
    if op is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        return op(logits, rows, k)  # type: ignore[no-any-return]
    vals, ids = logits[rows].float().sort(dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def unpack_bitmask(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[R, vocab]`` of the packed mask ``allowed`` (int32 ``[R, ceil(vocab / 32)]``)."""
    if allowed.dim() != 2 or allowed.dtype != torch.int32 or allowed.shape[1] != -(-vocab // 32):
        raise ContractViolation("unpack_bitmask", "allowed", f"must be int32 [R, "
                                f"{-(-vocab // 32)}] for {vocab} tokens",
                                (tuple(allowed.shape), allowed.dtype))
    shifts = torch.arange(32, dtype=torch.int32)
    return ((allowed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
