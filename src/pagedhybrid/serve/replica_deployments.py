"""The Ray Serve application of ``pagedhybrid serve --replicas N``: engine replicas behind one
ingress.

``EngineReplica`` (N replicas, ``num_cpus`` each): its constructor starts a real
``pagedhybrid serve`` process on 127.0.0.1 and a free port (the launcher's engine options,
``--api-key`` through the environment), through a guard that makes the kernel send it SIGTERM
when the replica's process dies (``PR_SET_PDEATHSIG``: no orphan servers, even when Ray kills
the replica outright), and waits for its ``/health``. ``forward`` passes one HTTP request to it
and yields a head (``{"status", "headers", "replica"}``) then the body bytes as they come (SSE
chunk by chunk); when the caller cancels (its client went away) the upstream stream is closed,
so the server aborts the request. A server that cannot be reached yields a 503 head marked
``retry`` (nothing reached it: the ingress tries another replica). ``check_health`` (Ray Serve
calls it every ``health_check_period_s``) raises when the server exited or its ``/health`` is not
ok, and Ray Serve replaces the replica. Shutdown (``__del__``) stops the server with SIGTERM
(its own graceful shutdown), then SIGKILL.

``Ingress`` (FastAPI, one replica, no CPU): the one OpenAI endpoint. ``/v1/completions`` and
``/v1/chat/completions`` are tokenized as the server does (its tokenizer, chat template and
protocol models) and their page chain hashes (``engine.pages.chain_hashes``) go with the call
as a ``replica_routing.Route`` for the prefix-aware router; every other path is passed to a
replica as it is (``/v1/models``, ``/tokenize``, ``/version``, ``/openapi.json``, unknown paths'
404s). ``/health``
asks every replica (200 ``ok`` when all are, ``degraded`` when some are, 503 when none);
``/metrics`` is every replica's metrics, labelled and aggregated (``replica_metrics``).
"""

# no ``from __future__ import annotations`` here: Ray Serve's class-based FastAPI views
# resolve the routes' annotations (``Request``) in another module's namespace

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedhybrid.engine.core.pages import chain_hashes
from pagedhybrid.serve.replica_metrics import ReplicaMetrics, aggregate
from pagedhybrid.serve.replica_routing import Route, router_of
from pagedhybrid.serve.replica_spec import ENGINE_DEPLOYMENT, ReplicaSpec

# Runs as ``python -c _GUARD PARENT_PID serve ARGS...``: the kernel sends the server SIGTERM
# when the thread that started it (the replica's user-code thread, alive as long as the
# replica) exits; then the process becomes ``python -m pagedhybrid serve ARGS...`` (same pid).
_GUARD = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the replica is already gone
os.execv(sys.executable, [sys.executable, "-m", "pagedhybrid", *sys.argv[2:]])
"""
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
        "upgrade", "proxy-connection", "accept-encoding", "date", "server"}
_HEALTH_TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error_body(message: str, code: str = "service_unavailable") -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineReplica:
    """One ``pagedhybrid serve`` process (see the module docstring)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self.spec = spec
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-c", _GUARD, str(os.getpid()), "serve", *spec.server_argv,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, text=True,
                                     errors="replace")
        threading.Thread(target=self._pump, name="pagedhybrid-replica-log", daemon=True).start()
        self._client: httpx.AsyncClient | None = None
        self._wait_ready(spec.start_timeout_s)
        try:
            import ray

            self.node = ray.util.get_node_ip_address()
        except Exception:  # only a label of the metrics
            self.node = socket.gethostname()

    def _pump(self) -> None:
        """The server's output: to this replica's stderr (Ray's logs) and a tail kept for
        errors."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            sys.stderr.write(f"[replica {self.replica} pid {self.proc.pid}] {line}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as h:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    time.sleep(0.2)  # the last lines reach the tail
                    raise RuntimeError(f"the engine server exited with code {code} while "
                                       "starting:\n" + "\n".join(self.tail))
                with contextlib.suppress(httpx.HTTPError):
                    if h.get(f"{self.base}/health").status_code == 200:
                        return
                time.sleep(0.2)
        self._stop()
        raise RuntimeError(f"the engine server was not healthy within {timeout_s:g} s:\n"
                           + "\n".join(self.tail))

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the replica's event loop, where it is used
            self._client = httpx.AsyncClient(
                base_url=self.base, timeout=httpx.Timeout(None, connect=5.0, write=60.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    def info(self, route: Route | None = None) -> dict[str, str]:
        return {"replica": self.replica, "pid": str(self.proc.pid), "port": str(self.port),
                "node": self.node}

    async def forward(self, method: str, path: str, query: str, body: bytes,
                      headers: dict[str, str], route: Route | None = None
                      ) -> AsyncIterator[dict[str, Any] | bytes]:
        """One HTTP request to the server: a head, then the body's chunks (see the module
        docstring). ``route`` is the router's."""
        url = path + (f"?{query}" if query else "")
        try:
            req = self.client.build_request(method, url, content=body, headers=headers)
            resp = await self.client.send(req, stream=True)
        except httpx.TransportError as exc:
            # no connection: the request never reached the server (another replica may take it)
            retry = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
            yield {"status": 503, "retry": retry, "replica": self.replica,
                   "headers": {"content-type": "application/json"}}
            yield _error_body(f"engine replica {self.replica} cannot be reached "
                              f"({type(exc).__name__}: {exc})")
            return
        try:
            yield {"status": resp.status_code, "replica": self.replica,
                   "headers": {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}}
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:  # the server went away mid-answer
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                yield b"data: " + _error_body(f"engine replica {self.replica} failed "
                                              f"mid-stream: {type(exc).__name__}") + b"\n\n"
        finally:
            await resp.aclose()  # on cancellation too: the server sees the disconnect

    async def metrics(self, route: Route | None = None) -> tuple[dict[str, str], str]:
        try:
            resp = await self.client.get("/metrics", timeout=_HEALTH_TIMEOUT_S)
            text = resp.text if resp.status_code == 200 else ""
        except httpx.HTTPError:
            text = ""
        return self.info(), text

    async def health(self, route: Route | None = None) -> tuple[dict[str, str], str]:
        code = self.proc.poll()
        if code is not None:
            return self.info(), f"exited ({code})"
        try:
            resp = await self.client.get("/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return self.info(), f"unreachable ({type(exc).__name__})"
        return self.info(), "ok" if resp.status_code == 200 else \
            str(resp.json().get("status", resp.status_code))

    async def check_health(self) -> None:
        _, status = await self.health()
        if status != "ok":
            raise RuntimeError(f"engine server pid {self.proc.pid}: {status}")

    def _stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.spec.shutdown_timeout_s + 10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10.0)

    def __del__(self) -> None:
        self._stop()


