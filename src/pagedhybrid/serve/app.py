"""The OpenAI-compatible HTTP API (FastAPI) over the engine process (``core.EngineClient``):
routes, checks, the wait.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI's JSON, streaming
as server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/models/{id}``, vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /version``,
``GET /health``, ``GET /metrics`` (Prometheus text). Unknown paths and methods answer 404 / 405
with OpenAI's error object, like every other refusal; ``GET /openapi.json`` declares every answer
(``openapi``).

Per request: check the API key (401), the model name (404), the body against its typed model
(``protocol``: every field typed and range-checked, unknown fields refused; 400 naming the
field as ``param``), the prompt against the model (empty, token ids outside the vocabulary,
prompt + max_tokens over max_model_len: 400) and the sampling values against the vocabulary
(400), refuse when ``max_waiting`` is set and that many requests are queued (503; by default
requests queue, each costing only its token list until admitted), then submit one engine request
per choice (``n``, or ``best_of`` candidates; with a ``seed``, choice i samples with
``seed + i``), wait for them all or stream their chunks. What the answers hold and how they are
shaped (text and stop strings, logprobs, usage) is ``responses``.

A client that disconnects, streaming or not, aborts its requests at once (a task waits on the
connection's disconnect event; their pages and slots are free by the next step). A request whose
computation fails fails alone: 500 with its error when not streaming; when streaming, a last
chunk with ``finish_reason: "error"`` and an error object after it. No client mistake ever gets
a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedhybrid import __version__
from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.chat import Tools, constraint, thinking
from pagedhybrid.engine.structured import StructuredOutputs, check
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.core import Closing, EngineClient, EngineRefusal, Refused
from pagedhybrid.serve.metrics import ServerMetrics
from pagedhybrid.serve.openapi import HEALTH, PROMETHEUS, SSE, document, errors
from pagedhybrid.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedhybrid.serve.responses import Choice, Job, Responses, sse, token_text

MAX_CHOICES = 2048  # prompts x (best_of or n) of one request


@dataclass
class ServerState:
    core: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None
    max_waiting: int | None = None  # None: requests queue (vLLM's behaviour)
    root: str = ""  # the checkpoint folder (``/v1/models`` ``root``)
    created: int = field(default_factory=lambda: int(time.time()))


# -- checks -------------------------------------------------------------------------------------
def check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {state.api_key}":
        raise ApiError(401, "Incorrect API key provided.", None, "invalid_api_key")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def check_prompt(state: ServerState, ids: list[int], max_tokens: int, param: str) -> None:
    if not ids:
        raise ApiError(400, f"{param} is empty", param)
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(400, f"{param} holds token ids outside the vocabulary "
                       f"[0, {state.vocab_size}): {bad[:5]}", param)
    if len(ids) + max_tokens > state.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} "
                       f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                       f"({len(ids)} in the prompt, {max_tokens} for the completion).",
                       "max_tokens", "context_length_exceeded")


def sampling_params(state: ServerState, body: Any, job: Job, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """The request's parameters (its ``n`` / ``best_of``: ``sequences()`` gives each choice's
    engine request); a value the engine refuses -> 400."""
    max_tokens, spec = job.max_tokens, job.structured
    if body.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", "min_tokens")
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed, n=body.n, best_of=getattr(body, "best_of", None),
            max_tokens=max_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
            stop=body.stop_strings(), include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if body.repetition_penalty is None
                                else body.repetition_penalty),
            logit_bias=body.logit_bias_ids(), bad_words=tuple(body.bad_words or ()),
            structured_outputs=spec)
        params.check_vocab(state.vocab_size)
    except ContractViolation as exc:
        raise ApiError(400, f"{exc.where} {exc.rule}", exc.where) from None
    return params


def check_grammar(spec: StructuredOutputs, source: str) -> None:
    """A grammar llguidance refuses is a 400 naming the client's field, before the engine sees
    the request (llguidance's check needs no tokenizer; the engine compiles the grammar)."""
    try:
        check(spec)
    except ContractViolation as exc:
        raise ApiError(400, f"{source} {exc.rule}", source) from None


# -- the app ------------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the ASGI server reports ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def _wait_all(request: Request, state: ServerState, sink: asyncio.Queue[Any],
                    choices: dict[str, Choice]) -> None:
    """Collect outputs until every choice is done; a client disconnect raises ``ClientGone``."""
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while not all(c.done for c in choices.values()):
            get = asyncio.ensure_future(sink.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ClientGone
            _apply(state, get.result(), choices)
    finally:
        gone.cancel()


def _refusal(item: EngineRefusal) -> ApiError:
    exc = item.error
    if isinstance(exc, Closing):
        return _unavailable(str(exc))
    if isinstance(exc, Refused):  # the core named the field
        return ApiError(400, str(exc), exc.what)
    return ApiError(500, f"internal error while admitting the request: {exc}", None,
                    "internal_error", "server_error")


def _apply(state: ServerState, item: Any, choices: dict[str, Choice]
           ) -> tuple[Choice, str] | None:
    """Apply one engine item to its choice: (choice, new safe text), or None for an output of a
    choice that is already done (a stop string ended it; its abort output is stale)."""
    if isinstance(item, EngineRefusal):
        raise _refusal(item)
    c = choices[item.request_id]
    if c.done:
        return None
    try:
        delta, stopped = c.update(item)
    except Exception as exc:  # detokenisation of this choice failed: it fails alone
        c.error, c.finish_reason, delta, stopped = (
            f"detokenisation failed: {type(exc).__name__}: {exc}", "error", "", False)
    if stopped or (c.done and not item.finished):
        state.core.abort(c.request_id)
    now = time.perf_counter()
    m = state.metrics
    if item.new_token_ids:
        if c.last_token_time is None:
            m.ttft.labels(model_name=m.model_name).observe(now - c.arrival)
        else:
            m.itl.labels(model_name=m.model_name).observe(
                (now - c.last_token_time) / max(1, len(item.new_token_ids)))
        c.last_token_time = now
    if c.done:
        m.e2e.labels(model_name=m.model_name).observe(now - c.arrival)
    return c, delta


def _unavailable(why: str) -> ApiError:
    return ApiError(503, why, None, "service_unavailable", "server_error")


def _error_chunk(state: ServerState, c: Choice) -> ApiError:
    if state.core.closing is not None and c.error == state.core.closing:
        return _unavailable(f"choice {c.index} was cut short: {c.error}")
    return ApiError(500, f"the computation of choice {c.index} failed: {c.error}", None,
                    "computation_failed", "server_error")


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.core.start()
        yield
        state.core.stop()

    # every operation may answer 500 (``internal``); each route declares its other refusals
    app = FastAPI(title="pagedhybrid", version=__version__, lifespan=lifespan,
                  responses=errors(500))

    def openapi() -> dict[str, Any]:
        """The document of what this server answers (``openapi.document``)."""
        if app.openapi_schema is None:
            app.openapi_schema = document(app, state.model_name, state.api_key is not None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def authorized(request: Request) -> None:
        check_auth(state, request)

    # the key is checked before the body is validated: without it, a 401, never a 400
    key = [Depends(authorized)]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"not found: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(
                   exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, msg).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        try:  # a body that is not JSON fails before ``authorized`` runs (every body needs the key)
            check_auth(state, request)
        except ApiError as denied:
            return JSONResponse(denied.body(), status_code=denied.status)

        def where(err: Any) -> list[str]:  # the field path, without pydantic's union tags
            return [str(x) for x in err.get("loc", ()) if x != "body"
                    and not any(ch in str(x) for ch in "[]()")]

        errs = exc.errors()
        # of a union's alternatives, the one that got furthest names the field best
        first = max(errs, key=lambda e: len(where(e)), default={})
        kind = first.get("type")
        if kind == "json_invalid":  # loc: ("body", the character where decoding stopped)
            loc, msg = "body", ("the request body is not valid JSON: "
                                f"{first['ctx']['error']} at character {first['loc'][-1]}")
        elif not where(first):  # the body as a whole: absent, or not a JSON object
            loc, msg = "body", ("the request body is missing: send a JSON object"
                                if kind == "missing" else
                                "the request body must be a JSON object (content-type "
                                f"application/json): {first.get('msg', 'invalid value')}")
        else:
            loc = ".".join(where(first))
            if kind == "extra_forbidden":
                msg = f"{loc}: unknown field (not an OpenAI or vLLM field this server has)"
            else:
                msg = f"{loc}: {first.get('msg', 'invalid value')}"
        return JSONResponse(ApiError(400, msg, loc).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}", None,
                                     "internal_error", "server_error").body(), status_code=500)

    @app.get("/health", responses=HEALTH)
    async def health() -> Response:
        ok = state.core.alive and not state.core.degraded
        return JSONResponse({"status": "ok" if ok else "degraded" if state.core.alive
                             else "error"}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses=PROMETHEUS)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "pagedhybrid", "root": state.root or state.model_name,
                "parent": None, "max_model_len": state.max_model_len,
                "permission": [{"id": f"modelperm-{state.model_name}",
                                "object": "model_permission", "created": state.created,
                                "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False,
                                "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    @app.get("/v1/models", dependencies=key, responses=errors(401))
    async def models(request: Request) -> dict[str, Any]:
        check_auth(state, request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=key, responses=errors(401, 404))
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_auth(state, request)
        check_model(state, model_id)
        return model_card()

    @app.post("/tokenize", dependencies=key, responses=errors(400, 401, 404))
    async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
        check_auth(state, request)
        check_model(state, body.model)
        text = body.prompt if body.messages is None else render_chat(
            body.messages, body.add_generation_prompt, body.chat_template_kwargs,
            body.tool_spec())
        ids = state.tokenizer.encode(text, add_special_tokens=body.special_tokens())
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": [token_text(state.tokenizer, t) for t in ids]
                if body.return_token_strs else None}

    @app.post("/detokenize", dependencies=key, responses=errors(400, 401, 404))
    async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
        check_auth(state, request)
        check_model(state, body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise ApiError(400, f"tokens holds ids outside the vocabulary "
                           f"[0, {state.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    def render_chat(messages: Sequence[Any], add_generation_prompt: bool,
                    kwargs: dict[str, Any] | None, tools: Tools | None) -> str:
        rendered = [m.for_template(f"messages[{i}]") for i, m in enumerate(messages)]
        extra = {"tools": tools.for_template()} if tools is not None else {}
        try:
            return str(state.tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, **extra,
                **(kwargs or {})))
        except Exception as exc:  # a template that cannot render these messages
            raise ApiError(400, f"messages cannot be rendered by the chat template: "
                           f"{type(exc).__name__}: {exc}", "messages") from None

    async def generate(request: Request, body: Any, job: Job) -> Response:
        n = body.n
        best_of = getattr(body, "best_of", None) or n
        if len(job.prompts) * best_of > MAX_CHOICES:
            raise ApiError(400, f"prompts x {'best_of' if best_of > n else 'n'} = "
                           f"{len(job.prompts) * best_of} exceeds {MAX_CHOICES} choices",
                           "best_of" if best_of > n else "n")
        prompt_k = [k for k in (body.prompt_logprobs,
                                job.logprobs if job.echo_logprobs else None) if k is not None]
        if job.structured is not None:  # llguidance's check, off the event loop
            await asyncio.to_thread(check_grammar, job.structured, job.structured_field)
        params = sampling_params(state, body, job, job.logprobs,
                                 max(prompt_k) if prompt_k else None).sequences()
        if state.core.closing is not None:
            raise _unavailable(state.core.closing)
        if state.max_waiting is not None and \
                state.core.num_waiting() + len(job.prompts) * best_of > state.max_waiting:
            raise ApiError(503, f"the server has {state.max_waiting} requests waiting; retry "
                           "later", None, "server_overloaded", "server_error")
        rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        sink: asyncio.Queue[Any] = asyncio.Queue()
        choices: dict[str, Choice] = {}
        for p_i, ids in enumerate(job.prompts):
            for i in range(best_of):
                sub = f"{rid}-{p_i}-{i}"
                choices[sub] = Choice(p_i * best_of + i, sub, state.tokenizer, job.echo_only,
                                      parser=job.parser())
                state.core.submit(sub, ids, params[i], sink)
        opts = body.stream_options
        out = Responses(rid, state.model_name, state.tokenizer, job, choices, best_of,
                        body.prompt_logprobs, bool(opts and opts.continuous_usage_stats))

        def cleanup() -> None:
            for c in choices.values():
                if not c.done:
                    state.core.abort(c.request_id)

        if not body.stream:
            try:
                await _wait_all(request, state, sink, choices)
            except ClientGone:
                return Response(status_code=499)  # nobody is listening
            finally:
                cleanup()
            failed = [c for c in choices.values() if c.error]
            if failed:
                raise _error_chunk(state, failed[0])
            return JSONResponse(out.final_response(out.pick(n)))

        async def events() -> AsyncIterator[str]:
            try:
                if job.chat:
                    for c in sorted(choices.values(), key=lambda c: c.index):
                        yield out.chunk(out.entry(c.index, "", None, None, role=True))
                while not all(c.done for c in choices.values()):
                    try:
                        applied = _apply(state, await sink.get(), choices)
                    except ApiError as exc:
                        yield sse(exc.body())
                        break
                    if applied is None:
                        continue
                    c, delta = applied
                    if not job.chat and job.echo_texts and not c.echoed:
                        c.echoed = True
                        yield out.chunk(out.entry(c.index, *out.echo_part(c), None))
                    if c.error:
                        yield out.chunk(out.entry(c.index, "", None, "error"))
                        yield sse(_error_chunk(state, c).body())
                        break
                    entry = out.stream_entry(c, delta)
                    if entry is not None:
                        yield out.chunk(entry)
                else:  # every choice done, none failed
                    if opts and opts.include_usage:
                        yield out.chunk(usage=True)
                yield "data: [DONE]\n\n"
            finally:
                cleanup()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=key,
              responses={**SSE, **errors(400, 401, 404, 503)})
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check_auth(state, request)
        check_model(state, body.model)
        texts, id_prompts = body.prompts()
        prompts = id_prompts if id_prompts is not None else [
            state.tokenizer.encode(t, add_special_tokens=body.add_special_tokens)
            for t in texts]
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if echo_only else (16 if body.max_tokens is None else body.max_tokens)
        for ids in prompts:
            check_prompt(state, ids, max_tokens, "prompt")
        echo = (list(texts) if texts else [state.tokenizer.decode(p) for p in prompts]
                ) if body.echo else []
        spec, source = body.structured()
        return await generate(request, body, Job(
            prompts, max_tokens, body.logprobs, False, echo,
            echo_logprobs=body.echo and body.logprobs is not None, echo_only=echo_only,
            structured=spec, structured_field=source))

    @app.post("/v1/chat/completions", dependencies=key,
              responses={**SSE, **errors(400, 401, 404, 503)})
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        check_auth(state, request)
        check_model(state, body.model)
        tools = body.tool_spec()
        text = render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                           tools)
        ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else \
            body.max_tokens
        max_tokens = limit if limit is not None else max(1, state.max_model_len - len(ids))
        check_prompt(state, ids, max_tokens, "messages")
        k = (body.top_logprobs or 0) if body.logprobs else None
        spec, source = body.structured()
        reasoning = thinking(text)
        try:
            spec = constraint(spec, tools, reasoning)
        except ContractViolation as exc:  # a tool_choice rule, or the spec's own (its field)
            where = exc.where if exc.op == "chat" or not source else source
            raise ApiError(400, f"{where}: '{exc.where}' {exc.rule}", where) from None
        if not source and spec is not None:
            source = "tool_choice"
        return await generate(request, body, Job(
            [ids], max_tokens, k, True, structured=spec, structured_field=source,
            tools=tools, thinking=reasoning))

    return app
