"""KV-cache events for external routers, in vLLM's KV-events wire format.

Stable page hashes: the same ``chain_hashes`` in separate processes with different
``PYTHONHASHSEED`` (and pinned values). The pool records its hash index's changes. A real ZeroMQ
SUB socket on 127.0.0.1 reads a real engine's batches ([topic, 8-byte big-endian seq, msgpack
payload]) and decodes them with msgspec into vLLM's struct shapes: two requests sharing a prefix
store each page once, every stored hash is ``chain_hashes`` of the prompt's full pages and
chains by its parent; a small pool's evictions come as ``BlockRemoved`` of exactly those hashes,
so an index that applies the events in order equals the pool's; the replay socket returns past
batches by sequence number. The legacy wire (vLLM <= 0.25) decodes with the old array shapes; a
full queue drops its oldest batch (counted) without blocking; bad configurations are typed
errors naming the key, and a busy endpoint one at start.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from engine_helpers import prompt_of
from zmq.utils.monitor import recv_monitor_message

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams, SequenceOutput
from pagedhybrid.engine.core import kv_events as kv
from pagedhybrid.engine.core.kv_events import KVEventPublisher, KVEventsConfig, open_publisher
from pagedhybrid.engine.core.pages import (
    BlockPool,
    PagesCleared,
    PagesRemoved,
    PagesStored,
    chain_hashes,
    page_hash,
)
from pagedhybrid.errors import ContractViolation
from server_process import free_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM's struct shapes (vllm/distributed/kv_events.py, 0.26+): the batch positional, each
# event a map tagged under "type"; unknown keys are ignored, as a vLLM consumer does ----------
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM <= 0.25 (its examples/online_serving/kv_events_subscriber.py): tagged arrays
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(VllmEventBatch):
    events: list[LegacyStored | LegacyRemoved | LegacyCleared]


# -- a subscriber, as a router runs one ------------------------------------------------------------
def local(endpoint: str) -> str:
    """A bound wildcard address as a client dials it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class Subscriber:
    """A SUB socket connected (handshake done) to ``endpoint``; ``receive`` gets
    ``(topic, seq, payload)`` messages, ``replay`` asks a ROUTER for past ones (DEALER)."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        try:
            assert monitor.poll(10_000), f"no ZMTP handshake with {endpoint}"
            recv_monitor_message(monitor)
        finally:
            self.sub.disable_monitor()
            monitor.close(0)
        time.sleep(0.1)  # the subscription reaches the publisher right after the handshake

    def receive(self, count: int, timeout_s: float = 20.0) -> list[tuple[bytes, int, bytes]]:
        out: list[tuple[bytes, int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count and self.sub.poll(max(1, int(1000 * (deadline -
                                                                      time.monotonic())))):
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            out.append((topic, int.from_bytes(seq, "big"), payload))
        return out

    def close(self) -> None:
        self.sub.close(0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(endpoint: str, start: int, legacy: bool = False) -> list[tuple[bytes, int, bytes]]:
    """Past batches from ``start`` on, as vLLM's replay ROUTER sends them, up to its end marker
    (a DEALER sends the empty delimiter frame a REQ socket would)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if legacy:
                seq, payload = frames[1:]
                topic = b""
            else:
                topic, seq, payload = frames[1:]
            if seq == END_SEQ:
                assert payload == b"" and topic == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


def decode(messages: list[tuple[bytes, int, bytes]]) -> list[VllmKVEventBatch]:
    dec = msgspec.msgpack.Decoder(VllmKVEventBatch)
    return [dec.decode(payload) for _, _, payload in messages]


