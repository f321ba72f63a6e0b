"""Helpers shared by the engine tests (a uniquely named module, unlike ``conftest``)."""

from __future__ import annotations

import torch


def prompt_of(seed: int, length: int, vocab: int = 256) -> list[int]:
    """A reproducible random prompt of byte tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()
