"""The runner's persistent input batch (vLLM's ``InputBatch``): one step's plan, packed ABI batch,
metadata and logits rows, updated from each ``SchedulerOutput``.

A step passes three types, each built once: the scheduler's ``SchedulerOutput`` (requests,
chunks, pages, slots) -> ``StepPlan`` (plain ints: what every tensor-parallel rank runs and what
rank 0 reads its logits rows for; pickled once for the other ranks) -> ``StepMetadata`` (the
tensors every layer's kernels read, validated once). The packed ABI batch (``PackedBatch``:
``input_ids[N]``, ``position_ids[3, N]``, ``cu_seqlens[B+1]``, ``past_seqlens[B]``,
``block_table[B, M]``, ``state_slots[B]``, ``attention_metadata[3]``) is a view of the metadata's
tensors and the token ids.

Logits rows: the last row of every chunk that reaches its request's last known token; for
requests that asked for ``prompt_logprobs``, the rows of the prompt positions in the chunk that
predict a prompt token; every row of a speculative verify chunk (its last token and its drafts).

A decode step of the same requests as the last one, one token further on the same pages, is the
last step advanced (``StepMetadata.advance``: the new values written into the persistent
``DecodeInputs`` buffers) rather than built again from the lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.core.scheduler import SchedulerOutput
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.step import DecodeInputs, StepMetadata, int_tensor
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache


class StepPlan(NamedTuple):
    """A step as every tensor-parallel rank runs it (plain ints; ``InputBatch.replay`` turns it
    into the same batch and metadata on every rank), with what rank 0 reads its logits for.

    A decode successor (``write_slots`` given) is the last step's metadata advanced one token,
    writing those flat cache slots; any other step is built from its lists."""

    token_ids: Sequence[int]  # the step's input tokens, packed
    write_slots: Sequence[int] | None = None  # a decode successor's cache slots, one per sequence
    q_lens: Sequence[int] = ()
    starts: Sequence[int] = ()
    tables: Sequence[Sequence[int]] = ()
    slots: Sequence[int] = ()
    checkpoints: Sequence[tuple[int, int, int]] = ()
    verify: Sequence[int] = ()  # sequences whose chunk is a verify chunk
    rows: Sequence[int] | None = None  # token rows whose logits are computed (None: all)
    restores: Sequence[tuple[int, int]] = ()  # (checkpoint row, state slot) before the forward
    sampling: Sequence[int] = ()  # sequences that sample this step (verify chunks aside)
    sample_rows: Sequence[int] = ()  # their positions in ``rows``
    # prompt-logprob rows: (sequence, first position, row, count): logits rows
    # [row, row + count) score prompt tokens first + 1 ... first + count
    prompt_spans: Sequence[tuple[int, int, int, int]] = ()
    verify_rows: Sequence[tuple[int, int]] = ()  # verify chunks: (sequence, first row in rows)


class InputBatch:
    """The current step over ``cache`` (module docstring): ``plan``, ``batch``, ``meta``,
    ``rows`` (int64 ``[R]``, None: every row) and, on rank 0, its ``requests`` in batch order;
    ``advanced`` says whether it was advanced from the last step, ``built`` whether there is a
    step yet. ``persistent=False`` builds every step from its lists."""

    plan: StepPlan
    batch: PackedBatch
    meta: StepMetadata
    rows: torch.Tensor | None

    def __init__(self, cache: PagedHybridCache, device: str = "cpu", max_num_seqs: int = 0,
                 persistent: bool = True) -> None:
        self.cache, self.device, self.persistent = cache, device, persistent
        self.inputs = (DecodeInputs(max_num_seqs)
                       if max_num_seqs and torch.device(device).type == "cpu" else None)
        self.requests: tuple[Request, ...] = ()
        self.advanced = self.built = False

    # -- rank 0 ----------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput) -> StepPlan:
        """The step of ``output``: advanced from the last one where it is its decode successor
        (vLLM's persistent batch: no lists walked, nothing validated again), else built from the
        scheduler's lists (and validated once)."""
        reqs = tuple(s.request for s in output.sequences)
        write = self._successor_writes(output) if self.persistent else None
        meta = None if write is None else self.meta.advance(write, self.inputs)
        if meta is not None and write is not None:
            ids = [r.token_ids[p] for r, p in zip(reqs, meta.past_lens, strict=True)]
            last = self.plan
            self.plan = StepPlan(ids, write, sampling=last.sampling,
                                 sample_rows=last.sample_rows)
            self.batch, self.meta = self._advanced(meta, ids), meta
            self.rows, self.requests, self.advanced = None, reqs, True
            return self.plan
        self.plan = _plan(output)
        self._materialize(self.plan)
        self.requests, self.advanced = reqs, False
        return self.plan

    def _successor_writes(self, output: SchedulerOutput) -> list[int] | None:
        """The flat cache slot each sequence writes when ``output`` is the next decode step of
        exactly the last step's requests, in the same order, each sampling its next token with
        nothing else to do (no restore, no checkpoint, no prompt logprobs: a one-token chunk
        that samples is past its prompt); else None."""
        if (not self.built or len(output.sequences) != len(self.requests)
                or len(self.plan.sampling) != len(self.requests) or self.plan.prompt_spans):
            return None  # (a prompt chunk of one token did not sample: its rows differ now)
        bs = self.meta.block_size
        write = []
        for s, r, p in zip(output.sequences, self.requests, self.meta.past_lens, strict=True):
            if (s.request is not r or s.num_new_tokens != 1 or s.start != p + 1
                    or not s.samples or s.restore is not None or s.checkpoints
                    or s.start // bs >= len(s.block_table)):
                return None
            write.append(s.block_table[s.start // bs] * bs + s.start % bs)
        return write

    # -- every rank --------------------------------------------------------------------------------
    def replay(self, plan: StepPlan) -> None:
        """``plan`` (rank 0's) as this rank's step: a successor advances this rank's last step,
        as rank 0 advanced its own; any other step is built from the plan's lists."""
        self.plan = plan
        if plan.write_slots is None:
            self._materialize(plan)
            return
        meta = self.meta.advance(plan.write_slots, self.inputs) if self.built else None
        if meta is None:
            raise ContractViolation("pagedhybrid.engine.StepPlan", "write_slots",
                                    "a decode successor must continue the last step's decodes",
                                    plan.write_slots)
        self.batch, self.meta, self.rows = self._advanced(meta, plan.token_ids), meta, None

    def _materialize(self, plan: StepPlan) -> None:
        cache, device = self.cache, self.device
        self.meta = StepMetadata.build(plan.q_lens, plan.starts, plan.tables, plan.slots,
                                       block_size=cache.block_size, num_pages=cache.num_pages,
                                       num_slots=cache.num_slots, device=device,
                                       checkpoints=plan.checkpoints,
                                       num_checkpoints=cache.num_checkpoints, verify=plan.verify)
        self.rows = None if plan.rows is None else int_tensor(plan.rows, torch.int64, device)
        self.batch = PackedBatch.from_metadata(self.meta, plan.token_ids, device)
        self.built = True

    def _advanced(self, meta: StepMetadata, ids: Sequence[int]) -> PackedBatch:
        """The last packed batch moved to the advanced ``meta`` with the new token ``ids``."""
        top = max(meta.past_lens) + 1
        inputs = self.inputs
        if inputs is not None and len(ids) <= inputs.capacity:
            ids_t, attention, position_ids = inputs.tokens(ids, 1, top)
        else:
            ids_t = int_tensor(ids, torch.int64, self.device)
            attention = int_tensor((1, top, top), torch.int32, self.device)
            position_ids = meta.positions.view(1, -1).expand(3, -1)
        return self.batch._replace(input_ids=ids_t, position_ids=position_ids,
                                   past_seqlens=meta.past_t, attention_metadata=attention)


def _plan(output: SchedulerOutput) -> StepPlan:
    """The plan of a step built from the scheduler's lists: its tokens, lengths, pages, slots,
    checkpoints, restores and logits rows (module docstring)."""
    seqs = output.sequences
    rows: list[int] = []
    sampling, sample_rows, spans, verify_rows = [], [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        req = s.request
        if s.drafts:  # every row of a verify chunk
            verify_rows.append((i, len(rows)))
            rows.extend(range(offset, offset + s.num_new_tokens))
            offset += s.num_new_tokens
            continue
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_done:
            hi = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)  # last scored + 1
            if hi > s.start:
                spans.append((i, s.start, len(rows), hi - s.start))
                rows.extend(range(offset, offset + hi - s.start))
        if s.samples:
            sampling.append(i)
            sample_rows.append(len(rows))
            rows.append(offset + s.num_new_tokens - 1)
        offset += s.num_new_tokens
    every = len(rows) == offset and rows == list(range(offset))  # a decode step: all rows
    return StepPlan(
        [t for s in seqs for t in (
            *s.request.token_ids[s.start:s.start + s.num_new_tokens - len(s.drafts)],
            *s.drafts)],
        None, [s.num_new_tokens for s in seqs], [s.start for s in seqs],
        [s.block_table for s in seqs], [s.slot for s in seqs],
        [(i, off, row) for i, s in enumerate(seqs) for off, row in s.checkpoints],
        [i for i, s in enumerate(seqs) if s.drafts], None if every else rows,
        [(s.restore, s.slot) for s in seqs if s.restore is not None],
        sampling, sample_rows, spans, verify_rows)
