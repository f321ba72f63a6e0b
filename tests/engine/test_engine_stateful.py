"""Randomised schedules on the real engine (hypothesis stateful testing).

Arrivals at random steps, aborts, tiny page and slot budgets that force preemption, unequal
prompt and output lengths, block sizes 16 and 32, pools filled with garbage. After every step
both pool invariants hold; after draining every page and slot is free; every finished request's
greedy tokens equal HF transformers ``generate`` on the same checkpoint (and therefore the
request run alone, which test_engine_e2e.py checks against HF too).

``test_random_schedules_speculative`` runs the same machine with speculative decoding on and a
test drafter that proposes HF's own continuation with each draft token corrupted with a drawn
probability (acceptance forced high or low): the outputs must not change.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import ClassVar

import pytest
from engine_helpers import prompt_of
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedhybrid.engine import Engine, Request, SamplingParams, SequenceOutput
from pagedhybrid.errors import CapacityError

PROMPT_LENGTHS = (1, 7, 18, 33, 50, 64)
PROMPTS = [prompt_of(100 + i, n) for i, n in enumerate(PROMPT_LENGTHS)]
MAX_OUT = 10


class ForcedDrafter:
    """Drafts of a known continuation, each token wrong with probability ``wrong``."""

    def __init__(self, refs: dict[str, list[int]], wrong: float, seed: int) -> None:
        self.refs, self.wrong, self.rng = refs, wrong, random.Random(seed)
        self.proposed = 0

    def propose(self, requests: list[Request], k: int) -> None:
        for r in requests:
            ref = self.refs[r.request_id]
            n = r.num_output_tokens
            self.proposed += 1
            r.draft_ids = tuple((t + 1) % 256 if self.rng.random() < self.wrong else t
                                for t in ref[n:n + k])


class EngineMachine(RuleBasedStateMachine):
    make_engine: Callable[..., Engine]
    hf_greedy: Callable[..., list[int]]
    speculative: ClassVar[bool] = False

    totals: ClassVar[dict[str, int]] = dict.fromkeys(
        ("examples", "steps", "preemptions", "finished", "aborted", "refused", "accepted",
         "rejected"), 0)

    @initialize(bs=st.sampled_from([16, 32]), pages=st.integers(0, 3),
                slots=st.sampled_from([1, 2, 3, 3]), seqs=st.sampled_from([1, 2, 3, 4, 4]),
                budget=st.integers(4, 64),
                first=st.lists(st.tuples(st.integers(2, len(PROMPT_LENGTHS) - 1),
                                         st.integers(1, MAX_OUT)), min_size=2, max_size=4))
    def setup(self, bs: int, pages: int, slots: int, seqs: int, budget: int,
              first: list[tuple[int, int]]) -> None:
        # speculation (SpeculativeMachine): k drafts, each wrong with probability `wrong`, from
        # the draws above and the example's number (no draws of their own: the plain
        # machine's examples stay as they are)
        n = type(self).totals["examples"]
        k, wrong = 1 + budget % 7, (0.0, 0.3, 0.8)[n % 3]
        # from pools too small for the longest prompt (refused at add_request, or stopped at
        # max_model_len) to a few pages more than the longest request needs alone
        need = -(-(max(PROMPT_LENGTHS) + MAX_OUT) // bs)
        spec = {"num_speculative_tokens": k, "adaptive": False} if self.speculative else None
        self.engine = self.make_engine(block_size=bs, num_blocks=max(1, need - 2 + pages),
                                       num_state_slots=slots, max_num_seqs=seqs,
                                       max_num_batched_tokens=budget, cache_fill=None,
                                       speculative_config=spec)
        self.refs: dict[str, list[int]] = {}
        if self.speculative:
            self.engine.drafter = ForcedDrafter(self.refs, wrong, seed=budget)
        self.expected: dict[str, list[int]] = {}
        self.final: dict[str, SequenceOutput] = {}
        self.aborted: set[str] = set()
        self.n = 0
        for which, max_tokens in first:  # requests waiting before the first step
            self.add(which, max_tokens, None)

    def _collect(self, outs: list[SequenceOutput]) -> None:
        for o in outs:
            assert o.request_id not in self.final, "output after finishing"
            if o.finished:
                self.final[o.request_id] = o

    @rule(which=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, MAX_OUT),
          stop_at=st.none() | st.integers(0, MAX_OUT - 1))
    def add(self, which: int, max_tokens: int, stop_at: int | None) -> None:
        prompt = PROMPTS[which]
        ref = self.hf_greedy(prompt, MAX_OUT)
        stop = () if stop_at is None else (ref[stop_at],)
        want = ref[:max_tokens]
        if stop and stop[0] in want:
            want = want[: want.index(stop[0]) + 1]
        rid = f"q{self.n}"
        self.n += 1
        self.refs[rid] = ref
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop,
                                ignore_eos=True)
        max_len = self.engine.scheduler.config.max_model_len
        if len(prompt) >= max_len:
            with pytest.raises(CapacityError):
                self.engine.add_request(rid, prompt, params)
            type(self).totals["refused"] += 1
            return
        self.engine.add_request(rid, prompt, params)
        self.expected[rid] = want[: max_len - len(prompt)]

    @rule(k=st.integers(1, 3))
    def steps(self, k: int) -> None:
        for _ in range(k):
            self._collect(self.engine.step())
            self.engine.check_invariants()

    @precondition(lambda self: bool(self.engine.scheduler.requests))
    @rule(data=st.data(), coin=st.integers(0, 2))
    def abort(self, data: st.DataObject, coin: int) -> None:
        if coin:  # abort one time in three, so that most requests run to the end
            return
        rid = data.draw(st.sampled_from(sorted(self.engine.scheduler.requests)))
        owned = self.engine.blocks.has(rid) or self.engine.states.has(rid)
        assert self.engine.abort_request(rid) == [rid]
        assert not self.engine.blocks.has(rid) and not self.engine.states.has(rid)
        assert owned or rid not in {r.request_id for r in self.engine.scheduler.running}
        self.aborted.add(rid)

    @invariant()
    def pools_balanced(self) -> None:
        if hasattr(self, "engine"):
            self.engine.check_invariants()
            for pool in (self.engine.blocks, self.engine.states):
                assert pool.num_free + pool.num_owned == pool.capacity

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self._collect(self.engine.step())
            self.engine.check_invariants()
        e = self.engine
        assert not e.has_unfinished_requests()
        assert e.blocks.num_free == e.blocks.capacity and e.states.num_free == e.states.capacity
        for rid, want in self.expected.items():
            out = self.final[rid]
            if rid in self.aborted:
                assert out.finish_reason == "abort"
                assert list(out.token_ids) == want[: len(out.token_ids)]
            else:
                assert list(out.token_ids) == want, (rid, out.num_preemptions)
        t = type(self).totals
        t["examples"] += 1
        t["steps"] += e.stats.steps
        t["preemptions"] += e.stats.preemptions
        t["finished"] += len(self.expected) - len(self.aborted)
        t["aborted"] += len(self.aborted)
        t["accepted"] += e.stats.spec.accepted_tokens
        t["rejected"] += e.stats.spec.draft_tokens - e.stats.spec.accepted_tokens


@pytest.fixture
def machine(make_engine: Callable[..., Engine],
            hf_greedy: Callable[..., list[int]]) -> type[EngineMachine]:
    EngineMachine.make_engine = staticmethod(make_engine)  # type: ignore[assignment]
    EngineMachine.hf_greedy = staticmethod(hf_greedy)  # type: ignore[assignment]
    return EngineMachine


def run_machine(machine: type[EngineMachine]) -> dict[str, int]:
    test = machine.TestCase
    test.settings = settings(max_examples=16, stateful_step_count=12, deadline=None,
                             derandomize=True, suppress_health_check=list(HealthCheck))
    test().runTest()
    print(machine.totals)
    return machine.totals


def test_random_schedules(machine: type[EngineMachine]) -> None:
    t = run_machine(machine)
    # the schedules really exercised what they are meant to
    assert t["preemptions"] >= 3 and t["aborted"] > 0 and t["refused"] > 0, t
    assert t["finished"] >= 50, t


class SpeculativeMachine(EngineMachine):
    speculative = True
    totals: ClassVar[dict[str, int]] = dict.fromkeys(EngineMachine.totals, 0)


def test_random_schedules_speculative(make_engine: Callable[..., Engine],
                                      hf_greedy: Callable[..., list[int]]) -> None:
    """Speculation on, drafts forced right or wrong: every invariant holds after every step
    and every output equals HF's greedy tokens."""
    SpeculativeMachine.make_engine = staticmethod(make_engine)  # type: ignore[assignment]
    SpeculativeMachine.hf_greedy = staticmethod(hf_greedy)  # type: ignore[assignment]
    t = run_machine(SpeculativeMachine)
    assert t["preemptions"] >= 3 and t["aborted"] > 0, t
    assert t["accepted"] >= 30 and t["rejected"] >= 30, t  # both ways, really