class Index:
    """A router's index of one replica: events applied in order, each checked (a stored page's
    hash recomputed from its parent and tokens, its parent already indexed, never stored
    twice while present; a removed hash present)."""

    def __init__(self) -> None:
        self.pages: dict[int, int | None] = {}  # hash -> parent hash
        self.stored: list[BlockStored] = []
        self.removed: list[int] = []
        self.cleared = 0

    def apply(self, batch: VllmKVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.pages.clear()
                self.cleared += 1
            elif isinstance(ev, BlockStored):
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
                assert ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                parent = ev.parent_block_hash
                assert parent is None or parent in self.pages, "a page stored before its parent"
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, int) and 0 <= h < 2 ** 64
                    assert h == page_hash(parent, ev.token_ids[i * BS:(i + 1) * BS])
                    assert h not in self.pages, "a page stored twice"
                    self.pages[h] = parent
                    parent = h
                self.stored.append(ev)
            else:
                assert isinstance(ev, BlockRemoved) and ev.medium == "GPU"
                for h in ev.block_hashes:
                    assert h in self.pages, "a page removed that was never stored"
                    del self.pages[h]
                    self.removed.append(h)

    def matches(self, blocks: BlockPool) -> bool:
        hashed = sum(blocks.is_hashed(p) for p in range(blocks.capacity))
        return len(self.pages) == hashed and all(blocks.has_hash(h) for h in self.pages)


def serve(engine: Engine, prompts: list[list[int]]) -> list[SequenceOutput]:
    """One request after the other, each to its end (invariants every step)."""
    outs = []
    for i, p in enumerate(prompts):
        rid = f"kv{engine.stats.steps}-{i}"
        engine.add_request(rid, p, GREEDY)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    outs.append(o)
            engine.check_invariants()
    return outs


def events_config(port: int, replay_port: int | None = None, **kw: object) -> dict[str, Any]:
    """The JSON object of vLLM's ``--kv-events-config``."""
    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": f"tcp://*:{port}", "topic": "kv@pod-0@tiny", **kw}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return cfg


def published(engine: Engine) -> int:
    """Batches the engine's publisher has numbered (sent or queued)."""
    assert engine.kv_events is not None
    return engine.kv_events.next_seq


# -- stable hashes ---------------------------------------------------------------------------------
def test_chain_hashes_are_stable_across_processes() -> None:
    toks = prompt_of(3, 100, vocab=150_000)
    script = ("import json, sys; from pagedhybrid.engine.core.pages import chain_hashes; "
              "t = json.loads(sys.argv[1]); "
              "print(json.dumps([chain_hashes(t, 16, 'lora-7'), chain_hashes(t, 16), "
              "chain_hashes(t, 32, ('adapter', 3))]))")
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script, json.dumps(toks)], env=env,
                             check=True, capture_output=True, text=True, timeout=300)
        runs.append(json.loads(out.stdout))
    here = [chain_hashes(toks, 16, "lora-7"), chain_hashes(toks, 16),
            chain_hashes(toks, 32, ("adapter", 3))]
    assert runs[0] == runs[1] == here
    assert len(here[0]) == 6 and len(here[2]) == 3
    assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for hs in here for h in hs)
    assert len({*here[0], *here[1]}) == 12  # the extra key enters every hash
    # the encoding is pinned: a router may keep hashes across engine versions
    assert chain_hashes(list(range(40)), 16) == [8618362498317717788, 4497854419063442166]
    assert chain_hashes(list(range(40)), 16, "lora-1") == [13061252657322475645,
                                                          4372148180806068078]
    assert page_hash(None, range(16)) == chain_hashes(list(range(40)), 16)[0]
    assert page_hash(8618362498317717788, range(16, 32)) == 4497854419063442166


# -- the pool's events -----------------------------------------------------------------------------
def test_pool_records_its_hash_index_changes() -> None:
    assert BlockPool(4, BS, caching=True).take_events() == []  # not recorded: nothing
    pool = BlockPool(4, BS, caching=True, record_events=True)
    assert pool.take_events() == [PagesCleared()]
    assert pool.take_events() == []
    a = list(range(100, 150))
    ha = chain_hashes(a, BS)
    assert pool.grow("a", len(a))
    pool.register_full("a", ha, a, 20)  # one page computed
    pool.register_full("a", ha, a, 50)  # then two more, one event
    assert pool.take_events() == [PagesStored([ha[0]], None, a[:16], BS),
                                  PagesStored(ha[1:3], ha[0], a[16:48], BS)]
    # the same prefix again: indexed already, nothing stored; a new third page chains on
    b = a[:32] + list(range(500, 518))
    hb = chain_hashes(b, BS)
    pool.release("a")
    pool.share("b", pool.lookup(hb, b))  # a's first two pages
    assert pool.grow("b", len(b))  # the free page and the LRU cached one (a's third)
    pool.register_full("b", hb, b, 50)
    assert pool.take_events() == [PagesRemoved([ha[2]]),
                                  PagesStored([hb[2]], ha[1], b[32:48], BS)]
    # a pool that needs every page evicts the cached ones, in LRU order
    pool.release("b")
    assert pool.grow("c", 4 * BS)
    ev = pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], PagesRemoved)
    assert sorted(ev[0].block_hashes) == sorted([ha[0], ha[1], hb[2]])
    assert pool.evictions == 4
    pool.check_invariants()


