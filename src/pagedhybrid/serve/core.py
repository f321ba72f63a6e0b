"""The engine in a process of its own (vLLM's engine core), fed over pipes: the server's one
bridge to ``Engine``.

Why a process: with the engine on a thread of the HTTP process, every streamed token's JSON
and socket work held the GIL the engine needed between its kernels, so each step waited for the
event loop and online inter-token latency was 1.3-1.7x the offline figure. Here the two run on
their own cores and share nothing but two pipes.

``EngineClient.launch(factory)`` forks the core process, which builds its engine with ``factory()``
(a refusal -- a config that does not fit, a missing checkpoint -- comes back as a
``PagedHybridError`` from ``launch``) and reports ``CoreInfo``. In the server process ``submit`` /
``abort`` / ``close`` are called on the event loop (``close`` from any thread) and return at once: a
sender thread writes the messages, so a long step never blocks the event loop on a full pipe. The
core reads them between steps, runs ``engine.step()`` while there is work (blocking on its pipe
otherwise) and sends each step's outputs as the engine's deltas (``SequenceDelta``: the new tokens,
the new text, the new logprobs, the prompt once) with a ``Snapshot`` of the engine for the metrics.
Neither end ever waits on the other: the core pickles a message on the engine's thread and a writer
thread puts it on the pipe (``_Outbox``); in the server a reader thread takes whole messages off the
pipe in blocking reads -- a message of any size, in as many reads as it takes -- and hands each to
the event loop, which puts each delta on its request's asyncio queue as it came (a slow client's
queue grows; nothing else waits for it): the server applies deltas and streams deltas, never a
rebuilt whole output; ``on_step(snapshot, deltas)`` runs there too (metrics). An ``add_request``
refusal comes back on the request's queue as an ``EngineRefusal``.

Nothing one request does stops the core: any exception at intake refuses that request alone; a
step that raises fails that step's requests inside ``Engine.step``; an exception anywhere else
in an iteration is logged, the running requests fail with an error, the pools are checked and
the core goes on (``degraded`` until the next good iteration). If the core process itself dies
(a native crash, the kernel's OOM killer) -- known from the end of its pipe or from its exit
status, checked each second it sends nothing, never from a read error while it lives -- every
request in flight fails with an error naming its exit code and ``alive`` turns false; the HTTP
process keeps answering (503 / ``/health`` "error"). So does an engine that turns dead
(``Engine.dead``: a tensor-parallel rank went away): the core sends the reason, which every
request in flight fails with, and ends. The core ignores SIGINT / SIGTERM (the server shuts it
down over the pipe, after the in-flight requests had their time) and exits when the server
process is gone (end of pipe).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from pagedhybrid.engine import Engine, SamplingParams, SequenceDelta, SequenceOutput
from pagedhybrid.engine.core.stats import SpecStats
from pagedhybrid.errors import EngineDead, PagedHybridError

LIVENESS_S = 1.0  # how often the server checks the engine process while it sends nothing


class EngineRefusal(NamedTuple):
    request_id: str
    error: Exception


class Closing(Exception):
    """The server is shutting down: a request submitted now is refused (503)."""


class EngineInternalError(RuntimeError):
    """The engine failed to admit a request for a reason of its own (the message names it)."""


class Refused(PagedHybridError):
    """The engine refused a request (its message and the field it names, from the core)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know of the engine, reported once it is built."""

    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    kernel_summary: str
    memory_summary: str


@dataclass(frozen=True)
class Snapshot:
    """The engine after a step, for the metrics (``ServerMetrics.on_step``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    slot_usage: float = 0.0
    preemptions: int = 0
    prefix: dict[str, float | int] = field(default_factory=dict)
    spec: SpecStats = field(default_factory=SpecStats)

    @classmethod
    def of(cls, engine: Engine) -> Snapshot:
        s = engine.scheduler
        return cls(len(s.running), len(s.waiting), engine.blocks.num_owned /
                   engine.blocks.capacity, engine.states.num_owned / engine.states.capacity,
                   engine.stats.preemptions, engine.prefix_cache_stats(),
                   dataclasses.replace(engine.stats.spec,
                                       accepted_per_pos=list(engine.stats.spec.accepted_per_pos)))


# -- the core process ---------------------------------------------------------------------------
class _Outbox:
    """The core's end of the pipe to the server: ``send`` pickles the message on the engine's
    thread (so an unpicklable output fails there, where it is recovered) and a writer thread
    puts the bytes on the pipe, however long that takes; the engine loop never waits for the
    server to read. After a failed write (the server is gone) ``send`` raises ``OSError``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._broken: OSError | None = None
        self._writer = threading.Thread(target=self._write, name="pagedhybrid-to-server",
                                        daemon=True)
        self._writer.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        if self._broken is not None:
            raise self._broken
        self._queue.put(ForkingPickler.dumps(msg))  # its buffer, as Connection.send sends it

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError as exc:
                self._broken = exc
                return

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (at most ``timeout`` seconds), then stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout)


class _Core:
    """The engine's loop in the core process."""

    def __init__(self, engine: Engine, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = _Outbox(outbox)
        self.closing: str | None = None
        self.stopping = False
        self.degraded = False
        self.taken = 0  # submissions read from the pipe
        self.snapshot = Snapshot()

    def run(self) -> None:
        try:
            while not self.stopping:
                try:
                    self._iterate()
                    if self.degraded:  # a good iteration after a failed one: say so at once
                        self.degraded = False
                        self._send([])
                except (EOFError, OSError):  # the server process is gone
                    return
                except Exception as exc:  # one bad iteration must not end serving
                    self._recover(exc)
        finally:
            for rid in list(self.engine.scheduler.requests):
                self.engine.abort_request(rid)
            if self.engine.has_unfinished_requests():
                with contextlib.suppress(OSError):
                    self._send(self.engine.step())
            self.outbox.close()

    def _iterate(self) -> None:
        if not self.engine.has_unfinished_requests():
            # idle: sleep until the server writes (degraded: come back soon to clear it)
            self.inbox.poll(0.05 if self.degraded else None)
        self._intake()
        if self.stopping or not self.engine.has_unfinished_requests():
            return
        self._send(self.engine.step())
        if self.engine.dead is not None:  # a tensor-parallel rank is gone: the core ends
            self.outbox.send(("dead", self.engine.dead))
            self.stopping = True

    def _intake(self) -> None:
        while self.inbox.poll(0):
            msg = self.inbox.recv()
            kind = msg[0]
            if kind == "submit":
                self._add(*msg[1:])
            elif kind == "abort":
                self.engine.abort_request(msg[1])  # frees its pages and slot now
            elif kind == "close":
                self.closing = msg[1]
            elif kind == "stop":
                self.stopping = True
        if self.closing is not None and self.engine.scheduler.requests:
            self._send(self.engine.fail_requests(
                list(self.engine.scheduler.requests.values()), self.closing))

    def _add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.taken += 1
        try:
            if self.closing is not None:
                raise Closing(self.closing)
            self.engine.add_request(rid, prompt, params)
        except Exception as exc:  # any refusal concerns this request alone
            if isinstance(exc, (Closing, EngineDead)):
                kind, what = "closing", None
            elif isinstance(exc, PagedHybridError):
                kind = "invalid"
                what = getattr(exc, "what", None) or getattr(exc, "where", None) or "prompt"
            else:
                kind, what = "internal", None
            self.outbox.send(("refused", rid, kind, None if what is None else str(what),
                              f"{type(exc).__name__}: {exc}" if kind == "internal"
                              else str(exc), self.taken, len(self.engine.scheduler.waiting)))

    def _send(self, outputs: Sequence[SequenceOutput]) -> None:
        try:  # the metrics' view; a failure here never loses the step's outputs
            self.snapshot = Snapshot.of(self.engine)
        except Exception as exc:
            print(f"pagedhybrid: engine snapshot failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        self.outbox.send(("out", [o.delta() for o in outputs], self.snapshot,
                          self.degraded, self.taken))

    def _recover(self, exc: Exception) -> None:
        """An iteration raised outside ``Engine.step``: fail what was running (its outputs may
        be lost), check the pools and carry on."""
        self.degraded = True
        print(f"pagedhybrid: engine loop error: {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        why = f"internal error in the engine loop: {type(exc).__name__}: {exc}"
        outs = self.engine.fail_requests(list(self.engine.scheduler.running), why)
        self.engine.check_invariants()
        with contextlib.suppress(Exception):
            self._send(outs)


def _core_main(factory: Callable[[], Engine], inbox: Connection, outbox: Connection,
               server_ends: Sequence[Connection]) -> None:
    for end in server_ends:  # so that the server's exit is an end of pipe here
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the core stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = factory()
        info = CoreInfo(engine.scheduler.config.max_model_len, engine.model.config.vocab_size,
                        engine.tokenizer is not None, engine.runner.kernel_summary(),
                        engine.memory.summary())
    except BaseException as exc:
        outbox.send(("failed", str(exc) if isinstance(exc, PagedHybridError)
                     else f"{type(exc).__name__}: {exc}"))
        return
    outbox.send(("ready", info))
    try:
        _Core(engine, inbox, outbox).run()
    finally:
        engine.close()  # the other tensor-parallel ranks, the KV-events publisher


# -- the server process -------------------------------------------------------------------------
class EngineClient:
    """The server's handle on the core process (``launch`` starts it)."""

    def __init__(self, proc: Any, to_core: Connection, from_core: Connection,
                 info: CoreInfo) -> None:
        self.proc, self.info = proc, info
        self._to_core, self._from_core = to_core, from_core
        self._outgoing: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="pagedhybrid-to-core",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="pagedhybrid-from-core",
                                        daemon=True)
        self._stopping = False
        self._sinks: dict[str, asyncio.Queue[Any]] = {}  # each request's, until it finishes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._submitted = 0
        self._taken = 0
        self._snapshot = Snapshot()
        self.on_step: Callable[[Snapshot, Sequence[SequenceDelta]], None] | None = None
        self.error: str | None = None  # why the core is gone
        self._dead: str | None = None  # why the engine stopped serving (it said so)
        self.closing: str | None = None  # why the server is shutting down (``close``)
        self.degraded = False  # the core's last iteration failed outside a step

    @classmethod
    def launch(cls, factory: Callable[[], Engine]) -> EngineClient:
        """Fork the core process, build the engine there, wait until it is ready."""
        ctx = mp.get_context("fork")  # the core inherits the loaded modules (and test patches)
        core_in, to_core = ctx.Pipe(duplex=False)
        from_core, core_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_core_main, name="pagedhybrid-engine", daemon=True,
                           args=(factory, core_in, core_out, (to_core, from_core)))
        proc.start()
        core_in.close()
        core_out.close()
        try:
            msg = from_core.recv()
        except EOFError:
            proc.join(5)
            raise PagedHybridError(f"the engine process exited (code {proc.exitcode}) while "
                                   "loading the model") from None
        except BaseException:  # interrupted while loading (Ctrl-C): the core goes too
            proc.kill()
            proc.join(5)
            raise
        if msg[0] == "failed":
            proc.join(5)
            raise PagedHybridError(msg[1])
        return cls(proc, to_core, from_core, msg[1])

    # -- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's messages (a thread of their own, see ``_read_loop``) and
        the sender thread; call on the event loop."""
        self._loop = asyncio.get_running_loop()
        self._reader.start()
        self._sender.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any] | None = None) -> asyncio.Queue[Any]:
        """Queue a request; its outputs (or an ``EngineRefusal``) arrive on ``sink`` (a new
        queue unless one is given: several requests may share one)."""
        sink = sink if sink is not None else asyncio.Queue()
        if self.error is not None:
            sink.put_nowait(EngineRefusal(request_id, Closing(self.error)))
            return sink
        self._sinks[request_id] = sink
        self._submitted += 1
        self._outgoing.put(("submit", request_id, list(prompt), params))
        return sink

    def abort(self, request_id: str) -> None:
        self._outgoing.put(("abort", request_id))

    def close(self, why: str) -> None:
        """Fail every request in the engine with ``why`` and refuse later ones (any thread)."""
        self.closing = why
        self._outgoing.put(("close", why))

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.is_alive()

    def num_waiting(self) -> int:
        """Requests accepted but not running yet (queued in the engine or not yet read)."""
        return self._submitted - self._taken + self._snapshot.waiting

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the core and close both pipes; what it still sends is read and dropped (the
        handlers are done), so its last writes never wait on a full pipe. Before ``start``
        (no sender yet) the end of its pipe stops it."""
        self._stopping = True
        if self._sender.is_alive():
            self._outgoing.put(("stop",))
            self._outgoing.put(None)
            self._sender.join(timeout)
        self._to_core.close()
        if not self._reader.is_alive():  # nobody reads: the core's last sends fail at once
            self._from_core.close()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self._reader.ident is not None:  # started: at the end of the pipe now
            self._reader.join(timeout)
        if not self._from_core.closed:
            self._from_core.close()

    def _send_loop(self) -> None:
        while (msg := self._outgoing.get()) is not None:
            try:
                self._to_core.send(msg)
            except OSError:  # the core is gone; the reader thread reports it
                return
            except Exception as exc:  # this message could not be sent: its request fails
                if msg[0] == "submit" and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._unsent, msg[1], exc)

    def _unsent(self, request_id: str, exc: Exception) -> None:
        self._submitted -= 1
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put_nowait(EngineRefusal(request_id, EngineInternalError(
                f"the request could not be sent to the engine: {type(exc).__name__}: {exc}")))

    def _read_loop(self) -> None:
        """The reader thread: whole messages off the pipe, in blocking reads (a message of any
        size arrives in as many reads as it takes), each handed to the event loop. The engine
        is declared gone only by the process itself: the end of the pipe, or its exit found by
        the liveness check every ``LIVENESS_S`` while nothing comes."""
        conn, loop = self._from_core, self._loop
        assert loop is not None
        why = None
        while why is None:
            try:
                if not conn.poll(LIVENESS_S):
                    if not self.proc.is_alive():
                        why = "exited"
                    continue
                msg = conn.recv()
            except (EOFError, OSError):  # every write end is closed: the core has ended
                why = "pipe"
                continue
            except Exception as exc:  # one message that cannot be read (unpickling)
                print(f"pagedhybrid: a message from the engine could not be read: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            if self._stopping:
                continue
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._handle, msg)
        if not self._stopping:
            self.proc.join(5)  # its exit status, off the event loop
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._core_died)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "dead":  # the core ends now (its requests have failed already)
            self._dead = msg[1]
            self._core_died()
            return
        if msg[0] == "refused":
            _, rid, kind, what, message, self._taken, waiting = msg
            self._snapshot = dataclasses.replace(self._snapshot, waiting=waiting)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                exc: Exception = Closing(message) if kind == "closing" else \
                    Refused(message, what) if kind == "invalid" else EngineInternalError(message)
                sink.put_nowait(EngineRefusal(rid, exc))
            return
        _, deltas, self._snapshot, self.degraded, self._taken = msg
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is not None:
                if d.finished:
                    del self._sinks[d.request_id]
                sink.put_nowait(d)
        if self.on_step is not None:
            try:
                self.on_step(self._snapshot, deltas)
            except Exception as exc:  # a hook (metrics) never fails requests
                print(f"pagedhybrid: on_step hook failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    def _core_died(self) -> None:
        if self.error is not None or self._stopping:
            return
        if self._dead is None:
            self.error = (f"the engine process exited (code {self.proc.exitcode})"
                          if not self.proc.is_alive() else
                          "the engine process closed its end of the pipe")
        else:
            self.error = f"the engine stopped: {self._dead}"
        self._submitted = self._taken  # nothing is waiting any more
        print(f"pagedhybrid: {self.error}", file=sys.stderr)
        for rid, sink in self._sinks.items():
            sink.put_nowait(SequenceDelta(rid, 0, (), None, None, True, "error", None,
                                          self.error, 0, 0, None, None))
        self._sinks.clear()
