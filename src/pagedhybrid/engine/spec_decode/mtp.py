"""The MTP drafter: draft tokens from the checkpoint's multi-token-prediction head (``mtp.*``).

The head (``models.qwen35.model.MtpHead``) reads, at position ``p``, the main model's final-norm
hidden ``h_p`` and the token ``t_{p+1}`` after it, and predicts ``t_{p+2}``; its one
full-attention layer keeps K/V in its own pool of the cache (layer index ``num_hidden_layers``)
on the sequence's own pages, so it needs no page bookkeeping of its own (vLLM's and ONNX Runtime
GenAI's layout). After every step, ``propose``:

1. catch-up: for every request of the step that is still running, the rows it committed
   (a prefill chunk's, a decode's, a verify chunk's last token and accepted drafts) run
   through the head with the token after each (the next prompt token, an accepted draft or
   the token just sampled), at the same positions and on the same pages -- one packed head
   step for the whole batch (a multi-token chunk past the prompt is marked ``verify``: the head
   has no state rows, and the fused attention layer takes such a step). The head's K/V at every
   committed position are then those of the committed tokens (a rejected draft's are
   overwritten here);
2. chain: for each request to draft for, the head's logits at its last committed row give
   draft ``d1`` (the argmax: a point mass, which ``speculative.verify``'s rejection sampling
   takes as the proposal distribution); then ``k - 1`` one-token head steps feed each draft
   back with the head's own hidden in place of ``h``, one position further on each (their K/V
   lie past the sequence's length: the next catch-up overwrites them). Catch-up and chains are
   one ``MtpCall`` (the native bundle runs them in one C++ call). The scheduler reserves
   ``k - 1`` lookahead positions of pages for that when it can (``SchedulerConfig.lookahead``);
   a chain stops early where the request's pages end.

With the engine's draft budget on (``adaptive``), the budget decides before the head runs how
many drafts each request gets, counting the catch-up's and each chain step's time as costs of
the positions they open: the chain stops at the last position some request keeps, and where no
draft pays (a large, compute-bound batch) the step skips the head altogether -- its K/V at that
step's positions stay stale, which later drafts may pay for in acceptance, never in output; so
does a request whose drafts were all cut on a step where others keep theirs (its catch-up is
skipped: one request re-checked on a batch of 16 catches up one row, not sixteen). A
request with no drafts this step keeps none; one that was not in the step (no new hidden) keeps
the drafts it got when it was, while it still has exactly those tokens. Requests that finished
in the step are skipped. With prefix caching, a hit's pages hold the K/V the head wrote for the
request that computed them; the head's K/V at a page's last position depend on the token after
the page, which a request that shares only the page may not have: its drafts can be worse,
never its output (every draft is verified).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from pagedhybrid.engine.core.request import Request, RequestStatus
from pagedhybrid.engine.spec_decode.proposer import (
    Budget,
    ProposerContext,
    ProposerSpec,
    register_proposer,
)
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.step import StepMetadata


class MtpCall(NamedTuple):
    """The MTP drafter's step as every tensor-parallel rank runs it
    (``ModelRunner.forward_mtp``): the catch-up over ``rows`` of the last step's hidden (with
    ``token_ids``, per sequence ``q_lens`` rows from ``past_lens`` on the pages of ``tables``,
    ``slots`` / ``num_slots`` / ``verify`` as ``StepMetadata.build`` takes them), whose picks at
    catch-up rows ``picks`` are the drafting sequences' first drafts; then each one's chain of
    ``steps`` head steps from ``positions`` on the pages of ``chain_tables``."""

    token_ids: Sequence[int]
    rows: Sequence[int]
    q_lens: Sequence[int]
    past_lens: Sequence[int]
    tables: Any  # int32 [B, M] or lists
    slots: Sequence[int]
    num_slots: int
    verify: Sequence[int]
    picks: Sequence[int]
    positions: Sequence[int]
    steps: Sequence[int]
    chain_tables: Sequence[Sequence[int]]



class DraftHead(Protocol):
    """What the MTP proposer drafts through: the engine's runner (``worker/runner.py``)."""

    cache: Any

    def take_step(self) -> tuple[StepMetadata, tuple[Request, ...]] | None: ...

    def forward_mtp(self, call: MtpCall) -> torch.Tensor: ...


