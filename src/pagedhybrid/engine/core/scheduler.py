"""Continuous-batching scheduler over two pools: KV pages and state slots.

Per step, with a token budget ``max_num_batched_tokens`` (vLLM v1 style, no phases):

1. RUNNING requests in admission order. Each gets ``n = min(uncomputed tokens, budget left)``
   (1 for a decode, a chunk for an unfinished prefill). If its table cannot grow to
   ``computed + n`` tokens, the newest running request is preempted by recompute (pages and
   slot returned, cursor reset to 0, generated tokens kept, put back at the FRONT of the waiting
   queue) until it fits; if the victim is the request itself, the pass stops.
2. If nothing was preempted this step, WAITING requests in FCFS order while the budget and
   ``max_num_seqs`` allow: admission takes pages for the first chunk AND a state slot
   atomically (both or neither); the first request that cannot be admitted stops admission
   (no overtaking).

Prefill chunks and decodes share one packed step. Speculative decoding: a decoding request with
``draft_ids`` gets a verify chunk (its last token and the drafts, cut to the budget, its pages,
``max_model_len`` and ``max_tokens``; drafts are dropped before anything is preempted for them);
``update`` appends the tokens the runner kept and hands the commit of the accepted tokens' states
-- with the checkpoints inside them, planned now that their tokens are known -- to ``commit``
(``speculative.py``). A request whose KV need (``max_model_len - 1``
tokens) exceeds the whole pool is refused at ``add`` with ``CapacityError``; any admissible
request eventually runs because the oldest running request is never a victim.

Invariant after every step, per pool: free + owned (+ cached, with prefix caching) ==
capacity, exactly the RUNNING requests own pages and a slot, and no running request's next
write lands in a shared or cached page.

Hybrid prefix caching (``HybridAllocator``; on unless ``enable_prefix_caching=False``):

* **Hash chain.** A full KV page's hash is a stable 64-bit hash of (parent page's hash, its
  tokens, extra key) from the first page on (``pages.page_hash``; the extra key is
  ``EngineConfig.prefix_cache_key``, e.g. a model or adapter id). A request's page hashes are
  kept with it and extended as its tokens grow. After each step the request's full computed
  pages are indexed by hash (``BlockPool.register_full``); only full pages are ever shared, so a
  request's last partial page is private and shared pages are never written (no copy on write).
* **State checkpoints.** A Gated DeltaNet layer's state after a prefix cannot be rebuilt from KV
  pages, so the linear layers' conv + recurrent states are saved every ``interval`` tokens (a
  multiple of the page size) into a separate checkpoint pool, keyed by the hash of the page
  ending there (``states.CheckpointPool``). The scheduler plans, per scheduled chunk, the
  checkpoint positions inside it (``plan_checkpoints``); the step metadata carries them and the
  kernels emit them without a second pass and without extra chunks: the chunked WY kernel phase
  shifts a sequence's chunks so that one ends at each checkpoint and copies the state there,
  the conv takes the window of its last K-1 inputs, and a position at the end of a chunk
  (prefill chunk ends, decode steps crossing a boundary) is a copy of the slot after the update.
  So a conversation's own answers become reusable prefixes.
* **Hit rule.** At admission (first or after preemption), the longest run of cached pages is
  found by walking the chain (each page verified by its tokens and parent page, so a hash
  collision cannot hand out another prefix); then, from the end of that run down, the first
  interval position that has a checkpoint is the hit -- the longest prefix with both, never
  zero while a shorter joint hit exists. At most ``num_tokens - 1`` tokens hit (the last token
  is recomputed for its logits). The hit's pages are shared (reference counted), the checkpoint
  is copied into the request's slot before its first step, and it starts at the hit position.
* **Eviction.** A released hashed page whose count reaches 0 becomes *cached* (LRU); pages are
  taken from the free list first and evict the least recently used cached page only when none
  is free. Checkpoint rows are evicted LRU when a new checkpoint needs a row (never a row a hit
  reads this step); a checkpoint of a failed request is discarded, never cached.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pagedhybrid.engine.core.pages import BlockPool, chain_hashes
from pagedhybrid.engine.core.request import FinishReason, Request, RequestStatus
from pagedhybrid.engine.core.states import CheckpointPool, StatePool
from pagedhybrid.engine.sample.sampler import SampledToken
from pagedhybrid.errors import CapacityError, ContractViolation


class Hit(NamedTuple):
    """A prefix-cache hit: the first ``tokens`` tokens are served by ``pages`` and the state
    checkpoint in row ``checkpoint`` (``tokens == 0``: a miss)."""

    tokens: int
    pages: list[int]
    checkpoint: int | None


@dataclass
class PrefixStats:
    queries: int = 0  # admissions looked up
    hits: int = 0  # admissions with a hit
    query_tokens: int = 0  # tokens of the looked-up sequences
    hit_tokens: int = 0  # tokens served from the cache
    checkpoints_written: int = 0


class HybridAllocator:
    """KV pages and state slots taken and returned together, plus (prefix caching) the lookup
    of a new request's longest cached prefix and the plan of this step's state checkpoints.

    Hit rule: the longest prefix whose KV pages are all cached (verified page by page) AND that
    has a state checkpoint at its end; checkpoints sit every ``interval`` tokens, so the search
    walks down from the longest KV hit one interval at a time and takes the first position with
    a checkpoint (never zero while a shorter joint hit exists). At most ``num_tokens - 1``
    tokens hit, so the last token is always recomputed (its logits are needed). A request
    whose prompt logprobs are not all known yet reads no cached prefix (as vLLM's
    ``prompt_logprobs`` requests skip it): a hit's tokens are not computed, so their logprobs
    would never be.
    """

    def __init__(self, blocks: BlockPool, states: StatePool,
                 checkpoints: CheckpointPool | None = None, interval: int = 0,
                 extra_key: object = None) -> None:
        self.blocks, self.states, self.checkpoints = blocks, states, checkpoints
        self.interval, self.extra_key = interval, extra_key
        self.stats = PrefixStats()

    @property
    def caching(self) -> bool:
        return self.checkpoints is not None

    def page_hashes(self, req: Request) -> list[int]:
        req.page_hashes = chain_hashes(req.token_ids, self.blocks.block_size, self.extra_key,
                                       req.page_hashes)
        return req.page_hashes

    def lookup(self, req: Request) -> Hit:
        if self.checkpoints is None or (req.params.prompt_logprobs is not None
                                        and not req.prompt_logprobs_done):
            return Hit(0, [], None)
        hashes = self.page_hashes(req)
        pages = self.blocks.lookup(hashes, req.token_ids)
        bs = self.blocks.block_size
        pos = min(len(pages) * bs, req.num_tokens - 1) // self.interval * self.interval
        while pos > 0:
            row = self.checkpoints.find(hashes[pos // bs - 1])
            if row is not None:
                return Hit(pos, pages[:pos // bs], row)
            pos -= self.interval
        return Hit(0, [], None)

    def admit(self, req: Request, budget: int) -> tuple[int, Hit, int] | None:
        """Take a slot and the pages of the (hit prefix +) first chunk, or nothing; returns
        (slot, hit, tokens to compute now)."""
        if self.states.num_free == 0:
            return None
        rid = req.request_id
        hit = self.lookup(req)
        n = min(req.num_tokens - hit.tokens, budget)
        if hit.pages:
            self.blocks.share(rid, hit.pages)
        if not self.blocks.grow(rid, hit.tokens + n):
            self.blocks.release(rid)
            return None
        slot = self.states.acquire(rid)
        assert slot is not None
        if self.checkpoints is not None:
            self.stats.queries += 1
            self.stats.query_tokens += req.num_tokens
            if hit.checkpoint is not None:
                self.checkpoints.pin(hit.checkpoint)
                self.stats.hits += 1
                self.stats.hit_tokens += hit.tokens
        return slot, hit, n

    def plan_checkpoints(self, req: Request, start: int, n: int) -> tuple[tuple[int, int], ...]:
        """(offset in the chunk, checkpoint row) for each checkpoint position in
        ``(start, start + n]`` that has no checkpoint yet and gets a row."""
        if self.checkpoints is None:
            return ()
        out = []
        hashes = self.page_hashes(req)
        bs = self.blocks.block_size
        first = (start // self.interval + 1) * self.interval
        for pos in range(first, start + n + 1, self.interval):
            row = self.checkpoints.reserve(hashes[pos // bs - 1])
            if row is not None:
                out.append((pos - start, row))
        self.stats.checkpoints_written += len(out)
        return tuple(out)

    def computed(self, req: Request) -> None:
        """``req`` advanced: index its full pages (prefix caching)."""
        if self.checkpoints is not None:
            self.blocks.register_full(req.request_id, self.page_hashes(req), req.token_ids,
                                      req.num_computed_tokens)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks.grow(request_id, num_tokens)

    def release(self, request_id: str) -> None:
        self.blocks.release(request_id)
        self.states.release(request_id)

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        self.states.check_invariants()
        if self.checkpoints is not None:
            self.checkpoints.check_invariants()

    @property
    def idle(self) -> bool:
        return (self.blocks.num_free == self.blocks.capacity
                and self.states.num_free == self.states.capacity)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    lookahead: int = 0  # page positions reserved past a sampling chunk when free (MTP chains)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ContractViolation("SchedulerConfig", name, "must be an int >= 1", v)
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ContractViolation("SchedulerConfig", "lookahead", "must be an int >= 0",
                                    self.lookahead)


class ScheduledSequence(NamedTuple):
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``.

    ``restore``: a prefix hit's checkpoint row, copied into the slot before the step (the
    request starts at ``start`` = the hit length). ``checkpoints``: (offset, row) -- the state
    after ``start + offset`` tokens is saved into checkpoint row ``row`` during the step."""

    request: Request
    start: int
    num_new_tokens: int
    slot: int
    block_table: tuple[int, ...]
    samples: bool  # the chunk reaches the last known token: its last row's logits are sampled
    restore: int | None = None
    checkpoints: tuple[tuple[int, int], ...] = ()
    drafts: tuple[int, ...] = ()  # speculative: the chunk is the last token and these drafts


