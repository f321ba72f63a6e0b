"""The draft budget: which drafts pay for their rows.

Speculation turns itself down where it does not pay (``DraftBudget``): the engine models a
step's time as ``a + b * rows``, plus ``v`` when any request verifies drafts (the verify path's
own cost: capture, rejection sampling, the commit), fitted robustly on its recent steps of
decodes and verify chunks only (a prefill chunk's rows run another path at another cost),
without the drafter's own time; each request's ``j``-th draft is accepted with probability
``p^j`` (``p``: its accepted drafts over accepted plus rejections so far, after a prior worth
two judgements: the engine's recent acceptance over every request, 0.9 before any -- so that a
newcomer is judged by what drafts have been worth lately, and its own acceptance is learnt).
Opening draft position ``j`` costs its ``position_costs[j]`` once (the MTP head's catch-up and
chain steps), the first draft of a step ``v``, each draft row ``b``. The budget
adds drafts likeliest first (a request's ``j``-th after its earlier ones) and keeps the prefix
whose expected tokens per second of step time is highest, where that beats no drafts by
``MARGIN`` (10%: the linear model misjudges the larger row counts, whose products change form
-- measured: batch-4 n-gram steps at 0.79x where it promised 3% more): on a weights-bound step
(``a`` >> ``b * rows``, a small batch) a good guesser's drafts are kept; on a compute-bound one
(a large batch: each row costs about what a token is worth) none are, and neither are the
drafts of a request whose guesses keep failing. The fit needs ``MIN_SPREAD`` recent steps of
each kind (one noisy step is no fit), and ``MIN_SPREAD`` off the most common row counts for its
slope -- until then the verify steps' extra time over the decode steps' is charged to their
extra rows; the last ``MIN_SPREAD`` steps of each kind and row count stay usable ``REMEMBER``
steps. The model is trusted up to twice the widest verify step it was fitted on (or one
request's drafts more): a wider step is taken only after a narrower one was measured. Without
enough decode steps (a lone request verifying every step) one step in ``PROBE_EVERY`` runs
without drafts (the MTP head skips its catch-up there); without enough verify steps only the
likeliest request's drafts are kept (a scout: one request's rows, not the whole batch's); and
one step in ``EXPLORE`` the request whose drafts were cut longest (``EXPLORE`` steps at least)
keeps them once -- where they would pay if every one were accepted -- so that a request whose
guesses got better (n-gram lookup once the text repeats) is measured again. (Before this model,
at T = 0.7 the built-in model's MTP head ran a lone stream at 0.70x: the budget had no fit and
kept every draft; before the scout, the reach and the one-request re-check, a batch of 16
verified every request's drafts whenever the fit lapsed or a re-check came round: MTP at batch
16 ran at 0.90-0.96x.)
``adaptive: false`` (``SpeculativeConfig``, our key) verifies every draft.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from pagedhybrid.engine.core.request import Request


class DraftBudget:
    """Which drafts pay for their rows (module docstring)."""

    WINDOW = 64  # recent steps the cost model is fitted on
    MIN_SPREAD = 4  # steps off the most common row counts needed for a slope
    REMEMBER = 256  # steps the last MIN_SPREAD steps of each kind and row count stay usable
    PROBE_EVERY = 4  # without a recent decode step, one step in this many runs without drafts
    PRIOR = (1.8, 2.0)  # (accepted, judgements) before any verdict: p = 0.9
    DECAY = 0.98  # the engine's recent verdicts: each step's weight decays by this
    MARGIN = 1.1  # drafts are kept where the model promises at least this much more per second
    REFIT = 4  # steps between fits
    EXPLORE = 32  # a request whose drafts were cut this many steps in a row keeps them once,
    # on the next step whose count is a multiple of this (all such requests on the same step)

    def __init__(self) -> None:
        self.count = 0  # steps observed
        self.steps: deque[tuple[int, int, bool, float]] = deque(maxlen=self.WINDOW)
        self.kept: dict[tuple[bool, int], deque[tuple[int, int, bool, float]]] = {}
        self._probed = 0  # the step count at the last probe
        self.verdicts = (0.0, 0.0)  # recent (accepted drafts, judgements), decayed
        self._fit: tuple[int, tuple[float, float, float] | None] | None = None  # (count, fit)
        self._widest = 0  # the most rows of a verify step the fit has seen

    def observe(self, rows: int, seconds: float, verifying: bool) -> None:
        """A step of ``rows`` token rows took ``seconds``; ``verifying``: it verified drafts."""
        self.count += 1
        step = (self.count, rows, verifying, seconds)
        self.steps.append(step)
        self.kept.setdefault((verifying, rows), deque(maxlen=self.MIN_SPREAD)).append(step)

    def _samples(self, verifying: bool) -> list[tuple[int, float]]:
        first = self.steps[0][0] if self.steps else self.count + 1
        older = [s for (kind, _), q in self.kept.items() if kind == verifying for s in q
                 if s[0] < first and self.count - s[0] < self.REMEMBER]
        return [(r, t) for _, r, kind, t in (*older, *self.steps) if kind == verifying]

    def fit(self) -> tuple[float, float, float] | None:
        """``(a, b, v)`` of ``seconds ~ a + b * rows (+ v when verifying)``, robustly: each
        kind's median time at its most common row count, and the median slope of the other
        steps from those (one slow call cannot tilt it; 0 with fewer than ``MIN_SPREAD``);
        None without recent steps of both kinds. Refitted every ``REFIT`` steps (a fit costs
        ~50 us of python: 2-3% of a small model's decode step)."""
        if self._fit is None or self.count - self._fit[0] >= self.REFIT:
            self._fit = (self.count, self._refit())
        return self._fit[1]

    def _refit(self) -> tuple[float, float, float] | None:
        kinds = [self._samples(False), self._samples(True)]
        if min(len(k) for k in kinds) < self.MIN_SPREAD:  # (one noisy step is no fit)
            return None
        self._widest = max(r for r, _ in kinds[1])
        bases, slopes = [], []
        for samples in kinds:
            counts: dict[int, int] = {}
            for r, _ in samples:
                counts[r] = counts.get(r, 0) + 1
            r0 = max(counts, key=lambda r: counts[r])
            base = statistics.median(t for r, t in samples if r == r0)
            bases.append((r0, base))
            slopes += [(t - base) / (r - r0) for r, t in samples if r != r0]
        (rd, td), (rv, tv) = bases
        if len(slopes) >= self.MIN_SPREAD:
            b = max(0.0, statistics.median(slopes))
        else:  # no spread: the verify steps' extra time is charged to their extra rows
            b = max(0.0, (tv - td) / (rv - rd)) if rv != rd else 0.0
        a = max(td - b * rd, 0.0)
        return a, b, max(tv - b * rv - a, 0.0)

    def judge(self, accepted: int, rejected: bool) -> None:
        """A verify chunk kept ``accepted`` drafts and (``rejected``) then refused one."""
        self.verdicts = (self.DECAY * self.verdicts[0] + accepted,
                         self.DECAY * self.verdicts[1] + accepted + rejected)

    def acceptance(self, req: Request) -> float:
        """The request's draft acceptance probability so far, after a prior worth ``PRIOR[1]``
        judgements: the engine's recent acceptance (``judge``), ``PRIOR`` before any."""
        accepted, judged = self.verdicts
        p0 = (accepted + self.PRIOR[0]) / (judged + self.PRIOR[1])
        w = self.PRIOR[1]
        return (req.spec_accepted + w * p0) / (req.spec_accepted + req.spec_rejections + w)

    def trim(self, requests: Sequence[Request], rows: int,
             position_costs: Sequence[float] = ()) -> None:
        """Cut each request's ``draft_ids`` to the drafts that pay on a step of ``rows`` other
        rows (module docstring). ``position_costs[j]``: seconds that opening draft position
        ``j`` adds to the step whatever the number of requests using it (the MTP drafter's
        catch-up for the first, a chain step for each further one); the first request kept at
        a position pays it."""
        if not requests:
            return
        fit = self.fit()
        if fit is None:
            probe = len(self._samples(False)) < self.MIN_SPREAD and \
                self.count - self._probed >= self.PROBE_EVERY
            if probe:
                self._probed = self.count  # a step without drafts: the decode cost
            scout = None if probe else max(requests, key=lambda r: (bool(r.draft_ids),
                                                                    self.acceptance(r)))
            for r in requests:  # (too few verify steps: the likeliest request's drafts kept)
                if r is not scout:
                    r.draft_ids = ()
            return
        a, b, v = fit
        n, t = float(rows), a + b * rows
        p = {id(r): self.acceptance(r) for r in requests}
        items = sorted(((p[id(r)] ** (j + 1), j, i) for i, r in enumerate(requests)
                        for j in range(len(r.draft_ids))), key=lambda x: (-x[0], x[1]))
        rates, opened = [n / t if t > 0 else 0.0], set()
        for gain, j, _ in items:  # the likeliest drafts first, each after its request's earlier
            t += b + (v if len(rates) == 1 else 0.0) + (
                position_costs[j] if j < len(position_costs) and j not in opened else 0.0)
            n += gain
            opened.add(j)
            rates.append(n / t)
        # the model is trusted up to twice the widest recent verify step's rows (or one
        # request's drafts more): a step past them is measured before a wider one is taken
        # (from a scout's 19 rows on a batch of 16 to 38, then 76 -- never from two row counts
        # straight to the whole batch's)
        reach = max(2 * self._widest - rows, max(len(r.draft_ids) for r in requests))
        best = max(range(min(len(rates), reach + 1)), key=rates.__getitem__)  # (ties: fewer)
        if rates[best] < self.MARGIN * rates[0]:  # within the model's error: not worth a risk
            best = 0
        keep = dict.fromkeys(p, 0)
        for _, _, i in items[:best]:
            keep[id(requests[i])] += 1
        for r in requests:
            r.spec_cut = r.spec_cut + 1 if not keep[id(r)] and r.draft_ids else 0
        # one step in EXPLORE re-checks the request cut longest (EXPLORE steps at least), and
        # only where its drafts could pay at all (every one accepted): else re-checking costs
        # a verify step and can change nothing
        due = max(requests, key=lambda r: r.spec_cut)
        d = len(due.draft_ids)
        if self.count % self.EXPLORE == 0 and due.spec_cut >= self.EXPLORE and \
                (rows + d) / (a + b * (rows + d) + v + sum(position_costs[:d])) > rates[0]:
            due.spec_cut = 0  # its drafts run once more: better now?
            keep[id(due)] = d
        for r in requests:
            r.draft_ids = r.draft_ids[:keep[id(r)]]
