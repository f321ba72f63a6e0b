"""Scheduler: budgets, chunked prefill, FCFS admission, preemption by recompute, abort.

The "model" here is a pure function of the token prefix (no tensors), so that every schedule can
be replayed against the request run alone; the end-to-end tests with the real model are in
test_engine_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedhybrid.engine.core.pages import BlockPool
from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedhybrid.engine.core.states import StatePool
from pagedhybrid.engine.sample.sampler import SampledToken, SamplingParams
from pagedhybrid.errors import CapacityError

VOCAB = 50


def next_token(prefix: list[int]) -> int:
    return (sum(prefix) * 31 + 7 * len(prefix)) % VOCAB


def alone(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    toks = list(prompt)
    while True:
        t = next_token(toks)
        toks.append(t)
        out = len(toks) - len(prompt)
        if t in params.stop_token_ids or out >= params.max_tokens or len(toks) >= max_model_len:
            return toks[len(prompt):]


def make_request(rid: str, prompt: list[int], params: SamplingParams, arrival: int) -> Request:
    return Request(rid, tuple(prompt), params, arrival, torch.Generator())


class Runner:
    """Drives a scheduler with ``next_token`` and checks each step's batch."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_seqs: int,
                 budget: int, max_model_len: int | None = None) -> None:
        self.blocks, self.states = BlockPool(num_blocks, block_size), StatePool(num_slots)
        mml = max_model_len or num_blocks * block_size
        self.sched = Scheduler(SchedulerConfig(max_seqs, budget, mml), self.blocks, self.states)
        self.computed: dict[str, int] = {}  # what the "KV" of each request really holds
        self.finished: dict[str, Request] = {}

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        cfg = self.sched.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.sequences) <= cfg.max_num_seqs
        for rid in out.preempted:
            self.computed[rid] = 0
        seen_pages: set[int] = set()
        slots = [s.slot for s in out.sequences]
        assert len(set(slots)) == len(slots)
        sampled = {}
        for s in out.sequences:
            req = s.request
            assert s.num_new_tokens >= 1
            # chunks are contiguous: each starts where the request's KV ends
            assert s.start == self.computed.get(req.request_id, 0) == req.num_computed_tokens
            assert s.start + s.num_new_tokens <= req.num_tokens
            assert len(s.block_table) * self.blocks.block_size >= s.start + s.num_new_tokens
            assert seen_pages.isdisjoint(s.block_table)
            seen_pages.update(s.block_table)
            assert s.slot == self.states.slot(req.request_id)
            self.computed[req.request_id] = s.start + s.num_new_tokens
            if s.samples:
                sampled[req.request_id] = [SampledToken(next_token(req.token_ids), None)]
        for req in self.sched.update(out, sampled):
            self.finished[req.request_id] = req
        self.sched.check_invariants()
        return out

    def drain(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.sched.alloc.idle


def test_chunked_prefill_and_mixed_steps() -> None:
    r = Runner(num_blocks=64, block_size=16, num_slots=4, max_seqs=4, budget=32)
    p = SamplingParams(temperature=0.0, max_tokens=3)
    r.sched.add(make_request("short", [1, 2, 3], p, 0))
    out = r.step()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.sequences] == [
        ("short", 3, True)]
    r.sched.add(make_request("long", list(range(70)), p, 1))
    out = r.step()  # decode of "short" + first chunk of "long" in one packed step
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.sequences] == [
        ("short", 1, True), ("long", 31, False)]
    out = r.step()
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.sequences] == [
        ("short", 4, 1), ("long", 31, 31)]
    assert "short" in r.finished and r.finished["short"].finish_reason == "length"
    out = r.step()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples)
            for s in out.sequences] == [("long", 62, 8, True)]
    r.drain()
    assert r.finished["long"].output_token_ids == alone(list(range(70)), p, 64 * 16)


def test_max_num_seqs_and_fcfs() -> None:
    r = Runner(num_blocks=64, block_size=16, num_slots=8, max_seqs=2, budget=100)
    p = SamplingParams(temperature=0.0, max_tokens=2)
    for i in range(4):
        r.sched.add(make_request(f"r{i}", [i + 1] * 5, p, i))
    out = r.step()
    assert [s.request.request_id for s in out.sequences] == ["r0", "r1"]
    r.drain()
    assert sorted(r.finished) == ["r0", "r1", "r2", "r3"]


def test_slots_limit_admission() -> None:
    r = Runner(num_blocks=64, block_size=16, num_slots=1, max_seqs=8, budget=100)
    p = SamplingParams(temperature=0.0, max_tokens=3)
    r.sched.add(make_request("a", [1, 2], p, 0))
    r.sched.add(make_request("b", [3, 4], p, 1))
    out = r.step()
    assert [s.request.request_id for s in out.sequences] == ["a"]
    assert r.states.num_free == 0 and [q.request_id for q in r.sched.waiting] == ["b"]
    r.drain()
    assert r.finished["b"].output_token_ids == alone([3, 4], p, 64 * 16)


