"""The engine on its own thread, fed from asyncio: the server's one bridge to ``Engine``.

``EngineLoop.start()`` runs a thread that owns the engine: it takes new requests and aborts from
thread-safe queues between steps, runs ``engine.step()`` while there is work (sleeping on an
event otherwise), and hands every ``RequestOutput`` to the asyncio queue of its request with
``loop.call_soon_threadsafe`` -- so HTTP handling never waits for a step and a step never waits
for HTTP. ``submit`` is called on the event loop and returns at once with the request's queue;
an ``add_request`` refusal (a request the handler's checks let through) comes back on that queue
as an ``EngineRefusal``. After each step, ``on_step(engine, outputs)`` runs on the engine
thread (metrics). ``stop()`` aborts what is left and joins the thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pagedhybrid.engine import Engine, RequestOutput, SamplingParams
from pagedhybrid.errors import PagedHybridError


class EngineRefusal(NamedTuple):
    request_id: str
    error: PagedHybridError


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
                self.engine.add_request(sub.request_id, sub.prompt, sub.params)
            except PagedHybridError as exc:
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

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._intake()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
                for o in outs:
                    self._deliver(o.request_id, o)
                if self.on_step is not None:
                    self.on_step(self.engine, outs)
        except BaseException as exc:  # the loop must not die silently
            self.error = exc
            raise
        finally:
            self._intake()
            for rid in list(self.engine.scheduler.requests):
                self.engine.abort_request(rid)
            for o in self.engine.step() if self.engine.has_unfinished_requests() else []:
                self._deliver(o.request_id, o)