# no docs routes of its own: /openapi.json and /docs are the server's, passed through
app = FastAPI(title="pagedhybrid replicas", openapi_url=None, docs_url=None, redoc_url=None)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    """The one OpenAI endpoint over the engine replicas (see the module docstring)."""

    def __init__(self, engine: DeploymentHandle, spec: ReplicaSpec) -> None:
        from pagedhybrid.models.qwen35 import load_tokenizer

        self.engine = engine
        self.spec = spec
        self.app_name = serve.get_replica_context().app_name
        self.tokenizer = load_tokenizer(Path(spec.model_dir))
        if spec.chat_template is not None:
            source = Path(spec.chat_template)
            self.tokenizer.chat_template = (source.read_text() if source.is_file()
                                            else spec.chat_template)

    # -- routing ---------------------------------------------------------------------------------
    def _prompt_ids(self, path: str, body: bytes) -> list[int]:
        """The first prompt's token ids as the server computes them (any failure: [] -- the
        server itself answers a bad body)."""
        from pagedhybrid.serve.protocol import ChatCompletionRequest, CompletionRequest

        try:
            data = json.loads(body)
            if path.endswith("/chat/completions"):
                chat = ChatCompletionRequest.model_validate(data)
                rendered = [m.for_template(f"messages[{i}]")
                            for i, m in enumerate(chat.messages)]
                tools = chat.tool_spec()
                extra = {"tools": tools.for_template()} if tools is not None else {}
                text = str(self.tokenizer.apply_chat_template(
                    rendered, add_generation_prompt=chat.add_generation_prompt, **extra,
                    **(chat.chat_template_kwargs or {})))
                return list(self.tokenizer.encode(
                    text, add_special_tokens=chat.add_special_tokens))
            comp = CompletionRequest.model_validate(data)
            texts, ids = comp.prompts()
            if ids is not None:
                return ids[0]
            return list(self.tokenizer.encode(texts[0],
                                              add_special_tokens=comp.add_special_tokens))
        except Exception:
            return []

    async def _route(self, path: str, body: bytes) -> Route:
        ids = await asyncio.to_thread(self._prompt_ids, path, body)
        return Route(tuple(chain_hashes(ids, self.spec.block_size, None)))

    def _router(self) -> Any:
        return router_of(self.app_name, ENGINE_DEPLOYMENT)

    async def _replica_ids(self) -> tuple[str, ...]:
        router = self._router()
        if router is None or not router.replica_ids:  # the handle's router starts on a call
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.info.remote(), _HEALTH_TIMEOUT_S * 2)
            router = self._router()
        return router.replica_ids if router is not None else ()

    async def _each(self, method: str) -> list[tuple[str, Any]]:
        """``method`` on every replica: (replica, result or exception). One pinned call after
        the other: calls made within one request share its internal request id, by which Ray
        Serve's router matches a routing decision to its call, so concurrent ones would mix."""
        out: list[tuple[str, Any]] = []
        for rid in await self._replica_ids():
            call = getattr(self.engine, method).remote(route=Route(pin=rid))
            try:
                info, value = await asyncio.wait_for(call, 2 * _HEALTH_TIMEOUT_S)
                out.append((rid, (info, value) if info["replica"] == rid
                            else RuntimeError(f"replica {rid} is gone")))
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:
                call.cancel()
                out.append((rid, exc))
        return out

    # -- forwarding ------------------------------------------------------------------------------
    async def _forward(self, request: Request, route: Route, body: bytes) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        path, query = request.url.path, request.url.query
        avoid: set[str] = set()
        gen: Any = None
        try:
            for attempt in range(3):
                gen = self.engine.options(stream=True).forward.remote(
                    request.method, path, query, body, headers,
                    route=replace(route, avoid=frozenset(avoid)))
                head = await gen.__anext__()
                if head.get("retry") and attempt < 2:
                    avoid.add(head["replica"])
                    gen.cancel()
                    continue
                break
        except BaseException as exc:
            if gen is not None:
                gen.cancel()
            if isinstance(exc, Exception):
                return Response(_error_body(f"no engine replica answered: "
                                            f"{type(exc).__name__}: {exc}"), status_code=503,
                                media_type="application/json")
            raise
        status, out_headers = head["status"], dict(head["headers"])
        media = out_headers.pop("content-type", None)
        if not (media or "").startswith("text/event-stream"):
            try:
                content = b"".join([chunk async for chunk in gen])
            except Exception as exc:
                return Response(_error_body(f"engine replica {head['replica']} failed: "
                                            f"{type(exc).__name__}"), status_code=503,
                                media_type="application/json")
            finally:
                gen.cancel()
            return Response(content, status_code=status, headers=out_headers, media_type=media)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen:
                    yield chunk
            except Exception as exc:  # the replica died mid-stream: a last error event
                yield b"data: " + _error_body(f"engine replica {head['replica']} failed "
                                              f"mid-stream: {type(exc).__name__}") + b"\n\n"
            finally:
                gen.cancel()  # the client went away (or the stream ended): upstream closes

        return StreamingResponse(events(), status_code=status, headers=out_headers,
                                 media_type=media)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = await request.body()
        return await self._forward(request, await self._route(request.url.path, body), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = await request.body()
        return await self._forward(request, await self._route(request.url.path, body), body)

    @app.get("/health")
    async def health(self) -> Response:
        results = await self._each("health")
        states = {rid: (r[1] if not isinstance(r, BaseException) else
                        f"{type(r).__name__}: {r}") for rid, r in results}
        ok = sum(s == "ok" for s in states.values())
        # "ok" once the router knows at least the replicas asked for (the lower bound when
        # autoscaling), all healthy: before, some are still starting (and get no traffic)
        want = (self.spec.autoscaling["min_replicas"] if self.spec.autoscaling
                else self.spec.num_replicas)
        status = "ok" if ok and ok == len(states) and ok >= want else \
            "degraded" if ok else "error"
        return JSONResponse({"status": status, "replicas": states},
                            status_code=200 if status == "ok" else 503 if not ok else 200)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        reps = [ReplicaMetrics(rid, {k: v for k, v in r[0].items() if k != "replica"}, r[1])
                for rid, r in await self._each("metrics") if not isinstance(r, BaseException)]
        router = self._router()
        routed, pages = router.counters() if router is not None else ({}, {})
        return Response(aggregate(reps, routed, pages), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                            "OPTIONS"])
    async def other(self, request: Request, path: str) -> Response:
        return await self._forward(request, Route(), await request.body())