def test_preemption_by_recompute_keeps_generated_tokens() -> None:
    # 4 pages of 16 tokens; two requests that each grow to 40 tokens cannot both fit.
    r = Runner(num_blocks=4, block_size=16, num_slots=2, max_seqs=2, budget=64)
    p = SamplingParams(temperature=0.0, max_tokens=25)
    ra, rb = [5] * 15, [9] * 15
    r.sched.add(make_request("a", ra, p, 0))
    r.sched.add(make_request("b", rb, p, 1))
    preempted = []
    while r.sched.has_unfinished():
        out = r.step()
        preempted += out.preempted
        if out.preempted:
            victim = r.sched.waiting[0]
            assert victim.request_id == "b" and victim.num_computed_tokens == 0
            assert victim.num_output_tokens > 0  # generated tokens are kept
            assert not r.blocks.has("b") and not r.states.has("b")
    assert preempted  # the budget really forced it
    assert r.finished["a"].num_preemptions == 0
    assert r.finished["b"].num_preemptions >= 1
    assert r.finished["a"].output_token_ids == alone(ra, p, 64)
    assert r.finished["b"].output_token_ids == alone(rb, p, 64)
    assert r.sched.alloc.idle


def test_request_longer_than_pool_is_refused() -> None:
    r = Runner(num_blocks=2, block_size=16, num_slots=1, max_seqs=1, budget=8)
    with pytest.raises(CapacityError, match="no room"):
        r.sched.add(make_request("x", [1] * 32, SamplingParams(), 0))
    r.sched.add(make_request("y", [1] * 31, SamplingParams(temperature=0.0, max_tokens=5), 0))
    r.drain()
    # stops at max_model_len = pool capacity: the KV never needs more than 32 tokens
    assert r.finished["y"].finish_reason == "length" and r.finished["y"].num_tokens == 32
    with pytest.raises(CapacityError, match="KV"):
        Scheduler(SchedulerConfig(1, 8, 40), BlockPool(2, 16), StatePool(1))


def test_abort_frees_immediately() -> None:
    r = Runner(num_blocks=16, block_size=16, num_slots=2, max_seqs=2, budget=8)
    p = SamplingParams(temperature=0.0, max_tokens=50)
    r.sched.add(make_request("pre", [1] * 40, p, 0))
    r.sched.add(make_request("dec", [2] * 3, p, 1))
    r.step()  # "pre" takes the whole budget: mid-prefill
    assert r.blocks.has("pre") and 0 < r.sched.requests["pre"].num_computed_tokens < 40
    req = r.sched.abort("pre")
    assert req is not None and req.finish_reason == "abort"
    assert not r.blocks.has("pre") and not r.states.has("pre")
    r.sched.check_invariants()
    for _ in range(3):
        r.step()
    assert r.sched.requests["dec"].num_output_tokens > 0  # mid-decode
    r.sched.abort("dec")
    assert r.sched.alloc.idle and not r.sched.has_unfinished()
    assert r.sched.abort("dec") is None


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps on tiny pools; replay every finished request alone."""

    @initialize(bs=st.sampled_from([16, 32]), blocks=st.integers(3, 8), slots=st.integers(1, 3),
                seqs=st.integers(1, 4), budget=st.integers(1, 48))
    def setup(self, bs: int, blocks: int, slots: int, seqs: int, budget: int) -> None:
        self.r = Runner(blocks, bs, slots, seqs, budget)
        self.n = 0
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}

    @rule(length=st.integers(1, 70), max_tokens=st.integers(1, 30),
          stop=st.sets(st.integers(0, VOCAB - 1), max_size=2))
    def add(self, length: int, max_tokens: int, stop: set[int]) -> None:
        rid = f"q{self.n}"
        prompt = [(self.n * 13 + j * 7) % VOCAB for j in range(length)]
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(stop))
        try:
            self.r.sched.add(make_request(rid, prompt, p, self.n))
        except CapacityError:
            assert length >= self.r.sched.config.max_model_len
            return
        finally:
            self.n += 1
        self.prompts[rid] = (prompt, p)

    @rule(k=st.integers(1, 4))
    def steps(self, k: int) -> None:
        for _ in range(k):
            self.r.step()

    @precondition(lambda self: bool(self.r.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.r.sched.requests)))
        self.r.sched.abort(rid)
        self.prompts.pop(rid)
        self.r.sched.check_invariants()

    @invariant()
    def pools_balanced(self) -> None:
        if hasattr(self, "r"):
            self.r.sched.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "r"):
            return
        self.r.drain()
        mml = self.r.sched.config.max_model_len
        for rid, (prompt, p) in self.prompts.items():
            assert self.r.finished[rid].output_token_ids == alone(prompt, p, mml), rid


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_eos_stops_unless_ignored() -> None:
    blocks, states = BlockPool(8, 16), StatePool(2)
    sched = Scheduler(SchedulerConfig(2, 64, 128), blocks, states, eos_token_ids=(7, 9))
    sched.add(make_request("eos", [1, 2], SamplingParams(temperature=0.0, max_tokens=5), 0))
    sched.add(make_request("ign", [1, 2], SamplingParams(temperature=0.0, max_tokens=5,
                                                          ignore_eos=True), 1))
    out = sched.schedule()
    done = sched.update(out, {"eos": [SampledToken(9, None)], "ign": [SampledToken(9, None)]})
    assert [r.request_id for r in done] == ["eos"] and done[0].finish_reason == "stop"
    assert done[0].output_token_ids == [9]  # the stop token is part of the output
    assert not blocks.has("eos") and not states.has("eos")
    for _ in range(4):
        out = sched.schedule()
        done = sched.update(out, {"ign": [SampledToken(7, None)]})
    assert [(r.request_id, r.finish_reason, r.num_output_tokens) for r in done] == [
        ("ign", "length", 5)]
    assert sched.alloc.idle
