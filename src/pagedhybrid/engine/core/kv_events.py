"""KV-cache events for external routers, in vLLM's KV-events wire format.

A KV-cache-aware router (llm-d's KV-cache indexer, SGLang's model gateway, Dynamo's KV router)
keeps, per replica, an index of the page hashes that replica holds and sends each request to
the replica holding the longest prefix of it. It learns the index from the events a replica
publishes; this module publishes the page pool's (``pages.BlockPool(record_events=True)``) in
the format vLLM's ``--kv-events-config`` publisher uses, so those routers read pagedhybrid
replicas unchanged.

Configuration (``KVEventsConfig``): the JSON object vLLM's ``--kv-events-config`` takes --
``enable_kv_cache_events``, ``publisher`` (``zmq`` | ``null``; default ``zmq`` when enabled),
``endpoint`` (default ``tcp://*:5557``), ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic`` -- plus one key of ours, ``wire_format`` (below). Any other key
is a ``ContractViolation`` naming it.

Wire (``wire_format="current"``, as vLLM 0.26+ sends it):

* ZeroMQ PUB socket on ``endpoint`` -- bound when the address has ``*`` or ``::`` or is
  ``ipc://`` / ``inproc://``, else connected (vLLM's rule) -- with send high-water mark ``hwm``.
  Data-parallel rank ``r`` moves a TCP port by ``r`` (an ``inproc`` name gets ``_dp{r}``).
* One multipart message per engine step that changed the index: ``[topic, seq, payload]``,
  ``seq`` an 8-byte big-endian sequence number from 0, ``payload`` a msgpack
  ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]`` (``ts`` Unix seconds, float).
* Each event is a msgpack map tagged under ``"type"`` (msgspec's tagged structs):
  ``{"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64 | nil,
  "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": nil,
  "group_idx": 0, "kv_cache_spec_kind": "full_attention"}``, ``{"type": "BlockRemoved",
  "block_hashes": [...], "medium": "GPU", "group_idx": 0}``, ``{"type": "AllBlocksCleared"}``.
  The hashes are ``pages.page_hash`` (unsigned 64-bit); ``"GPU"`` names the engine's primary KV
  cache whatever its device (routers read ``"CPU"`` as an offload tier).
* Replay: a ROUTER socket on ``replay_endpoint`` keeps the last ``buffer_steps`` payloads. A
  client (REQ, or DEALER sending an empty delimiter frame first) sends a start sequence number
  (8 bytes, big-endian); it gets ``[topic, seq, payload]`` for each kept batch with
  ``seq >= start``, then the end marker ``["", -1 (8 bytes, signed), ""]``.

``wire_format="legacy"`` is vLLM up to 0.25: each event a tagged *array*
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``) and replay
replies ``[seq, payload]`` / ``[-1, ""]`` without the topic frame.

Threading: ``publish`` (the engine thread, once per step) only stamps the batch with its
sequence number and time and appends it to a bounded queue -- when ``max_queue_size`` batches
wait, the oldest is dropped and counted (``dropped``; a subscriber sees the gap in ``seq``); it
never blocks and never raises. One background thread owns the sockets: it converts and encodes
the batches (msgspec), sends them, keeps the replay buffer and answers replay requests.
``close`` sends what is queued (up to a timeout) and closes the sockets.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from pagedhybrid.engine.core.pages import PageEvent, PagesCleared, PagesRemoved, PagesStored
from pagedhybrid.errors import ContractViolation, from_mapping

OP = "kv_events_config"
MEDIUM = "GPU"  # the engine's primary KV cache (vLLM's MEDIUM_GPU)
SPEC_KIND = "full_attention"  # the pages hold the full-attention layers' K/V
END_SEQ = (-1).to_bytes(8, "big", signed=True)
WIRE_FORMATS = ("current", "legacy")
PUBLISHERS = ("zmq", "null")
SCHEMES = ("tcp://", "ipc://", "inproc://")
CLOSE_TIMEOUT_S = 2.0


# -- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (see the module docstring), plus ``wire_format``."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # zmq | null; None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (0: none)
    max_queue_size: int = 100_000  # batches waiting for the sender before the oldest is dropped
    topic: str = ""
    wire_format: str = "current"  # ours: current (vLLM 0.26+) | legacy (vLLM <= 0.25)

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ContractViolation(OP, "enable_kv_cache_events", "must be a bool",
                                    self.enable_kv_cache_events)
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ContractViolation(OP, "publisher", f"must be one of {list(PUBLISHERS)}",
                                    self.publisher)
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ContractViolation(OP, name, f"must be an int >= {low}", v)
        if not isinstance(self.topic, str):
            raise ContractViolation(OP, "topic", "must be a str", self.topic)
        if self.wire_format not in WIRE_FORMATS:
            raise ContractViolation(OP, "wire_format", f"must be one of {list(WIRE_FORMATS)}",
                                    self.wire_format)

    @property
    def active(self) -> bool:
        """Whether events are recorded and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def of(cls, value: KVEventsConfig | Mapping[str, Any] | str | None) -> KVEventsConfig | None:
        """A config from what ``EngineConfig.kv_events_config`` / ``--kv-events-config`` takes:
        None, a ``KVEventsConfig``, a mapping or a JSON object text."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ContractViolation(OP, "kv_events_config", f"is not JSON: {exc}",
                                        value) from None
        if not isinstance(value, Mapping):
            raise ContractViolation(OP, "kv_events_config",
                                    "must be a JSON object, a mapping or KVEventsConfig",
                                    type(value).__name__)
        return from_mapping(cls, value, OP)


def check_endpoint(field: str, endpoint: object) -> None:
    """A ZeroMQ endpoint the publisher can open: ``tcp://HOST:PORT`` (``*`` host or port:
    any), ``ipc://PATH`` or ``inproc://NAME``; else a ``ContractViolation`` naming ``field``."""
    rule = "must be tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    if not isinstance(endpoint, str) or not endpoint.startswith(SCHEMES):
        raise ContractViolation(OP, field, rule, endpoint)
    scheme, _, address = endpoint.partition("://")
    if not address:
        raise ContractViolation(OP, field, rule, endpoint)
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) < 65536)):
            raise ContractViolation(OP, field, rule, endpoint)


