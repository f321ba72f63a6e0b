"""Speculative decoding: the configuration, the n-gram drafter and the verification sampler.

``SpeculativeConfig`` follows vLLM's ``speculative_config``: ``method`` (``ngram``: prompt
lookup, below; ``mtp``: the checkpoint's MTP head, ``engine/mtp.py``), ``num_speculative_tokens``
k (1..7: a verify chunk is the last sampled token and k drafts, at most ONNX Runtime's
state-update capacity of 8),
``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram window) and ``disable_by_batch_size``
(no drafts while more requests than that are running; default None, as vLLM's).

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
``adaptive: false`` (our key) verifies every draft.

One step with speculation (engine -> scheduler -> runner -> scheduler):

1. after each step the drafter proposes up to k tokens for every decoding request it may draft
   for (``Drafter.propose`` sets ``Request.draft_ids``): ``NgramDrafter`` finds the longest
   suffix of the request's tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) that
   occurred before and proposes what followed its latest earlier occurrence; ``MtpDrafter``
   chains the MTP head k times from the step's hidden states;
2. the scheduler gives such a request a verify chunk ``[last token, d1 .. dk]`` (drafts cut to
   the token budget, the pages, ``max_model_len`` and ``max_tokens``) in the same packed step as
   every other request's prefill chunk or decode;
3. the runner computes logits for all of the chunk's rows; the linear layers capture their
   compact state updates instead of committing (``kernels/capsule.py``); ``verify`` picks the
   tokens: greedy rows accept drafts while they equal the argmax and then add the argmax (so
   the output is exactly greedy decoding's); random rows accept draft ``d`` at row ``i`` with
   probability ``p_i(d)`` (the draft is a point mass) and, at the first rejection, sample from
   ``p_i`` with ``d`` removed (the residual distribution), else a bonus token from the last
   row -- rejection sampling, so every token has exactly the target distribution ``p`` (the
   request's processed, filtered distribution). Each random verify draws its uniforms (one per
   draft, one for the token it samples: ``sampling.draw``) from the request's own generator,
   so seeded runs repeat;
4. the scheduler appends the tokens, and the runner commits the accepted ones' states
   (``PagedHybridCache.commit_verified``; prefix-cache checkpoints inside them are saved
   there). Attention needs no rollback: a rejected token's K/V rows lie past the sequence's
   length and are overwritten.

Requests with penalties, bad words or ``min_tokens`` still to reach are not drafted for (their
processed logits depend on the tokens before each row); they decode as usual in the same steps.
A request under a grammar (``structured_outputs``) is: its drafts are cut where the grammar
would refuse one (``matcher.validate_tokens``), and each row of its verify chunk is masked by
what the grammar allows after the drafts before it (``structured.draft_masks``: consumed
tentatively, rolled back) -- the same masked distribution plain decoding samples from, so
verification stays exact; the matcher then advances by the tokens kept.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedhybrid.engine.request import Request
from pagedhybrid.engine.sampling import (
    SampledToken,
    draw,
    logprob_dicts,
    params_probs,
    process_logits,
)
from pagedhybrid.errors import ContractViolation, from_mapping
from pagedhybrid.kernels.native.sampling import greedy_rows

MAX_SPECULATIVE_TOKENS = 7  # + the last sampled token = ONNX Runtime's capacity limit of 8
METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` (see the module docstring)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # DraftBudget on (ours, not vLLM's: off = every draft verified)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ContractViolation:
            return ContractViolation("speculative_config", name, rule, getattr(self, name))

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.method not in METHODS:
            raise bad("method", f"must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}]"
                      " (the verify chunk of k + 1 tokens fits a state-update capacity of 8)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not is_int(lo) or lo < 1:
            raise bad("prompt_lookup_min", "must be an int >= 1")
        if not is_int(hi) or hi < lo:
            raise bad("prompt_lookup_max", f"must be an int >= prompt_lookup_min ({lo})")
        d = self.disable_by_batch_size
        if d is not None and (not is_int(d) or d < 1):
            raise bad("disable_by_batch_size", "must be None or an int >= 1")
        if not isinstance(self.adaptive, bool):
            raise bad("adaptive", "must be a bool")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None
           ) -> SpeculativeConfig | None:
        """``value`` as a config: a mapping's unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ContractViolation("EngineConfig", "speculative_config",
                                    "must be a mapping (vLLM's speculative_config) or None",
                                    type(value).__name__)
        return from_mapping(cls, value, "speculative_config")

    @property
    def capacity(self) -> int:
        """Tokens per verify chunk: the last sampled token and the drafts."""
        return self.num_speculative_tokens + 1


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


def draftable(req: Request) -> bool:
    """Whether a request's rows may be verified together (module docstring)."""
    p = req.params
    return not (p.penalized or req.bad_word_ids or req.num_output_tokens < p.min_tokens
                or (p.prompt_logprobs is not None and not req.prompt_logprobs_done))


class Drafter(Protocol):
    """Proposes draft tokens: sets ``req.draft_ids`` (at most ``k``) of decoding requests."""

    def propose(self, requests: Sequence[Request], k: int) -> None: ...


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


class NgramDrafter:
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


def verify(logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]],
           first_rows: Sequence[int],
           masks: Sequence[torch.Tensor | None] | None = None
           ) -> list[list[SampledToken] | str]:
    """The tokens each verify request keeps (module docstring, step 3): request ``r``'s chunk
    has ``len(drafts[r]) + 1`` logits rows from ``first_rows[r]``; ``masks[r]`` (bool
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