def test_pool_events_replay_to_its_hash_index_under_random_traffic() -> None:
    """Requests over a few shared prefixes admitted, computed in pieces and released at random
    in a small pool (evictions, duplicates computed side by side): after every operation the
    events applied in order give exactly the pool's hash index."""
    rng = random.Random(5)
    pool = BlockPool(12, BS, caching=True, record_events=True)
    index: dict[int, int | None] = {}
    roots = [[rng.randrange(50) for _ in range(48)] for _ in range(3)]
    live: dict[str, tuple[list[int], list[int], int]] = {}  # tokens, hashes, computed

    def apply() -> None:
        for ev in pool.take_events():
            if isinstance(ev, PagesCleared):
                index.clear()
            elif isinstance(ev, PagesStored):
                parent = ev.parent_block_hash
                assert parent is None or parent in index
                for i, h in enumerate(ev.block_hashes):
                    assert h not in index
                    assert h == page_hash(parent, ev.token_ids[i * BS:(i + 1) * BS])
                    index[h], parent = parent, h
            else:
                for h in ev.block_hashes:
                    del index[h]
        assert all(pool.has_hash(h) for h in index)
        assert sum(pool.is_hashed(p) for p in range(12)) == len(index)

    for step in range(400):
        op = rng.random()
        if op < 0.4 and len(live) < 3:
            toks = rng.choice(roots)[:rng.choice((16, 32, 48))] + \
                [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
            hashes = chain_hashes(toks, BS)
            rid = f"r{step}"
            pages = pool.lookup(hashes, toks)
            pool.share(rid, pages)
            if not pool.grow(rid, len(toks)):
                pool.release(rid)
                continue
            live[rid] = (toks, hashes, len(pages) * BS)
        elif op < 0.8 and live:
            rid = rng.choice(sorted(live))
            toks, hashes, done = live[rid]
            done = min(len(toks), done + rng.randrange(1, 40))
            live[rid] = (toks, hashes, done)
            pool.register_full(rid, hashes, toks, done)
        elif live:
            rid = rng.choice(sorted(live))
            del live[rid]
            pool.release(rid)
        apply()
        pool.check_invariants()
    assert pool.evictions > 0


# -- the engine over a real ZeroMQ socket ----------------------------------------------------------
def test_engine_publishes_a_shared_prefix_once_and_replays_it(
        make_engine: Callable[..., Engine]) -> None:
    port, replay_port = free_port(), free_port()
    engine = make_engine(num_blocks=64, max_num_seqs=4, state_checkpoint_interval=BS,
                         kv_events_config=events_config(port, replay_port))
    try:
        assert isinstance(engine.config.kv_events_config, KVEventsConfig)
        assert engine.kv_events is not None
        prefix = prompt_of(11, 48)
        a, b = prefix + prompt_of(12, 20), prefix + prompt_of(13, 20)
        with Subscriber(f"tcp://127.0.0.1:{port}", b"kv@") as sub:
            outs = serve(engine, [a, b])
            live = sub.receive(published(engine))
        assert outs[1].num_cached_tokens > 0  # b started after the shared prefix
        assert [seq for _, seq, _ in live] == list(range(published(engine)))
        assert {topic for topic, _, _ in live} == {b"kv@pod-0@tiny"}
        batches = decode(live)
        assert all(x.data_parallel_rank == 0 and x.ts > 1e9 for x in batches)
        assert isinstance(batches[0].events[0], AllBlocksCleared)  # a new replica holds nothing
        index = Index()
        for batch in batches:
            index.apply(batch)
        assert index.cleared == 1 and not index.removed
        # every full page of both prompts (and of the answers) is indexed once, chained
        ha, hb = chain_hashes(outs[0].sequence, BS), chain_hashes(outs[1].sequence, BS)
        assert hb[:3] == ha[:3]  # the shared prefix: the same pages
        prompt_pages = chain_hashes(a, BS) + chain_hashes(b, BS)
        assert set(prompt_pages) <= set(index.pages)
        computed = (len(outs[0].sequence) - 1) // BS  # (the last token is never computed)
        assert set(index.pages) == set(ha[:computed]) | set(hb[:computed])
        stored = [h for ev in index.stored for h in ev.block_hashes]
        assert len(stored) == len(set(stored)) == 2 * computed - 3
        first_b = next(ev for ev in index.stored if hb[3] in ev.block_hashes)
        assert first_b.block_hashes[0] == hb[3] and first_b.parent_block_hash == ha[2]
        assert index.matches(engine.blocks)
        # the replay socket: past batches by sequence number, as they were sent
        again = replay(f"tcp://127.0.0.1:{replay_port}", 2)
        assert again == [m for m in live if m[1] >= 2]
        assert replay(f"tcp://127.0.0.1:{replay_port}", 10 ** 6) == []
    finally:
        engine.close()
    assert engine.kv_events.closed


def test_evictions_are_published_as_removed_pages(make_engine: Callable[..., Engine]) -> None:
    port = free_port()
    engine = make_engine(num_blocks=10, max_num_seqs=2, max_model_len=128,
                         state_checkpoint_interval=BS, kv_events_config=events_config(port))
    try:
        prompts = [prompt_of(40 + i, 64) for i in range(4)]  # 4 full pages each, 10 in all
        with Subscriber(f"tcp://127.0.0.1:{port}") as sub:
            outs = serve(engine, prompts)
            live = sub.receive(published(engine))
        assert [seq for _, seq, _ in live] == list(range(published(engine)))
        index = Index()
        for batch in decode(live):
            index.apply(batch)
        assert engine.blocks.evictions > 0
        assert len(index.removed) == len(set(index.removed)) == engine.blocks.evictions
        every = {h for o in outs for h in chain_hashes(o.sequence, BS)}
        assert set(index.removed) <= every
        first = set(chain_hashes(prompts[0], BS))
        assert first & set(index.removed)  # the oldest prompt's pages went first
        assert all(engine.blocks.has_hash(h) is False for h in index.removed)
        assert index.matches(engine.blocks)  # the router's view is the pool's
    finally:
        engine.close()


def test_events_off_cost_nothing(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(num_blocks=32)
    assert engine.config.kv_events_config is None and engine.kv_events is None
    serve(engine, [prompt_of(5, 40)])
    assert engine.blocks.take_events() == []
    for off in ({"enable_kv_cache_events": False, "publisher": "zmq"},
                {"enable_kv_cache_events": True, "publisher": "null"}):
        cfg = KVEventsConfig.of(off)
        assert cfg is not None and not cfg.active and open_publisher(cfg) is None


# -- the wire, legacy, drops, ranks --------------------------------------------------------------
def pool_events() -> list[Any]:
    pool = BlockPool(2, BS, caching=True, record_events=True)
    toks = list(range(32))
    pool.grow("a", 32)
    pool.register_full("a", chain_hashes(toks, BS), toks, 32)
    pool.release("a")
    pool.grow("b", 17)
    return pool.take_events()


def test_legacy_wire_decodes_with_vllm_0_25_array_shapes() -> None:
    cfg = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                             "replay_endpoint": "tcp://*:0", "wire_format": "legacy"})
    with KVEventPublisher(cfg) as pub, Subscriber(local(pub.endpoint)) as sub:
        events = pool_events()
        pub.publish(events)
        (topic, seq, payload), = sub.receive(1)
        assert (topic, seq) == (b"", 0)
        batch = msgspec.msgpack.Decoder(LegacyBatch).decode(payload)
        assert [type(e) for e in batch.events] == [LegacyCleared, LegacyStored, LegacyRemoved]
        h = chain_hashes(list(range(32)), BS)
        assert batch.events[1].block_hashes == h and batch.events[1].parent_block_hash is None
        assert batch.events[1].token_ids == list(range(32))
        assert sorted(batch.events[2].block_hashes) == sorted(h)
        raw = msgspec.msgpack.decode(payload)
        assert raw[1][1][:8] == ["BlockStored", h, None, list(range(32)), BS, None, "GPU", None]
        assert raw[1][2] == ["BlockRemoved", batch.events[2].block_hashes, "GPU"]
        # legacy replay frames carry no topic
        assert replay(local(pub.replay_endpoint), 0, legacy=True) == [(b"", 0, payload)]
        # the current wire of the same events is what vLLM 0.26+ consumers decode
        now = decode([(b"", 0, kv.encode_batch(events, 1.0, 0))])[0]
        assert [type(e) for e in now.events] == [AllBlocksCleared, BlockStored, BlockRemoved]