def offset_endpoint(field: str, endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` of data-parallel rank ``r``: a TCP port + ``r``, an inproc name + ``_dp{r}``
    (vLLM's rule; an ipc path cannot be moved)."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + data_parallel_rank}"
    raise ContractViolation(OP, field, "must be tcp://HOST:PORT (a numbered port) or "
                            "inproc://NAME with a data-parallel rank > 0", endpoint)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an address with a wildcard (``*``, ``::``) or a local transport,
    connect to any other."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


# -- the wire ------------------------------------------------------------------------------------
class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``: positional)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event as a map tagged under ``"type"`` (vLLM 0.26+)."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event as a tagged array (vLLM <= 0.25)."""


class LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


def wire_events(events: Sequence[PageEvent], wire_format: str = "current") -> list[Any]:
    """The pool's events as the wire's structs."""
    out: list[Any] = []
    legacy = wire_format == "legacy"
    for ev in events:
        if isinstance(ev, PagesStored):
            if legacy:
                out.append(LegacyBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                             ev.block_size, None, MEDIUM, None))
            else:
                out.append(BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                       ev.block_size, None, MEDIUM, None, 0, SPEC_KIND))
        elif isinstance(ev, PagesRemoved):
            out.append(LegacyBlockRemoved(ev.block_hashes, MEDIUM) if legacy
                       else BlockRemoved(ev.block_hashes, MEDIUM, 0))
        elif isinstance(ev, PagesCleared):
            out.append(LegacyAllBlocksCleared() if legacy else AllBlocksCleared())
        else:
            raise ContractViolation("KVEventPublisher", "events", "must be pages.PageEvent",
                                    type(ev).__name__)
    return out


def encode_batch(events: Sequence[PageEvent], ts: float, data_parallel_rank: int,
                 wire_format: str = "current",
                 encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """One batch's msgpack payload."""
    batch = KVEventBatch(ts, wire_events(events, wire_format), data_parallel_rank)
    return (encoder or msgspec.msgpack.Encoder()).encode(batch)


# -- the publisher -------------------------------------------------------------------------------
def open_publisher(config: KVEventsConfig | None,
                   data_parallel_rank: int = 0) -> KVEventPublisher | None:
    """A started publisher when ``config`` enables events with the zmq publisher; None when
    events are off (``enable_kv_cache_events`` false or ``publisher`` ``null``: then the pool
    should not record them either)."""
    if config is None or not config.active:
        return None
    return KVEventPublisher(config, data_parallel_rank)


class KVEventPublisher:
    """Sends the pool's events to subscribers (see the module docstring).

    ``publish(events)`` once per engine step (a no-op for an empty list); ``close()`` when the
    engine stops. Raises ``ContractViolation`` naming ``endpoint`` / ``replay_endpoint`` when a
    socket cannot be opened. ``endpoint`` / ``replay_endpoint`` are the addresses opened
    (a bound wildcard port resolved); ``published`` / ``dropped`` count batches."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int) \
                or data_parallel_rank < 0:
            raise ContractViolation("KVEventPublisher", "data_parallel_rank",
                                    "must be an int >= 0", data_parallel_rank)
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        endpoint = offset_endpoint("endpoint", config.endpoint, data_parallel_rank)
        replay = (None if config.replay_endpoint is None else
                  offset_endpoint("replay_endpoint", config.replay_endpoint,
                                  data_parallel_rank))
        self._sender = _Sender(config, data_parallel_rank, endpoint, replay)
        self._sender.start()  # ContractViolation when a socket cannot be opened
        self._finalizer = weakref.finalize(self, self._sender.stop, CLOSE_TIMEOUT_S)

    @property
    def endpoint(self) -> str:
        return self._sender.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._sender.replay_endpoint

    @property
    def published(self) -> int:
        """Batches sent on the PUB socket."""
        return self._sender.sent

    @property
    def next_seq(self) -> int:
        """The sequence number of the next batch (batches numbered so far: sent, queued or
        dropped)."""
        return self._sender.next_seq

    @property
    def dropped(self) -> int:
        """Batches dropped: the queue was full (oldest first), or published after ``close``."""
        return self._sender.dropped

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def publish(self, events: Sequence[PageEvent]) -> None:
        """Queue one step's events as one batch (never blocks; the list is kept, not copied)."""
        if events:
            self._sender.put(events, time.time())

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        self._finalizer.detach()
        self._sender.stop(timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Sender:
    """The publisher's state and background thread (kept apart from ``KVEventPublisher`` so a
    dropped publisher can be finalised: the thread holds this object, not the publisher)."""

    def __init__(self, config: KVEventsConfig, rank: int, endpoint: str,
                 replay_endpoint: str | None) -> None:
        self.config, self.rank = config, rank
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = config.topic.encode("utf-8")
        self.lock = threading.Lock()
        self.queue: deque[tuple[int, float, Sequence[PageEvent]]] = deque()
        self.next_seq = 0
        self.sent = 0
        self.dropped = 0
        self.stopping = False
        self.error: Exception | None = None
        # the engine thread wakes the sender through a socket pair (pollable next to ZeroMQ's)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="pagedhybrid-kv-events",
                                       daemon=True)
        self.started = threading.Event()

    def start(self) -> None:
        self.thread.start()
        self.started.wait()
        if self.error is not None:
            self.thread.join()
            self._close_wake()
            raise self.error

    def put(self, events: Sequence[PageEvent], ts: float) -> None:
        with self.lock:
            if self.stopping:
                self.dropped += 1
                return
            seq = self.next_seq
            self.next_seq += 1
            if len(self.queue) >= self.config.max_queue_size:
                self.queue.popleft()
                self.dropped += 1
            wake = not self.queue
            self.queue.append((seq, ts, events))
        if wake:
            self._wake()

    def stop(self, timeout: float) -> None:
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        self._wake()
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self._close_wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # already awake (the pair's buffer is full) or closed
            self.wake_w.send(b"\0")

    def _close_wake(self) -> None:
        self.wake_r.close()
        self.wake_w.close()

    # -- the background thread ----------------------------------------------------------------
    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        field, address = "endpoint", self.endpoint
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            if binds(address):
                pub.bind(address)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(address)
            if self.replay_endpoint is not None:
                field, address = "replay_endpoint", self.replay_endpoint
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(address)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            raise ContractViolation(OP, field, f"cannot be opened: {exc}", address) from None
        return pub, replay

    def _run(self) -> None:
        ctx = zmq.Context.instance()  # the process's context, as vLLM's (inproc:// works)
        try:
            pub, replay = self._open(ctx)
        except ContractViolation as exc:
            self.error = exc
            self.started.set()
            return
        self.started.set()
        legacy = self.config.wire_format == "legacy"
        encoder = msgspec.msgpack.Encoder()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        poller = zmq.Poller()
        poller.register(self.wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1000))
                if self.wake_r.fileno() in ready:  # (raw sockets come back as their fd)
                    with contextlib.suppress(OSError):  # (BlockingIOError when drained)
                        while self.wake_r.recv(4096):
                            pass
                with self.lock:
                    batches = list(self.queue)
                    self.queue.clear()
                    stopping = self.stopping
                for seq, ts, events in batches:
                    try:
                        payload = encode_batch(events, ts, self.rank,
                                               self.config.wire_format, encoder)
                        pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                    except Exception as exc:  # a bad batch is lost alone; the thread goes on
                        print(f"pagedhybrid: KV events batch {seq} not sent: "
                              f"{type(exc).__name__}: {exc}", file=sys.stderr)
                        with self.lock:
                            self.dropped += 1
                        continue
                    kept.append((seq, payload))
                    self.sent += 1
                if replay is not None and replay in ready:
                    self._replay(replay, kept, legacy)
                if stopping:
                    break
        finally:
            pub.close(linger=int(CLOSE_TIMEOUT_S * 1000))  # queued messages may still go out
            if replay is not None:
                replay.close(linger=0)

    def _replay(self, replay: zmq.Socket, kept: deque[tuple[int, bytes]], legacy: bool) -> None:
        """Answer every waiting replay request: ``[id, "", start_seq]``."""
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                print(f"pagedhybrid: KV events replay request ignored: {len(frames)} frames "
                      "(expected [identity, '', 8-byte start sequence number])",
                      file=sys.stderr)
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            head = (client, b"") if legacy else (client, b"", self.topic)
            for seq, payload in kept:
                if seq >= first:
                    replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
            end = (client, b"") if legacy else (client, b"", b"")
            replay.send_multipart((*end, END_SEQ, b""))
