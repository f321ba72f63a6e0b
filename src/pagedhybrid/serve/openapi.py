"""The server's OpenAPI document (``GET /openapi.json``), true to what the server answers.

Each route declares the refusals it can answer with ``errors(...)`` in its decorator, and the app
declares 500 for all (the catch-all handler: the engine's own failure, never a client mistake);
every refusal has OpenAI's error body, the named component schemas ``ErrorResponse`` / ``Error``
(``protocol``). ``document`` takes FastAPI's schema and makes the rest true for this server:
FastAPI's 422 and its ``HTTPValidationError`` are dropped (a body that fails its model is a 400
here, see ``app.bad_body``); 401 is declared, with a bearer security scheme, only when the server
has an API key; ``model`` of the request bodies (optional for ``/tokenize`` and ``/detokenize``,
as vLLM's) and ``model_id`` of ``/v1/models/{model_id}`` are an enum of the one served model (so
a client or a fuzzer generating from the document reaches the engine; another name is a 404);
integer bounds are exact. Unknown paths and methods answer 404 / 405 with the same error body;
they belong to no operation (nor does the 499 written when the client has gone: nobody reads
it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedhybrid.engine.sample.sampler import INT64
from pagedhybrid.serve.protocol import ErrorResponse, Health

WHY = {
    400: "The request is invalid: `param` names the field at fault (`body` for a missing or "
         "non-JSON body).",
    401: "The API key is missing or wrong.",
    404: "The model does not exist.",
    500: "The server failed (the engine's own error, not the request's).",
    503: "The server is overloaded (too many requests waiting) or shutting down; retry later.",
}

# each event (``itemSchema``, as FastAPI's own streams and OpenAPI 3.2 have it): a chunk, or an
# error object, as JSON text; the last one ``[DONE]``
SSE = {200: {"description": "The answer: JSON, or with `stream: true` server-sent events "
                            "(`data: {chunk}` lines ending with `data: [DONE]`).",
             "content": {"text/event-stream": {"itemSchema": {
                 "type": "object", "required": ["data"],
                 "properties": {"data": {"type": "string"}}}}}}}

PROMETHEUS = {200: {"description": "The metrics in Prometheus's text exposition format 0.0.4.",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}

HEALTH = {200: {"model": Health, "description": "The engine process is alive and well (`ok`)."},
          503: {"model": Health, "description": "The engine process is degraded (`degraded`) or "
                                                "gone (`error`)."}}

VALIDATION = ("HTTPValidationError", "ValidationError")
# the request bodies that name the served model (another name is a 404)
BODIES = ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest")


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses`` declaring error statuses with OpenAI's error body."""
    return {s: {"model": ErrorResponse, "description": WHY[s]} for s in statuses}


def document(app: FastAPI, model_name: str, api_key: bool) -> dict[str, Any]:
    """The OpenAPI document of ``app`` serving ``model_name`` (see the module docstring)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    served = {"type": "string", "enum": [model_name], "title": "Model"}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            if "401" in responses and not api_key:
                del responses["401"]
            elif "401" in responses:
                op["security"] = [{"bearer": []}]
            for param in op.get("parameters", ()):
                if param["name"] == "model_id":
                    param["schema"] = served
    components = schema.setdefault("components", {})
    comps = components.setdefault("schemas", {})
    for name in VALIDATION:
        comps.pop(name, None)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for comp in comps.values():
        prop = comp.get("properties", {}).get("model")
        if prop is None or comp.get("title") not in BODIES:
            continue
        prop.clear()
        if comp.get("title") in ("TokenizeRequest", "DetokenizeRequest"):  # vLLM's: optional
            prop.update({"anyOf": [served, {"type": "null"}], "title": "Model"})
        else:
            prop.update(served)
    exact_integer_bounds(schema)
    return schema


def exact_integer_bounds(node: Any) -> None:
    """FastAPI's document model holds ``minimum`` / ``maximum`` as floats, so int64's largest
    value (2**63 - 1, the bound of seeds and token ids) comes out as 2**63; give the integer
    schemas their integer bounds back (every integer bound in ``protocol`` lies in int64)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum"):
                if isinstance(node.get(key), float):
                    node[key] = min(max(int(node[key]), INT64[0]), INT64[1])
        for value in node.values():
            exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            exact_integer_bounds(value)
