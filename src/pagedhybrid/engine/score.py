"""The training-side recompute: each completion token's log-probability from one full forward.

``score(engine, prompts, completions)`` runs every ``prompt + completion`` as one whole sequence
through the model (``forward_packed``: sequences packed back to back, each starting from zero
state, no prefix reuse, no chunking, no scheduler), over transient buffers sized exactly for
them -- contiguous pages of the engine's block size and element type (and KV scales, so
quantized pages are quantized alike) and one state row per sequence; the engine's page and state
pools are not touched. Groups of sequences of up to ``SCORE_TOKENS`` tokens go in one forward.
Completion token ``j`` is scored from the logits row of the token before it, with the very
function the engine's sampler uses for ``SamplingParams(logprobs=0)`` on a one-row slice, in
float32.

With ``EngineConfig(batch_invariant=True)`` the kernels' rows do not depend on the batch, so
these values equal, bitwise, the logprobs the engine returned while generating the same tokens
(``dlogp = 0``); in the default mode they agree to float noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagedhybrid.engine.request import InvalidRequest
from pagedhybrid.engine.sampling import logprob_dicts
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache

if TYPE_CHECKING:
    from pagedhybrid.engine.engine import Engine

SCORE_TOKENS = 8192  # tokens per forward (whole sequences; a longer one goes alone)
OP = "LLM.score"


def _ids(engine: Engine, what: str, i: int, x: str | Sequence[int]) -> list[int]:
    try:
        return engine._token_ids(f"{what}[{i}]", x)
    except InvalidRequest as exc:
        raise InvalidRequest(OP, f"{what}[{i}]", exc.rule, exc.got) from None


@torch.no_grad()
def score(engine: Engine, prompts: Sequence[str | Sequence[int]],
          completions: Sequence[str | Sequence[int]]) -> list[list[float]]:
    """Per pair, the completion tokens' log-probabilities (see the module docstring)."""
    if isinstance(prompts, str) or isinstance(completions, str):
        raise InvalidRequest(OP, "prompts/completions", "must be lists (one entry per pair)")
    if len(prompts) != len(completions):
        raise InvalidRequest(OP, "completions", "must have one entry per prompt",
                             (len(prompts), len(completions)))
    pairs = [(_ids(engine, "prompts", i, p), _ids(engine, "completions", i, c))
             for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
    limit = engine.model.config.max_position_embeddings
    for i, (p, c) in enumerate(pairs):
        if len(p) + len(c) > limit:
            raise InvalidRequest(OP, f"prompts[{i}]", f"prompt + completion must fit "
                                 f"max_position_embeddings = {limit}", len(p) + len(c))
    out: list[list[float]] = [[] for _ in pairs]
    group: list[int] = []
    tokens = 0
    for i, (p, c) in enumerate(pairs):
        if group and tokens + len(p) + len(c) > SCORE_TOKENS:
            _score_group(engine, pairs, group, out)
            group, tokens = [], 0
        group.append(i)
        tokens += len(p) + len(c)
    if group:
        _score_group(engine, pairs, group, out)
    return out


def _score_group(engine: Engine, pairs: list[tuple[list[int], list[int]]], group: list[int],
                 out: list[list[float]]) -> None:
    cfg, bs = engine.model.config, engine.config.block_size
    seqs = [pairs[i][0] + pairs[i][1] for i in group]
    pages = [-(-len(s) // bs) for s in seqs]
    tables, first = [], 0
    for n in pages:
        tables.append(list(range(first, first + n)))
        first += n
    cache = PagedHybridCache.allocate(
        cfg, num_pages=max(first, 1), block_size=bs, num_slots=len(seqs),
        dtype=engine.model.dtype, kv_dtype=engine.cache.kv_dtype,
        kv_scales=engine.cache.kv_scales)
    batch = PackedBatch.from_sequences(seqs, [0] * len(seqs), tables, list(range(len(seqs))))
    rows, targets, offset = [], [], 0
    for i, s in zip(group, seqs, strict=True):
        p, c = pairs[i]
        rows.extend(range(offset + len(p) - 1, offset + len(s) - 1))
        targets.append(c)
        offset += len(s)
    logits = engine.model.forward_packed(batch, cache, torch.tensor(rows, dtype=torch.int64))
    r = 0
    for i, c in zip(group, targets, strict=True):
        for tok in c:
            out[i].append(logprob_dicts(logits[r:r + 1], [tok], 0)[0][tok].logprob)
            r += 1