class MtpProposer:
    """Drafts from the model's MTP head over the runner's last step (module docstring);
    ``table(request)`` is the request's current page table. ``budget(requests, costs)``, when
    given, cuts each request's ``draft_ids`` (placeholders, ``k`` of them) before the head runs,
    knowing what each draft position costs whatever the number of requests using it
    (``DraftBudget.trim``'s ``position_costs``: a head step's recent median time each -- the
    catch-up opens the first, a chain step each further one): the chain runs only as far as
    some request keeps drafts, and a step where no draft pays for itself skips the head
    altogether."""

    def __init__(self, runner: DraftHead, table: Callable[[Request], Sequence[int]],
                 budget: Budget | None = None) -> None:
        self.runner, self.table, self.budget = runner, table, budget
        self._drafts: dict[int, tuple[Request, int, tuple[int, ...]]] = {}
        self._head_s: deque[float] = deque(maxlen=32)  # recent times of a head step

    def propose(self, requests: Sequence[Request], k: int) -> None:
        step = self.runner.take_step()
        want = {id(r): k for r in requests}
        if self.budget is not None and requests:
            for r in requests:
                r.draft_ids = (0,) * k  # lengths only: cut by the budget
            cost = statistics.median(self._head_s) if self._head_s else 0.0
            self.budget(requests, [cost] * k)
            want = {id(r): len(r.draft_ids) for r in requests}
        if step is not None and (not requests or any(want.values())):
            self._step(*step, want)
        for req in requests:
            kept = self._drafts.get(id(req))
            ok = kept is not None and kept[0] is req and kept[1] == req.num_tokens
            req.draft_ids = kept[2][:want[id(req)]] if ok and kept is not None else ()
        for key in [key for key, (r, _, _) in self._drafts.items() if r.finished]:
            del self._drafts[key]

    @torch.no_grad()
    def _step(self, meta: StepMetadata, reqs: Sequence[Request], want: dict[int, int]
              ) -> None:
        runner = self.runner
        cache = runner.cache
        t0 = time.perf_counter()
        seqs, qs, rows, ids, drafting = [], [], [], [], []
        for b, req in enumerate(reqs):
            start = meta.past_lens[b]
            n = req.num_computed_tokens - start  # the rows it committed
            if (req.status is not RequestStatus.RUNNING or not 0 < n <= meta.q_lens[b]
                    or len(req.token_ids) <= start + n or want.get(id(req)) == 0):
                continue  # (a request drafted for whose drafts were all cut: no catch-up)
            seqs.append(b)
            qs.append(n)
            rows.extend(range(meta.cu_seqlens[b], meta.cu_seqlens[b] + n))
            ids.extend(req.token_ids[start + 1:start + n + 1])
            if want.get(id(req), 0) and start + n == req.num_tokens - 1:
                drafting.append((req, len(rows) - 1, start + n - 1))  # (request, row, position)
        if not seqs:
            return
        past = [meta.past_lens[b] for b in seqs]
        bs, steps, tables = meta.block_size, [], []
        for req, _, p in drafting:
            table = self.table(req)  # the chain stops where the request's pages end
            steps.append(max(0, min(want[id(req)] - 1, len(table) * bs - 1 - p)))
            tables.append(list(table))
        drafted = runner.forward_mtp(MtpCall(
            ids, rows, qs, past, meta.block_table[seqs],
            [int(meta.state_slots[b]) for b in seqs], cache.num_slots,
            [i for i, (n, p) in enumerate(zip(qs, past, strict=True)) if n > 1 and p > 0],
            [r for _, r, _ in drafting], [p + 1 for _, _, p in drafting], steps,
            tables)).tolist()
        if drafting:  # the budget's position costs: the catch-up and each chain step alike
            self._head_s.append((time.perf_counter() - t0) / (1 + max(steps)))
        chains = [list(itertools.takewhile(lambda t: t >= 0, row)) for row in drafted]
        for (req, _, _), chain in zip(drafting, chains, strict=True):
            self._drafts[id(req)] = (req, req.num_tokens, tuple(chain))


def _build(ctx: ProposerContext) -> MtpProposer:
    if ctx.runner.model.mtp is None:
        raise ContractViolation(
            "speculative_config", "method", "'mtp' needs the checkpoint's MTP head: a "
            "checkpoint with mtp_num_hidden_layers=1 and mtp.* tensors, loaded with "
            "load(..., mtp=True) (load_engine does)", ctx.config.method)
    return MtpProposer(ctx.runner, ctx.table, ctx.budget)


register_proposer(ProposerSpec("mtp", _build, model_head=True, lookahead=lambda k: k - 1,
                               budgets_itself=True))
