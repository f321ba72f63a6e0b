"""Helpers shared by the engine tests (a uniquely named module, unlike ``conftest``)."""

from __future__ import annotations

import torch

from pagedhybrid.engine import Engine, SamplingParams, SequenceOutput


def prompt_of(seed: int, length: int, vocab: int = 256) -> list[int]:
    """A reproducible random prompt of byte tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams
            ) -> list[SequenceOutput]:
    """Every prompt queued at once, stepped to the end (the invariants checked after each step);
    the outputs in prompt order."""
    outs: dict[str, SequenceOutput] = {}
    ids = [f"r{engine.stats.steps}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
    return [outs[r] for r in ids]