class Commit(NamedTuple):
    """A verify chunk's outcome: the first ``count`` tokens of ``request``'s chunk are kept
    (its last token and the accepted drafts), their states go into state slot ``slot``, with
    checkpoint row ``row`` saved after ``offset`` of them for each ``(offset, row)``;
    ``proposed`` drafts were verified and ``accepted`` of them kept."""

    request: Request
    slot: int
    count: int
    proposed: int
    accepted: int
    checkpoints: tuple[tuple[int, int], ...]


class SchedulerOutput(NamedTuple):
    sequences: tuple[ScheduledSequence, ...]
    preempted: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, blocks: BlockPool, states: StatePool,
                 eos_token_ids: Iterable[int] = (), checkpoints: CheckpointPool | None = None,
                 checkpoint_interval: int = 0, extra_key: object = None) -> None:
        kv_need = config.max_model_len - 1
        if blocks.blocks_for(kv_need) > blocks.capacity:
            raise CapacityError(
                f"max_model_len {config.max_model_len} needs {blocks.blocks_for(kv_need)} KV "
                f"pages but the pool has {blocks.capacity}")
        self.config = config
        self.alloc = HybridAllocator(blocks, states, checkpoints, checkpoint_interval, extra_key)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.failed: list[Request] = []  # finished with an error by schedule/update, unreported

    # -- request lifecycle ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ContractViolation("Scheduler", "request_id", "is already in use",
                                    request.request_id)
        n = request.num_prompt_tokens
        if n >= self.config.max_model_len:
            raise CapacityError(
                f"request {request.request_id!r}: prompt of {n} tokens leaves no room to generate"
                f" (max_model_len {self.config.max_model_len}: KV pool of "
                f"{self.alloc.blocks.capacity} pages x {self.alloc.blocks.block_size} tokens)")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish ``request`` now (any state): pages and slot go back immediately."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.alloc.release(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ----------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.alloc.release(victim.request_id)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _entry(self, req: Request, n: int, slot: int, restore: int | None = None,
               drafts: tuple[int, ...] = ()) -> ScheduledSequence:
        start = req.num_computed_tokens
        ahead = self.config.lookahead
        # it samples: room for a chain, from pages no running request may need this step
        if (ahead and start + n - len(drafts) == req.num_tokens
                and self.alloc.blocks.num_free > len(self.running)):
            self.alloc.grow(req.request_id, min(start + n + ahead, self.config.max_model_len))
        table = tuple(self.alloc.blocks.table(req.request_id))
        if drafts:  # checkpoints inside a verify chunk are planned at its commit
            return ScheduledSequence(req, start, n, slot, table, True, None, (), drafts)
        return ScheduledSequence(req, start, n, slot, table, start + n == req.num_tokens,
                                 restore, self.alloc.plan_checkpoints(req, start, n))

    def _drafts(self, req: Request, budget: int) -> tuple[int, ...]:
        """The drafts a decoding request verifies this step (cut to the budget, max_model_len
        and the tokens it may still generate), taking the pages for them; () when none."""
        if not req.draft_ids or req.num_tokens - req.num_computed_tokens != 1:
            return ()
        room = min(budget - 1, self.config.max_model_len - 1 - req.num_tokens,
                   req.params.max_tokens - req.num_output_tokens - 1)
        drafts = req.draft_ids[:max(room, 0)]
        if drafts and not self.alloc.grow(req.request_id, req.num_tokens + len(drafts)):
            return ()
        return drafts

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSequence] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            drafts = self._drafts(req, budget)
            n = len(drafts) + min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.alloc.grow(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.append(self._entry(req, n, self.alloc.states.slot(req.request_id),
                                   drafts=drafts))
            budget -= n
            i += 1
        if not preempted:
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                # the first waiting request that is ready (a grammar still compiling waits)
                req = next((r for r in self.waiting if r.grammar is None), None)
                if req is None:
                    break
                try:
                    admitted = self.alloc.admit(req, budget)
                except Exception as exc:  # this request fails alone; admission goes on
                    self._fail(req, "admission", exc)
                    continue
                if admitted is None:
                    break
                slot, hit, n = admitted
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit.tokens
                if not req.admitted:
                    req.admitted, req.num_cached_tokens = True, hit.tokens
                self.running.append(req)
                out.append(self._entry(req, n, slot, hit.checkpoint))
                budget -= n
        return SchedulerOutput(tuple(out), tuple(preempted))

    def update(self, output: SchedulerOutput, sampled: dict[str, list[SampledToken]],
               commit: Callable[[list[Commit]], None] | None = None) -> list[Request]:
        """Advance cursors after the model ran ``output``; append sampled tokens; finish the
        requests that hit a stop condition; hand verify chunks' accepted states to ``commit``
        (one call for the step, before the step's checkpoints count as cached). Returns the
        requests finished here."""
        finished = []
        commits: list[Commit] = []
        for seq in output.sequences:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted or finished (e.g. error) in between
            try:
                reason = self._advance(seq, sampled.get(req.request_id), commits)
            except Exception as exc:  # this request fails alone; the others advance
                self._fail(req, "bookkeeping", exc)
                continue
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        if commits:
            try:
                assert commit is not None, "a verify step needs a commit"
                commit(commits)
            except Exception as exc:  # their states are not trustworthy: they fail
                for c in commits:
                    if self.alloc.checkpoints is not None:
                        self.alloc.checkpoints.discard(row for _, row in c.checkpoints)
                    if not c.request.finished:
                        self._fail(c.request, "speculative commit", exc)
        if self.alloc.checkpoints is not None:
            self.alloc.checkpoints.commit()
        return finished

    def _advance(self, seq: ScheduledSequence, toks: list[SampledToken] | None,
                 commits: list[Commit]) -> FinishReason | None:
        req = seq.request
        if seq.drafts:
            return self._advance_verified(seq, toks or [], commits)
        req.num_computed_tokens = seq.start + seq.num_new_tokens
        self.alloc.computed(req)
        if not seq.samples or not toks:
            return None
        return req.append(toks[0], self.eos_token_ids, self.config.max_model_len)

    def _advance_verified(self, seq: ScheduledSequence, toks: list[SampledToken],
                          commits: list[Commit]) -> FinishReason | None:
        """A verify chunk: the kept tokens (accepted drafts, then one sampled) appended; its
        last token and the accepted drafts among them computed and committed."""
        req = seq.request
        reason, kept = None, 0
        for tok in toks:
            kept += 1
            reason = req.append(tok, self.eos_token_ids, self.config.max_model_len)
            if reason is not None:
                break
        n = 1 + min(kept, len(toks) - 1)  # the last token and the accepted drafts kept
        req.num_computed_tokens = seq.start + n
        self.alloc.computed(req)
        commits.append(Commit(req, seq.slot, n, len(seq.drafts), len(toks) - 1,
                              self.alloc.plan_checkpoints(req, seq.start, n)))
        return reason

    def _fail(self, req: Request, where: str, exc: Exception) -> None:
        self.finish(req, "error", f"internal error in {where}: {type(exc).__name__}: {exc}")
        self.failed.append(req)

    def take_failed(self) -> list[Request]:
        """Requests that ``schedule`` / ``update`` failed since the last call."""
        out, self.failed = self.failed, []
        return out

    def check_invariants(self) -> None:
        self.alloc.check_invariants()
        running = {r.request_id for r in self.running}
        blocks, states = self.alloc.blocks, self.alloc.states
        owners = blocks.owners() | states.owners()
        if owners != running:
            raise AssertionError(f"owners of pages/slots {sorted(owners)} != running "
                                 f"{sorted(running)}")
        for rid in running:
            if not states.has(rid):
                raise AssertionError(f"running request {rid!r} has no state slot")
        for req in self.running:  # a request's next writes never land in a shared/cached page
            table = blocks.table(req.request_id)
            first = req.num_computed_tokens // blocks.block_size
            for page in table[first:]:
                if blocks.ref_count(page) > 1 or blocks.is_hashed(page):
                    raise AssertionError(f"request {req.request_id!r} would write page {page}, "
                                         "which is shared or cached")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
