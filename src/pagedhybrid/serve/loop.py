"""The engine on its own thread, fed from asyncio: the server's one bridge to ``Engine``.

``EngineLoop.start()`` runs a thread that owns the engine: it takes new requests and aborts from
thread-safe queues between steps, runs ``engine.step()`` while there is work (sleeping on an
event otherwise), and hands every ``RequestOutput`` to the asyncio queue of its request with
``loop.call_soon_threadsafe`` -- so HTTP handling never waits for a step and a step never waits
for HTTP. ``submit`` is called on the event loop and returns at once with the request's queue;
an ``add_request`` refusal (a request the handler's checks let through) comes back on that queue
as an ``EngineRefusal``. After each step, ``on_step(engine, outputs)`` runs on the engine
thread (metrics). ``close(why)`` starts a shutdown: every request still in the engine fails
with ``why`` (its client gets a last answer, not a cut connection) and later submissions are
refused with ``Closing``. ``stop()`` aborts what is left and joins the thread.

Nothing one request does stops the loop: any exception at intake refuses that request alone; a
step that raises fails that step's requests inside ``Engine.step``; an exception anywhere else
in an iteration (a hook, a delivery) is logged, the running requests fail with an error, the
pools are checked and the loop goes on. ``degraded`` is set only while an iteration is failing
and cleared by the next good one; ``alive`` says whether the thread runs at all.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pagedhybrid.engine import Engine, RequestOutput, SamplingParams


class EngineRefusal(NamedTuple):
    request_id: str
    error: Exception


class Closing(Exception):
    """The server is shutting down: a request submitted now is refused (503)."""


class _Submission(NamedTuple):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    def __init__(self, engine: Engine,
                 on_step: Callable[[Engine, Sequence[RequestOutput]], None] | None = None
                 ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._inbox: queue.SimpleQueue[_Submission] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue[Any], asyncio.AbstractEventLoop]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0  # submitted, not yet added to the engine
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagedhybrid-engine",
                                        daemon=True)
        self.error: BaseException | None = None
        self.closing: str | None = None  # why the server is shutting down (``close``)
        self.degraded = False  # the last iteration failed outside a step
        self.loop_failures = 0

    # -- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any] | None = None) -> asyncio.Queue[Any]:
        """Queue a request; its outputs (or an ``EngineRefusal``) arrive on ``sink`` (a new
        queue unless one is given: several requests may share one)."""
        sink = sink if sink is not None else asyncio.Queue()
        with self._lock:
            self._pending += 1
        self._inbox.put(_Submission(request_id, prompt, params, sink,
                                    asyncio.get_running_loop()))
        self._wake.set()
        return sink

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def close(self, why: str) -> None:
        """Fail every request in the engine with ``why`` and refuse later ones (thread-safe)."""
        self.closing = why
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        """Requests accepted but not running yet (queued in the engine or not yet added)."""
        with self._lock:
            return self._pending + len(self.engine.scheduler.waiting)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._sinks.get(request_id)
        if target is not None:
            sink, loop = target
            loop.call_soon_threadsafe(sink.put_nowait, item)
            if isinstance(item, EngineRefusal) or (isinstance(item, RequestOutput)
                                                   and item.finished):
                self._sinks.pop(request_id, None)

    def _intake(self) -> None:
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._sinks[sub.request_id] = (sub.sink, sub.loop)
            try:
                if self.closing is not None:
                    raise Closing(self.closing)
                self.engine.add_request(sub.request_id, sub.prompt, sub.params)
            except Exception as exc:  # any refusal concerns this request alone
                self._deliver(sub.request_id, EngineRefusal(sub.request_id, exc))
            finally:
                with self._lock:
                    self._pending -= 1
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                break
            self.engine.abort_request(rid)  # frees its pages and slot now
        if self.closing is not None and self.engine.scheduler.requests:
            for o in self.engine.fail_requests(list(self.engine.scheduler.requests.values()),
                                               self.closing):
                self._deliver(o.request_id, o)

    def _iterate(self) -> None:
        self._intake()
        if not self.engine.has_unfinished_requests():
            self._wake.wait(0.05)
            self._wake.clear()
            return
        outs = self.engine.step()
        for o in outs:
            self._deliver(o.request_id, o)
        if self.on_step is not None:
            try:
                self.on_step(self.engine, outs)
            except Exception as exc:  # a hook (metrics) never fails requests
                print(f"pagedhybrid: on_step hook failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    def _recover(self, exc: Exception) -> None:
        """An iteration raised outside ``Engine.step``: fail what was running (its outputs may
        be lost), check the pools and carry on."""
        self.degraded = True
        self.loop_failures += 1
        print(f"pagedhybrid: engine loop error: {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        why = f"internal error in the engine loop: {type(exc).__name__}: {exc}"
        for o in self.engine.fail_requests(list(self.engine.scheduler.running), why):
            self._deliver(o.request_id, o)
        self.engine.check_invariants()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                    self.degraded = False
                except Exception as exc:  # one bad iteration must not end serving
                    self._recover(exc)
        except BaseException as exc:  # the loop must not die silently
            self.error = exc
            raise
        finally:
            self._intake()
            for rid in list(self.engine.scheduler.requests):
                self.engine.abort_request(rid)
            for o in self.engine.step() if self.engine.has_unfinished_requests() else []:
                self._deliver(o.request_id, o)