def build_application(spec: ReplicaSpec) -> Any:
    """The Ray Serve application (engine replicas + ingress) for ``spec``."""
    from ray.serve.config import RequestRouterConfig

    scale: dict[str, Any] = ({"autoscaling_config": spec.autoscaling} if spec.autoscaling
                             else {"num_replicas": spec.num_replicas})
    engine = EngineReplica.options(
        **scale,
        ray_actor_options={"num_cpus": spec.cpus_per_replica},
        max_ongoing_requests=spec.max_ongoing_requests,
        health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s,
        graceful_shutdown_timeout_s=spec.shutdown_timeout_s + 15.0,
        # a server that cannot start (a bad engine option) fails the launch after a few tries,
        # not Ray Serve's default 20
        max_constructor_retry_count=max(3, spec.num_replicas),
        request_router_config=RequestRouterConfig(
            # by import path: a class object would travel pickled by value, a copy without
            # this process's module state (replica_router.ROUTERS, read by the ingress)
            request_router_class="pagedhybrid.serve.replica_router.ReplicaRouter",
            request_router_kwargs={"policy": spec.router, "capacity_pages": spec.capacity_pages,
                                   "imbalance": spec.imbalance, "min_match": spec.min_match}),
    ).bind(spec)
    most = spec.autoscaling["max_replicas"] if spec.autoscaling else spec.num_replicas
    return Ingress.options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1024, most * spec.max_ongoing_requests),
    ).bind(engine, spec)
