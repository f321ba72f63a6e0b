"""Verification: the tokens a verify chunk keeps, by rejection sampling (exact: every token has
the target distribution; greedy rows keep exactly greedy decoding's tokens). See
``spec_decode/__init__.py``, step 3; the states of the rejected rows are rolled back by
``kernels/capsule.py`` (the commit of the accepted ones: ``PagedHybridCache.commit_verified``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.sample.sampler import (
    SampledToken,
    draw,
    logprob_dicts,
    params_probs,
    process_logits,
)
from pagedhybrid.kernels.native.sampling import greedy_rows


def verify(logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]],
           first_rows: Sequence[int],
           masks: Sequence[torch.Tensor | None] | None = None
           ) -> list[list[SampledToken] | str]:
    """The tokens each verify request keeps (``spec_decode/__init__.py``, step 3): request
    ``r``'s chunk has ``len(drafts[r]) + 1`` logits rows from ``first_rows[r]``; ``masks[r]`` (bool
    ``[len(drafts[r]) + 1, V]``, or None) are the tokens its grammar allows at each row
    (``structured.draft_masks``). A request whose rows are not all finite, whose grammar allows
    no token, or whose verification raises, gets the reason instead of tokens."""
    raw = logits.float()
    idx = [first + i for first, d in zip(first_rows, drafts, strict=True)
           for i in range(len(d) + 1)]
    rows = raw[idx] if idx != list(range(raw.shape[0])) else raw  # [R, V]
    params = [r.params for r, d in zip(reqs, drafts, strict=True) for _ in range(len(d) + 1)]
    finite = greedy_rows(rows)  # [R]: -1 for a row with a non-finite logit
    proc = process_logits(rows, params)  # logit_bias (the only row-independent processor)
    dead: set[int] = set()  # requests whose grammar allows nothing at their first row
    if masks is not None and any(m is not None for m in masks):
        allowed = torch.ones_like(proc, dtype=torch.bool)
        row = 0
        for r, (d, m) in enumerate(zip(drafts, masks, strict=True)):
            if m is not None:
                allowed[row:row + len(d) + 1] = m
                if not bool(m[0].any()):
                    dead.add(r)
                    allowed[row:row + len(d) + 1] = True
            row += len(d) + 1
        proc = proc.masked_fill(~allowed, float("-inf"))
    targets = proc.argmax(dim=-1)
    rnd = [i for i, p in enumerate(params) if not p.greedy]
    probs = None
    if rnd:
        probs = params_probs(proc[rnd], [params[i] for i in rnd], inplace=True)
    where = {row: j for j, row in enumerate(rnd)}  # row -> its row in probs
    ok, best = finite.tolist(), targets.tolist()
    out: list[list[SampledToken] | str] = []
    row = 0
    for r, (req, d) in enumerate(zip(reqs, drafts, strict=True)):
        n = len(d) + 1
        mine = range(row, row + n)
        row += n
        if any(ok[i] < 0 for i in mine):
            out.append("non-finite logits")
            continue
        if r in dead:
            out.append("structured output: the grammar allows no token here")
            continue
        try:
            picks = (_greedy(d, best[mine.start:mine.stop]) if req.params.greedy else
                     _rejection(d, probs, [where[i] for i in mine], req.generator))
            k = req.params.logprobs
            lps = (logprob_dicts(rows[mine.start:mine.start + len(picks)], picks, k)
                   if k is not None else [None] * len(picks))
            out.append([SampledToken(t, lp) for t, lp in zip(picks, lps, strict=True)])
        except Exception as exc:  # this request fails alone
            out.append(f"verification failed: {type(exc).__name__}: {exc}")
    return out


def _greedy(drafts: Sequence[int], best: Sequence[int]) -> list[int]:
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return [*drafts[:a], best[a]]


def _rejection(drafts: Sequence[int], probs: torch.Tensor | None, rows: Sequence[int],
               gen: torch.Generator) -> list[int]:
    assert probs is not None
    k = len(drafts)
    if k:
        p_draft = probs[list(rows[:k]), list(drafts)].tolist()
        u = torch.rand(k, generator=gen, dtype=torch.float64).tolist()
    a = 0
    while a < k and u[a] < p_draft[a]:
        a += 1
    dist = probs[rows[a]]
    if a < k:  # the residual max(0, p - q) of a point-mass draft: p without the draft token
        dist = dist.clone()
        dist[drafts[a]] = 0.0
    return [*drafts[:a], int(draw(dist[None], [gen])[0])]
