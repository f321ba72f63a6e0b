"""The OpenAI-compatible HTTP API (FastAPI) over the engine process (``core.EngineClient``):
the routes. The server's state and checks are ``state``, the generation requests' submission and
wait ``generate``, the refusals no route answers ``handlers``.

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

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedhybrid import __version__
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve import handlers
from pagedhybrid.serve.chat.format import Tools, constraint, thinking
from pagedhybrid.serve.generate import generate
from pagedhybrid.serve.openapi import HEALTH, PROMETHEUS, SSE, document, errors
from pagedhybrid.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedhybrid.serve.responses import Job, token_text
from pagedhybrid.serve.state import ServerState, check_auth, check_model, check_prompt


def create_app(state: ServerState) -> FastAPI:
    """The app: the engine client started and stopped with it, the OpenAPI document
    (``openapi``), the exception handlers (``handlers``) and the routes."""
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
    handlers.install(app, state)
    _info_routes(app, state, key)
    _generation_routes(app, state, key)
    return app


def _info_routes(app: FastAPI, state: ServerState, key: list[Any]) -> None:
    """health, version, metrics, models, tokenize, detokenize."""
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

    @app.get("/v1/models", dependencies=key, responses=errors(401))
    async def models(request: Request) -> dict[str, Any]:
        check_auth(state, request)
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}", dependencies=key, responses=errors(401, 404))
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_auth(state, request)
        check_model(state, model_id)
        return model_card(state)

    @app.post("/tokenize", dependencies=key, responses=errors(400, 401, 404))
    async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
        check_auth(state, request)
        check_model(state, body.model)
        text = body.prompt if body.messages is None else render_chat(
            state, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
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



def _generation_routes(app: FastAPI, state: ServerState, key: list[Any]) -> None:
    """completions and chat completions."""
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
        return await generate(state, request, body, Job(
            prompts, max_tokens, body.logprobs, False, echo,
            echo_logprobs=body.echo and body.logprobs is not None, echo_only=echo_only,
            structured=spec, structured_field=source))

    @app.post("/v1/chat/completions", dependencies=key,
              responses={**SSE, **errors(400, 401, 404, 503)})
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        check_auth(state, request)
        check_model(state, body.model)
        tools = body.tool_spec()
        text = render_chat(state, body.messages, body.add_generation_prompt,
                           body.chat_template_kwargs, tools)
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
        return await generate(state, request, body, Job(
            [ids], max_tokens, k, True, structured=spec, structured_field=source,
            tools=tools, thinking=reasoning))


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "pagedhybrid", "root": state.root or state.model_name,
            "parent": None, "max_model_len": state.max_model_len,
            "permission": [{"id": f"modelperm-{state.model_name}",
                            "object": "model_permission", "created": state.created,
                            "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False,
                            "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}


def render_chat(state: ServerState, messages: Sequence[Any], add_generation_prompt: bool,
                kwargs: dict[str, Any] | None, tools: Tools | None) -> str:
    """The chat template's text of ``messages`` (a template that cannot render them: 400)."""
    rendered = [m.for_template(f"messages[{i}]") for i, m in enumerate(messages)]
    extra = {"tools": tools.for_template()} if tools is not None else {}
    try:
        return str(state.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, **extra,
            **(kwargs or {})))
    except Exception as exc:  # a template that cannot render these messages
        raise ApiError(400, f"messages cannot be rendered by the chat template: "
                       f"{type(exc).__name__}: {exc}", "messages") from None
