"""The OpenAI-compatible HTTP API over an ``EngineLoop`` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI's JSON, streaming
as server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text).

Per request: check the API key (401), the model name (404), the prompt (empty, token ids outside
the vocabulary, prompt + max_tokens over max_model_len: 400) and the sampling values (400, the
offending field as ``param``), refuse when more than ``max_waiting`` requests are queued (503,
nothing accepted is dropped), then submit one engine request per choice (``n`` per prompt;
with a ``seed``, choice i samples with ``seed + i``). Outputs are detokenised incrementally;
stop strings are found in the decoded text, cut (never returned) and the engine request aborted;
while streaming, the tail that could still begin a stop string (or is an incomplete UTF-8
character) is held back. A client that disconnects, streaming or not, aborts its requests at
once (their pages and slots are free by the next step). Usage counts are the exact prompt and
generated token counts. A request whose computation fails (non-finite logits) fails alone with
a 500 and its error; no client mistake ever gets a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedhybrid.engine import RequestOutput, SamplingParams
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.loop import EngineLoop, EngineRefusal
from pagedhybrid.serve.metrics import ServerMetrics
from pagedhybrid.serve.protocol import (
    MAX_LOGPROBS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None
    max_waiting: int = 256
    created: int = field(default_factory=lambda: int(time.time()))


# -- one choice: incremental text, stop strings, logprobs ------------------------------------------
@dataclass
class Choice:
    index: int
    request_id: str
    stops: list[str]
    tokenizer: Any
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already returned
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[dict[int, Any], ...] = ()
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def update(self, out: RequestOutput) -> tuple[str, bool]:
        """New output -> (text that is safe to return now, whether a stop string ended it)."""
        self.token_ids = list(out.token_ids)
        self.logprobs = out.logprobs or ()
        text = self.tokenizer.decode(self.token_ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text, self.finish_reason = text[:min(hits)], "stop"
        elif out.finished:
            if out.finish_reason == "error":
                self.error = out.error or "the computation failed"
            self.finish_reason = "stop" if out.finish_reason in ("stop", "abort") else \
                str(out.finish_reason)
        self.text = text
        safe = len(text)
        if not self.done:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            safe = max(self.sent, len(text) - hold)
            while safe > self.sent and text[safe - 1] == "\ufffd":  # a partial character
                safe -= 1
        delta = text[self.sent:safe]
        self.sent = safe
        return delta, stopped


def _token_text(tok: Any, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def completion_logprobs(c: Choice, tok: Any, start: int) -> dict[str, Any] | None:
    tokens, token_lp, top, offsets = [], [], [], []
    pos = start
    for tid, d in zip(c.token_ids, c.logprobs, strict=False):
        piece = _token_text(tok, tid)
        tokens.append(piece)
        token_lp.append(d[tid].logprob)
        top.append({_token_text(tok, t): lp.logprob for t, lp in d.items()})
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(c: Choice, tok: Any, k: int, first: int = 0) -> dict[str, Any]:
    content = []
    for tid, d in list(zip(c.token_ids, c.logprobs, strict=False))[first:]:
        piece = _token_text(tok, tid)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in d.items())
        content.append({"token": piece, "logprob": d[tid].logprob,
                        "bytes": list(piece.encode("utf-8")),
                        "top_logprobs": [{"token": _token_text(tok, t), "logprob": lp,
                                          "bytes": list(_token_text(tok, t).encode("utf-8"))}
                                         for _, t, lp in ranked[:k]]})
    return {"content": content}


# -- checks -------------------------------------------------------------------------------------
def check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {state.api_key}":
        raise ApiError(401, "Incorrect API key provided.", None, "invalid_api_key")


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
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


def sampling_params(body: Any, max_tokens: int, logprobs: int | None, index: int
                    ) -> SamplingParams:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must lie in [0, {MAX_LOGPROBS}]", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, "temperature must lie in [0, 2]", "temperature")
    try:
        return SamplingParams(
            temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=None if body.seed is None else body.seed + index, max_tokens=max_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, logprobs=logprobs)
    except ContractViolation as exc:
        raise ApiError(400, f"{exc.where} {exc.rule}", exc.where) from None


# -- the app ------------------------------------------------------------------------------------
def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _wait_all(request: Request, state: ServerState, sink: asyncio.Queue[Any],
                    choices: dict[str, Choice]) -> None:
    """Collect outputs until every choice is done; a client disconnect raises ``ClientGone``."""
    while not all(c.done for c in choices.values()):
        try:
            item = await asyncio.wait_for(sink.get(), timeout=0.25)
        except TimeoutError:
            if await request.is_disconnected():
                raise ClientGone from None
            continue
        _apply(state, item, choices)


def _apply(state: ServerState, item: Any, choices: dict[str, Choice]) -> tuple[Choice, str]:
    if isinstance(item, EngineRefusal):
        raise ApiError(400, str(item.error), "prompt")
    c = choices[item.request_id]
    if c.done:
        return c, ""
    delta, stopped = c.update(item)
    if stopped:
        state.loop.abort(c.request_id)
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


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="pagedhybrid", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            loc, msg = None, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}"
        else:
            loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
            msg = f"{loc}: {first.get('msg', 'invalid value')}"
        return JSONResponse(ApiError(400, msg, loc).body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        alive = state.loop.error is None
        return JSONResponse({"status": "ok" if alive else "error"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(state, request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "pagedhybrid", "max_model_len": state.max_model_len}]}

    async def generate(request: Request, body: Any, prompts: list[list[int]], max_tokens: int,
                       logprobs: int | None, chat: bool, echo_texts: Sequence[str]
                       ) -> Response:
        n = body.n
        if n < 1:
            raise ApiError(400, "n must be >= 1", "n")
        params = [sampling_params(body, max_tokens, logprobs, i) for i in range(n)]
        if state.loop.num_waiting() + len(prompts) * n > state.max_waiting:
            raise ApiError(503, f"the server has {state.max_waiting} requests waiting; retry "
                           "later", None, "server_overloaded", "server_error")
        stops = body.stop_strings()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        sink: asyncio.Queue[Any] = asyncio.Queue()
        choices: dict[str, Choice] = {}
        for p_i, ids in enumerate(prompts):
            for i in range(n):
                sub = f"{rid}-{p_i}-{i}"
                choices[sub] = Choice(p_i * n + i, sub, stops, state.tokenizer)
                state.loop.submit(sub, ids, params[i], sink)
        prompt_tokens = sum(len(p) for p in prompts)
        created = int(time.time())

        def usage() -> dict[str, int]:
            gen = sum(len(c.token_ids) for c in choices.values())
            return {"prompt_tokens": prompt_tokens, "completion_tokens": gen,
                    "total_tokens": prompt_tokens + gen}

        def cleanup() -> None:
            for c in choices.values():
                if not c.done:
                    state.loop.abort(c.request_id)

        if not body.stream:
            try:
                await _wait_all(request, state, sink, choices)
            except ClientGone:
                cleanup()
                return Response(status_code=499)  # nobody is listening
            except BaseException:
                cleanup()
                raise
            cleanup()
            failed = [c for c in choices.values() if c.error]
            if failed:
                raise ApiError(500, f"the computation of choice {failed[0].index} failed: "
                               f"{failed[0].error}", None, "computation_failed",
                               "server_error")
            ordered = sorted(choices.values(), key=lambda c: c.index)
            if chat:
                out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c, state.tokenizer, logprobs or 0)
                        if logprobs is not None else None,
                        "finish_reason": c.finish_reason} for c in ordered]
                return JSONResponse({"id": rid, "object": "chat.completion",
                                     "created": created, "model": state.model_name,
                                     "choices": out, "usage": usage()})
            out = []
            for c in ordered:
                echo = echo_texts[c.index // n] if echo_texts else ""
                out.append({"index": c.index, "text": echo + c.text,
                            "logprobs": completion_logprobs(c, state.tokenizer, len(echo))
                            if logprobs is not None else None,
                            "finish_reason": c.finish_reason})
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": state.model_name, "choices": out, "usage": usage()})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> str:
            return _sse({"id": rid, "object": kind, "created": created,
                         "model": state.model_name, "choices": [choice]})

        async def events() -> AsyncIterator[str]:
            sent_lp = dict.fromkeys(choices, 0)
            try:
                for c in sorted(choices.values(), key=lambda c: c.index):
                    if chat:
                        yield chunk({"index": c.index, "delta": {"role": "assistant",
                                                                 "content": ""},
                                     "logprobs": None, "finish_reason": None})
                    elif echo_texts:
                        yield chunk({"index": c.index, "text": echo_texts[c.index // n],
                                     "logprobs": None, "finish_reason": None})
                while not all(c.done for c in choices.values()):
                    item = await sink.get()
                    try:
                        c, delta = _apply(state, item, choices)
                    except ApiError as exc:
                        yield _sse(exc.body())
                        return
                    if c.error:
                        yield _sse(ApiError(500, f"the computation failed: {c.error}", None,
                                            "computation_failed", "server_error").body())
                        return
                    lp = None
                    if logprobs is not None and len(c.logprobs) > sent_lp[c.request_id]:
                        lp = (chat_logprobs(c, state.tokenizer, logprobs,
                                            sent_lp[c.request_id]) if chat else None)
                        sent_lp[c.request_id] = len(c.logprobs)
                    if delta or c.done or lp:
                        if chat:
                            yield chunk({"index": c.index, "delta": {"content": delta}
                                         if delta else {}, "logprobs": lp,
                                         "finish_reason": c.finish_reason if c.done else None})
                        else:
                            yield chunk({"index": c.index, "text": delta, "logprobs": None,
                                         "finish_reason": c.finish_reason if c.done else None})
                if include_usage:
                    yield _sse({"id": rid, "object": kind, "created": created,
                                "model": state.model_name, "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"
            finally:
                cleanup()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check_auth(state, request)
        check_model(state, body.model)
        raw = body.prompt
        if isinstance(raw, str):
            texts: list[str] = [raw]
        elif raw and all(isinstance(x, str) for x in raw):
            texts = list(raw)  # type: ignore[arg-type]
        else:
            texts = []
        if texts:
            prompts = [state.tokenizer.encode(t) if t else [] for t in texts]
        elif raw and isinstance(raw[0], list):
            prompts = [list(p) for p in raw]  # type: ignore[union-attr]
        else:
            prompts = [list(raw)]  # type: ignore[arg-type]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens < 1:
            raise ApiError(400, "max_tokens must be >= 1", "max_tokens")
        for ids in prompts:
            check_prompt(state, ids, max_tokens, "prompt")
        echo = ([t for t in texts] if texts else [state.tokenizer.decode(p) for p in prompts]
                ) if body.echo else []
        return await generate(request, body, prompts, max_tokens, body.logprobs, False, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        check_auth(state, request)
        check_model(state, body.model)
        if not body.messages:
            raise ApiError(400, "messages is empty", "messages")
        try:
            text = state.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                add_generation_prompt=True)
        except ApiError:
            raise
        except Exception as exc:  # a template that cannot render these messages
            raise ApiError(400, f"messages cannot be rendered by the chat template: {exc}",
                           "messages") from None
        ids = state.tokenizer.encode(text)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else \
            body.max_tokens
        max_tokens = limit if limit is not None else max(1, state.max_model_len - len(ids))
        if max_tokens < 1:
            raise ApiError(400, "max_completion_tokens must be >= 1", "max_completion_tokens")
        check_prompt(state, ids, max_tokens, "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        return await generate(request, body, [ids], max_tokens, k, True, [])

    return app
