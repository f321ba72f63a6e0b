"""Hybrid prefix caching: shared KV pages plus Gated DeltaNet state checkpoints.

Every request's greedy tokens with caching equal those without caching and HF ``generate``,
whatever was cached before it: shared and divergent prefixes around page and checkpoint
boundaries, full-prompt hits, multi-turn continuations that hit on a previous answer (decode
checkpoints), eviction under a tight pool, preemption, aborts; hypothesis stateful schedules check
the pool invariants (free + owned + cached == capacity for pages and checkpoints, no shared page
ever written) after every step. Logprobs with and without a hit agree to fp32 noise, seeded
sampling gives the same tokens, and bad configurations are refused at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest
import torch
from engine_helpers import prompt_of
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams, SequenceOutput
from pagedhybrid.engine.core.pages import BlockPool, chain_hashes
from pagedhybrid.engine.core.states import CheckpointPool
from pagedhybrid.errors import CapacityError, ContractViolation, UnsupportedConfiguration

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = prompt_of(7, 200)


def serve(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY,
          one_by_one: bool = True) -> list[SequenceOutput]:
    """Run ``prompts`` (one after the other, or all queued at once); invariants every step."""
    outs: dict[str, SequenceOutput] = {}
    ids = [f"q{engine.stats.steps}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
        while one_by_one and engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o
            engine.check_invariants()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
    return [outs[r] for r in ids]


def test_pages_are_shared_by_content_and_verified() -> None:
    pool = BlockPool(6, 16, caching=True)
    a = list(range(40))
    ha = chain_hashes(a, 16)
    assert len(ha) == 2 and chain_hashes(a[:16], 16) == ha[:1]
    assert chain_hashes(a, 16, extra_key="lora-1") != ha  # the extra key enters every hash
    assert pool.grow("a", 40)
    pool.register_full("a", ha, a, 40)
    pool.check_invariants()
    pages = pool.lookup(ha, a)
    assert pages == pool.table("a")[:2]
    pool.release("a")  # full pages stay cached, the partial one is free
    assert (pool.num_cached, pool.num_free) == (2, 6)
    pool.check_invariants()
    pool.share("b", pages)
    assert pool.num_cached == 0 and all(pool.ref_count(p) == 1 for p in pages)
    assert pool.lookup(ha, a[:16] + [99] * 24) == pages[:1]  # diverges in the second page
    # a forged hash (a collision) never hands out another prefix's page
    assert pool.lookup(ha, [5, *a[1:]]) == []
    pool.release("b")
    for rid in "cdef":  # pressure: the LRU cached pages are evicted last-resort
        assert pool.grow(rid, 16)
    assert pool.evictions == 0
    assert pool.grow("g", 32) and pool.evictions == 2 and pool.lookup(ha, a) == []
    pool.check_invariants()


def test_checkpoint_pool_rows() -> None:
    ck = CheckpointPool(2)
    r1 = ck.reserve(111)
    assert r1 is not None and ck.reserve(111) is None  # already being written
    ck.commit()
    assert ck.find(111) == r1 and ck.num_cached == 1
    r2 = ck.reserve(222)
    ck.commit()
    ck.pin(r2)  # read by a hit this step: not evictable
    r3 = ck.reserve(333)
    assert r3 == r1 and ck.find(111) is None and ck.evictions == 1
    ck.discard([r3])  # its request failed: nothing kept
    ck.commit()
    assert ck.find(333) is None and ck.find(222) == r2
    ck.check_invariants()
    with pytest.raises(ContractViolation, match="num_state_checkpoints"):
        CheckpointPool(0)


@pytest.mark.parametrize(("interval", "block"), [(64, 16), (32, 16), (32, 32)])
def test_hits_around_page_and_checkpoint_boundaries(make_engine: Callable[..., Engine],
                                                    hf_greedy: Callable[..., list[int]],
                                                    interval: int, block: int) -> None:
    on = make_engine(block_size=block, num_blocks=64, state_checkpoint_interval=interval)
    off = make_engine(block_size=block, num_blocks=64, enable_prefix_caching=False)
    first = BASE[:3 * interval + 5]
    serve(on, [first])
    for shared in (interval - 1, interval, interval + 1, 2 * interval, 3 * interval + 5):
        prompt = BASE[:shared] + prompt_of(shared, 9, 256)
        got, = serve(on, [prompt])
        want, = serve(off, [prompt])
        assert list(got.token_ids) == list(want.token_ids) == hf_greedy(prompt, 6), shared
        assert got.num_cached_tokens == shared // interval * interval, shared
    again, = serve(on, [first])  # the whole prompt cached: its last token is recomputed
    assert again.num_cached_tokens == (len(first) - 1) // interval * interval
    assert list(again.token_ids) == hf_greedy(first, 6)
    st = on.prefix_cache_stats()
    assert st["hits"] >= 5 and 0 < st["cached_token_fraction"] < 1


def test_a_kv_hit_without_checkpoint_falls_back_to_a_shorter_joint_hit(
        make_engine: Callable[..., Engine], hf_greedy: Callable[..., list[int]]) -> None:
    engine = make_engine(block_size=16, num_blocks=64, state_checkpoint_interval=32,
                         num_state_checkpoints=8)
    serve(engine, [BASE[:100]])  # checkpoints at 32, 64, 96
    hashes = chain_hashes(BASE, 16)
    row96 = engine.checkpoints.find(hashes[96 // 16 - 1])
    assert row96 is not None
    # drop the checkpoint at 96: the KV hit (96 tokens) has no state there -> 64
    engine.checkpoints._cached.pop(hashes[96 // 16 - 1])
    engine.checkpoints._free.append(row96)
    out, = serve(engine, [BASE[:120]])
    assert out.num_cached_tokens == 64 and list(out.token_ids) == hf_greedy(BASE[:120], 6)


def test_multi_turn_hits_on_the_previous_answer(make_engine: Callable[..., Engine],
                                                hf_greedy: Callable[..., list[int]]) -> None:
    """Turn 2's prompt is turn 1's prompt + answer + a new message: decode checkpoints make the
    answer part of the hit."""
    engine = make_engine(block_size=16, num_blocks=64, state_checkpoint_interval=16)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    turn, answered = BASE[:20], 0  # answered: tokens of the previous turn with its answer
    for k in range(3):
        out, = serve(engine, [turn], params)
        assert list(out.token_ids) == hf_greedy(turn, 30)
        # everything up to the last checkpoint the previous turn passed, answer included
        assert out.num_cached_tokens == answered // 16 * 16, k
        answered = len(turn) + 30 - 1  # the last sampled token was never fed to the model
        turn = turn + list(out.token_ids) + prompt_of(50 + k, 7, 256)


def test_eviction_preemption_and_aborts_under_a_tight_pool(
        make_engine: Callable[..., Engine], hf_greedy: Callable[..., list[int]]) -> None:
    engine = make_engine(block_size=16, num_blocks=12, num_state_slots=3, max_num_seqs=3,
                         max_num_batched_tokens=40, state_checkpoint_interval=16,
                         num_state_checkpoints=4, cache_fill=None)
    prompts = [BASE[:40] + prompt_of(i, 30, 256) for i in range(6)] + \
              [prompt_of(90 + i, 60, 256) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    engine.add_request("gone", BASE[:70], params)
    final: dict[str, SequenceOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.check_invariants()
        steps += 1
        if steps == 3:
            engine.abort_request("gone")
    assert final["gone"].finish_reason == "abort"
    for i, p in enumerate(prompts):
        assert list(final[f"t{i}"].token_ids) == hf_greedy(p, 20), i
    st = engine.prefix_cache_stats()
    assert engine.stats.preemptions >= 1 and st["page_evictions"] >= 1, (engine.stats, st)
    assert st["hits"] >= 1
    assert engine.blocks.num_free == engine.blocks.capacity


def test_logprobs_and_seeded_sampling_agree_with_and_without_a_hit(
        make_engine: Callable[..., Engine]) -> None:
    on = make_engine(block_size=16, num_blocks=64)
    off = make_engine(block_size=16, num_blocks=64, enable_prefix_caching=False)
    prompt = BASE[:150]
    serve(on, [prompt[:140]])
    lp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    got, = serve(on, [prompt], lp)
    want, = serve(off, [prompt], lp)
    assert got.num_cached_tokens == 128
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(got.logprobs, want.logprobs,
                                                                   strict=True) for t in a)
    assert worst < 1e-4, worst  # fp32 noise (the hit restores the exact checkpointed state)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=12, ignore_eos=True)
    assert serve(on, [prompt], seeded)[0].token_ids == serve(off, [prompt], seeded)[0].token_ids


def test_bad_configurations_are_refused_at_construction(make_engine: Callable[..., Engine]
                                                        ) -> None:
    with pytest.raises(ContractViolation, match=r"state_checkpoint_interval.*multiple of "
                       r"block_size 16"):
        EngineConfig(state_checkpoint_interval=24)
    for field in ("num_state_checkpoints", "state_checkpoint_interval"):
        for bad in (0, -3):
            with pytest.raises(ContractViolation, match=field):
                EngineConfig(**{field: bad})
    with pytest.raises(UnsupportedConfiguration, match=r"reference.*intermediate states"):
        make_engine(backend="reference", num_blocks=8)
    engine = make_engine(backend="reference", num_blocks=8, enable_prefix_caching=False)
    assert engine.checkpoints is None and engine.prefix_cache_stats()["queries"] == 0


SHARED = [BASE[:n] for n in (15, 16, 17, 31, 32, 33, 47, 63, 64, 65)]


class PrefixMachine(RuleBasedStateMachine):
    """Random arrivals of prompts sharing prefixes of varied lengths, random aborts, tight
    pools; the same schedule on a cache-off engine must produce the same tokens."""

    make_engine: Callable[..., Engine]
    hf_greedy: Callable[..., list[int]]
    totals: ClassVar[dict[str, int]] = dict.fromkeys(("examples", "hits", "finished",
                                                      "evictions", "preemptions"), 0)

    @initialize(interval=st.sampled_from([16, 32]), pages=st.integers(9, 14),
                slots=st.sampled_from([2, 3]), checkpoints=st.sampled_from([1, 2, 4]),
                budget=st.sampled_from([16, 40, 96]))
    def setup(self, interval: int, pages: int, slots: int, checkpoints: int, budget: int
              ) -> None:
        kw = {"block_size": 16, "num_blocks": pages, "num_state_slots": slots,
              "max_num_seqs": slots, "max_num_batched_tokens": budget, "cache_fill": None,
              "max_model_len": 128}
        self.on = self.make_engine(state_checkpoint_interval=interval,
                                   num_state_checkpoints=checkpoints, **kw)
        self.n = 0
        self.prompts: dict[str, list[int]] = {}
        self.final: dict[str, SequenceOutput] = {}
        self.aborted: set[str] = set()
        PrefixMachine.totals["examples"] += 1

    @rule(which=st.integers(0, len(SHARED) - 1), tail=st.integers(0, 20),
          out=st.integers(1, 8))
    def arrive(self, which: int, tail: int, out: int) -> None:
        prompt = SHARED[which] + prompt_of(1000 + self.n, tail, 256)
        rid = f"p{self.n}"
        self.n += 1
        try:
            self.on.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=out,
                                                            ignore_eos=True))
        except CapacityError:
            return
        self.prompts[rid] = prompt

    @rule(k=st.integers(0, 50))
    def abort(self, k: int) -> None:
        live = sorted(self.on.scheduler.requests)
        if live:
            rid = live[k % len(live)]
            self.on.abort_request(rid)
            self.aborted.add(rid)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for o in self.on.step():
                if o.finished:
                    self.final[o.request_id] = o
            self.on.check_invariants()

    @invariant()
    def pools_consistent(self) -> None:
        self.on.check_invariants()

    def teardown(self) -> None:
        while self.on.has_unfinished_requests():
            for o in self.on.step():
                if o.finished:
                    self.final[o.request_id] = o
            self.on.check_invariants()
        for rid, out in self.final.items():
            if rid in self.aborted or out.finish_reason != "length":
                continue
            prompt = self.prompts[rid]
            assert list(out.token_ids) == self.hf_greedy(prompt, len(out.token_ids)), rid
            PrefixMachine.totals["finished"] += 1
        st = self.on.prefix_cache_stats()
        PrefixMachine.totals["hits"] += int(st["hits"])
        PrefixMachine.totals["evictions"] += int(st["page_evictions"] +
                                                  st["checkpoint_evictions"])
        PrefixMachine.totals["preemptions"] += self.on.stats.preemptions
        assert self.on.blocks.num_owned == 0 and self.on.states.num_free == \
            self.on.states.capacity


def test_random_schedules_with_shared_prefixes(make_engine: Callable[..., Engine],
                                               hf_greedy: Callable[..., list[int]]) -> None:
    PrefixMachine.make_engine = staticmethod(make_engine)  # type: ignore[assignment]
    PrefixMachine.hf_greedy = staticmethod(hf_greedy)  # type: ignore[assignment]
    PrefixMachine.TestCase.settings = settings(
        max_examples=14, stateful_step_count=12, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    PrefixMachine.TestCase().runTest()
    t = PrefixMachine.totals
    assert t["finished"] >= 10 and t["hits"] >= 5 and t["evictions"] >= 1, t
    assert torch.is_grad_enabled()  # the engine never leaks no_grad state