def test_a_full_queue_drops_its_oldest_batch_without_blocking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered = threading.Event(), threading.Event()
    real = kv.encode_batch

    def slow(*args: Any, **kw: Any) -> bytes:
        entered.set()
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(kv, "encode_batch", slow)
    cfg = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                             "replay_endpoint": "tcp://*:0", "max_queue_size": 2})
    with KVEventPublisher(cfg) as pub:
        pub.publish([PagesRemoved([1])])  # seq 0: the sender takes it and waits in encoding
        assert entered.wait(30)
        for h in (2, 3, 4):  # seq 1, 2, 3: the queue holds two, so seq 1 goes
            pub.publish([PagesRemoved([h])])
        pub.publish([])  # nothing to say: no batch
        assert pub.dropped == 1
        gate.set()
        deadline = time.monotonic() + 30
        while pub.published < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = replay(local(pub.replay_endpoint), 0)
        assert [seq for _, seq, _ in got] == [0, 2, 3]  # the gap tells a router it lost one
        assert [b.events[0].block_hashes for b in decode(got)] == [[1], [3], [4]]
    assert pub.closed
    pub.publish([PagesRemoved([5])])  # after close: dropped, never raised
    assert pub.dropped == 2


def test_data_parallel_rank_moves_the_port_and_tags_batches() -> None:
    port = free_port()
    cfg = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port - 1}"})
    with KVEventPublisher(cfg, data_parallel_rank=1) as pub, \
            Subscriber(f"tcp://127.0.0.1:{port}") as sub:
        assert pub.endpoint.endswith(f":{port}")
        pub.publish([PagesCleared()])
        (_, _, payload), = sub.receive(1)
        assert decode([(b"", 0, payload)])[0].data_parallel_rank == 1
    assert kv.offset_endpoint("endpoint", "inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ContractViolation) as err:
        KVEventPublisher(KVEventsConfig(True, endpoint="ipc:///tmp/kv"), data_parallel_rank=1)
    assert err.value.where == "endpoint"


# -- configuration ---------------------------------------------------------------------------------
def test_config_reads_vllms_json_and_refuses_unknown_keys() -> None:
    text = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, '
            '"max_queue_size": 50, "topic": "kv-events"}')
    cfg = EngineConfig(kv_events_config=text).kv_events_config
    assert cfg == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 100, 1000, 50,
                                 "kv-events")
    assert KVEventsConfig.of({"enable_kv_cache_events": True}).publisher == "zmq"
    assert KVEventsConfig.of({}).publisher == "null"
    for bad, where in [({"enable_kv_cache_events": True, "bogus_key": 1}, "bogus_key"),
                       ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
                       ({"endpoint": "http://localhost:5557"}, "endpoint"),
                       ({"endpoint": "tcp://*:99999"}, "endpoint"),
                       ({"endpoint": "tcp://localhost"}, "endpoint"),
                       ({"replay_endpoint": "5558"}, "replay_endpoint"),
                       ({"max_queue_size": 0}, "max_queue_size"),
                       ({"hwm": -1}, "hwm"),
                       ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
                       ({"wire_format": "v2"}, "wire_format")]:
        with pytest.raises(ContractViolation) as err:
            EngineConfig(kv_events_config=bad)
        assert err.value.where == where and where in str(err.value)
    with pytest.raises(ContractViolation, match="not JSON"):
        KVEventsConfig.of("{enable")


def test_a_busy_endpoint_is_a_typed_error_at_start(make_engine: Callable[..., Engine]) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ContractViolation) as err:
            make_engine(num_blocks=16, kv_events_config=events_config(port))
        assert err.value.where == "endpoint" and str(port) in str(err.value)
        with pytest.raises(ContractViolation) as err:
            open_publisher(KVEventsConfig.of(events_config(free_port(), port)))
        assert err.value.where == "replay_endpoint"
