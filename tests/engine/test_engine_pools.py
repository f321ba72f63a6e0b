"""KV page pool, state-slot pool and their atomic pairing (pure bookkeeping, no model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.engine.core.pages import BlockPool, chain_hashes
from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.core.scheduler import HybridAllocator
from pagedhybrid.engine.core.states import StatePool
from pagedhybrid.engine.sample.sampler import SamplingParams
from pagedhybrid.errors import ContractViolation


def test_block_pool_grow_and_release() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(1) == 1 and pool.blocks_for(17) == 2
    assert pool.grow("a", 17)
    assert len(pool.table("a")) == 2 and pool.num_free == 2 and pool.num_owned == 2
    assert pool.grow("a", 32)  # still two pages
    assert len(pool.table("a")) == 2
    assert not pool.grow("b", 3 * 16)  # needs three, two free: nothing taken
    assert not pool.has("b") and pool.num_free == 2
    assert pool.grow("b", 32)
    assert set(pool.table("a")).isdisjoint(pool.table("b"))
    pool.check_invariants()
    assert pool.release("a") == 2
    assert pool.num_free == 2 and pool.table("a") == []
    pool.check_invariants()
    assert pool.release("a") == 0  # idempotent
    pool.release("b")
    assert pool.num_free == pool.capacity == 4
    pool.check_invariants()


@pytest.mark.parametrize("bs", [0, 8, 24, 15, 100])
def test_block_pool_rejects_bad_block_size(bs: int) -> None:
    with pytest.raises(ContractViolation, match="block_size"):
        BlockPool(num_blocks=4, block_size=bs)


def test_block_pool_accepts_powers_of_two() -> None:
    for bs in (16, 32, 64, 256):
        assert BlockPool(1, bs).block_size == bs
    with pytest.raises(ContractViolation, match="num_blocks"):
        BlockPool(0, 16)


def test_state_pool() -> None:
    pool = StatePool(2)
    a = pool.acquire("a")
    assert pool.acquire("a") == a  # same owner keeps its slot
    b = pool.acquire("b")
    assert {a, b} == {0, 1}
    assert pool.acquire("c") is None
    assert pool.num_free == 0 and pool.num_owned == 2
    pool.check_invariants()
    assert pool.release("a") and not pool.release("a")
    assert pool.acquire("c") == a
    pool.check_invariants()
    with pytest.raises(ContractViolation, match="num_slots"):
        StatePool(0)


def _req(rid: str, n: int) -> Request:
    return Request(rid, tuple(range(1, n + 1)), SamplingParams(), 0, torch.Generator())


def test_admission_is_atomic() -> None:
    blocks, states = BlockPool(2, 16), StatePool(1)
    alloc = HybridAllocator(blocks, states)
    slot, hit, n = alloc.admit(_req("a", 16), 64)
    assert (slot, hit.tokens, n) == (0, 0, 16)
    # no slot left: nothing may be taken from the page pool
    assert alloc.admit(_req("b", 16), 64) is None
    assert blocks.num_free == 1 and not blocks.has("b")
    alloc.release("a")
    # a slot but not enough pages: no slot may be taken either
    assert alloc.admit(_req("c", 3 * 16), 64) is None
    assert states.num_free == 1 and not states.has("c")
    assert alloc.idle
    alloc.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 100), st.booleans()),
                max_size=60))
def test_pool_invariants_under_random_operations(ops: list[tuple[str, int, bool]]) -> None:
    blocks, states = BlockPool(7, 16), StatePool(3)
    alloc = HybridAllocator(blocks, states)
    for rid, n, release in ops:
        if release:
            alloc.release(rid)
        elif states.has(rid):
            before = blocks.table(rid)
            ok = alloc.grow(rid, n)
            after = blocks.table(rid)
            assert after[: len(before)] == before  # tables are append-only
            assert ok == (len(after) >= blocks.blocks_for(n))
        else:
            alloc.admit(_req(rid, max(n, 1)), max(n, 1))
        alloc.check_invariants()
        owners = blocks.owners() | states.owners()
        assert blocks.owners() <= states.owners() or not owners
        assert blocks.num_free + blocks.num_owned == blocks.capacity
        assert states.num_free + states.num_owned == states.capacity
    for rid in "abcdef":
        alloc.release(rid)
    assert alloc.idle
    alloc.check_invariants()


def test_register_full_resumes_where_it_stopped_and_indexes_as_a_full_walk() -> None:
    """``register_full`` walks only the pages it has not walked (O(new pages) a step); the index
    it builds -- hashes, contents, which page holds a hash -- equals a walk from the first page at
    every step, with shared prefixes (a request chaining through another's equal pages),
    releases, and evictions of a page a walk chained through."""
    import random

    rng = random.Random(3)
    bs = 16
    fast, slow = BlockPool(7, bs, caching=True), BlockPool(7, bs, caching=True)
    prefix = [rng.randrange(50) for _ in range(2 * bs)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        if len(live) < 2 and rng.random() < 0.3:
            rid = f"r{step}"
            live[rid] = (prefix if rng.random() < 0.6 else []) + [rng.randrange(50)]
            if not all([pool.grow(rid, len(live[rid])) for pool in (fast, slow)]):
                for pool in (fast, slow):
                    pool.release(rid)
                del live[rid]
        for rid in list(live):
            toks = live[rid]
            if rng.random() < 0.08 or len(toks) > 5 * bs:
                for pool in (fast, slow):
                    pool.release(rid)
                del live[rid]
                continue
            toks.append(rng.randrange(50))
            if not all([pool.grow(rid, len(toks)) for pool in (fast, slow)]):
                for pool in (fast, slow):
                    pool.release(rid)
                del live[rid]
                continue
            hashes = chain_hashes(toks, bs)
            fast.register_full(rid, hashes, toks, len(toks))
            slow._walked.clear()  # the walk from the first page, every time
            slow.register_full(rid, hashes, toks, len(toks))
            assert (fast._hash, fast._content, fast._by_hash) == (
                slow._hash, slow._content, slow._by_hash), step
        fast.check_invariants()
    assert fast.evictions > 0, "the pool was meant to evict cached pages"
