"""How the server answers what no route answers: an ``ApiError`` with OpenAI's error body; 404 /
405 for unknown paths and methods; a body that fails its model: 400 naming the field (``param``;
``body`` for a missing or non-JSON body), after the API key (401 first); anything else: 500
without details (the engine's own failure, never a client's mistake)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedhybrid.serve.protocol import ApiError
from pagedhybrid.serve.state import ServerState, check_auth


def install(app: FastAPI, state: ServerState) -> None:
    """The exception handlers of ``app``."""
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
