"""Prompt lookup (vLLM's ``ngram`` method): drafts from the request's own tokens, no weights.

``NgramProposer`` finds the longest suffix of the request's tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) that occurred before and proposes what followed its latest earlier
occurrence (``NgramIndex``, kept up to date as the tokens grow).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedhybrid.engine.core.config import SpeculativeConfig
from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.spec_decode.proposer import ProposerSpec, register_proposer


class NgramIndex:
    """Per n in ``[lo, hi]``: each n-gram of a token list -> where its latest occurrence ends,
    kept up to date as the list grows (the grams ending at the last token are not indexed, so
    a hit is always an earlier occurrence)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.done = 0  # grams ending before position ``done`` are indexed

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        end = len(tokens)
        for e in range(self.done, end - 1):  # index the grams ending at e (exclusive e + 1)
            for n, table in self.ends.items():
                if e + 1 >= n:
                    table[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        self.done = max(self.done, end - 1)
        for n in range(min(self.hi, end), self.lo - 1, -1):
            at = self.ends[n].get(tuple(tokens[end - n:]))
            if at is not None:  # what followed it; past the end, the same period again
                draft = list(tokens[at:at + k])
                while len(draft) < k:
                    draft.append(draft[len(draft) - (end - at)])
                return tuple(draft)
        return ()


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): no weights, drafts from the request's own
    tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._index: dict[int, tuple[Request, NgramIndex]] = {}  # id(request) -> its index

    def propose(self, requests: Sequence[Request], k: int) -> None:
        c = self.config
        for req in requests:
            entry = self._index.get(id(req))
            if entry is None or entry[0] is not req:
                entry = self._index[id(req)] = (req, NgramIndex(c.prompt_lookup_min,
                                                                c.prompt_lookup_max))
            req.draft_ids = entry[1].lookup(req.token_ids, k)
        for key in [key for key, (r, _) in self._index.items() if r.finished]:
            del self._index[key]


register_proposer(ProposerSpec("ngram", lambda ctx: NgramProposer(ctx.config)))
