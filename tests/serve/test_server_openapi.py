"""The OpenAPI document (``GET /openapi.json``) states what the server answers: each operation's
statuses (500 on all, no FastAPI 422), every refusal as OpenAI's error body (the named component
``ErrorResponse``), ``/metrics`` as Prometheus text, ``/health``'s two answers, 401 and a bearer
scheme only with an API key, exact int64 bounds, the chat roles' rules; and a request body that is
missing, not JSON or not an object is a 400 naming ``body``."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest
from conftest import Server
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedhybrid.serve.app import create_app
from pagedhybrid.serve.state import ServerState

ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
STATUSES = {  # what each operation can answer (a server without an API key)
    ("get", "/health"): {"200", "503", "500"},
    ("get", "/version"): {"200", "500"},
    ("get", "/metrics"): {"200", "500"},
    ("get", "/v1/models"): {"200", "500"},
    ("get", "/v1/models/{model_id}"): {"200", "404", "500"},
    ("post", "/tokenize"): {"200", "400", "404", "500"},
    ("post", "/detokenize"): {"200", "400", "404", "500"},
    ("post", "/v1/completions"): {"200", "400", "404", "500", "503"},
    ("post", "/v1/chat/completions"): {"200", "400", "404", "500", "503"},
}
POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def document(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.base}/openapi.json", timeout=30)
    assert r.status_code == 200
    return dict(r.json())


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}


def valid(doc: dict[str, Any], value: Any, name: str) -> bool:
    """Whether ``value`` follows the document's component schema ``name``."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_every_status_is_declared_with_openai_errors(server: Server) -> None:
    doc = document(server)
    ops = operations(doc)
    assert {k: set(op["responses"]) for k, op in ops.items()} == STATUSES
    for key, op in ops.items():
        assert "security" not in op, key  # no API key on this server
        for status, resp in op["responses"].items():
            if status[0] in "45" and key != ("get", "/health"):
                assert resp["content"] == {"application/json": {"schema": ERROR}}, (key, status)
                assert resp["description"], (key, status)
    comps = doc["components"]["schemas"]
    assert comps["ErrorResponse"]["properties"] == {"error": {"$ref": "#/components/schemas/Error"}}
    assert set(comps["Error"]["required"]) == {"message", "type", "param", "code"}
    assert not {"HTTPValidationError", "ValidationError"} & set(comps)
    for raw, path, status in (({"model": "nope", "prompt": "hi"}, "/v1/completions", 404),
                              ({"tokens": [-1]}, "/detokenize", 400)):
        r = httpx.post(f"{server.base}{path}", json=raw, timeout=60)
        assert r.status_code == status and valid(doc, r.json(), "ErrorResponse"), r.text
    r = httpx.get(f"{server.url}/models/nope", timeout=30)
    assert r.status_code == 404 and valid(doc, r.json(), "ErrorResponse"), r.text


def test_metrics_are_declared_as_prometheus_text_and_health_as_its_answers(
        server: Server) -> None:
    doc = document(server)
    ops = operations(doc)
    metrics = ops["get", "/metrics"]["responses"]["200"]
    assert metrics["content"] == {"text/plain": {"schema": {"type": "string"}}}
    assert "Prometheus" in metrics["description"]
    r = httpx.get(f"{server.base}/metrics", timeout=30)
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE pagedhybrid:" in r.text
    health = ops["get", "/health"]["responses"]
    for status in ("200", "503"):
        assert health[status]["content"] == {
            "application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}
    assert doc["components"]["schemas"]["Health"]["properties"]["status"]["enum"] == [
        "ok", "degraded", "error"]
    r = httpx.get(f"{server.base}/health", timeout=30)
    assert r.status_code == 200 and valid(doc, r.json(), "Health") and r.json() == {
        "status": "ok"}


def test_int64_bounds_are_exact_and_the_served_model_is_named(server: Server) -> None:
    doc = document(server)
    comps = doc["components"]["schemas"]
    seed = next(s for s in comps["CompletionRequest"]["properties"]["seed"]["anyOf"]
                if s.get("type") == "integer")
    assert seed["maximum"] == 2 ** 63 - 1 and seed["minimum"] == -(2 ** 63)
    assert type(seed["maximum"]) is int  # not 9.223372036854776e18, which is 2**63
    assert comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 2 ** 63 - 1
    assert not valid(doc, {"tokens": [2 ** 63]}, "DetokenizeRequest")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert comps[name]["properties"]["model"]["enum"] == [server.model]
    for name in ("TokenizeRequest", "DetokenizeRequest"):  # optional, or the served model
        assert comps[name]["properties"]["model"]["anyOf"][0]["enum"] == [server.model]
    assert valid(doc, {"tokens": [1]}, "DetokenizeRequest")
    assert valid(doc, {"model": server.model, "tokens": [1]}, "DetokenizeRequest")
    assert not valid(doc, {"model": "", "tokens": [1]}, "DetokenizeRequest")
    (param,) = operations(doc)["get", "/v1/models/{model_id}"]["parameters"]
    assert param["schema"]["enum"] == [server.model]


@pytest.mark.parametrize(("message", "ok"), [
    ({"role": "user", "content": "hi"}, True),
    ({"role": "tool", "content": "42", "tool_call_id": "c1"}, True),
    ({"role": "assistant", "content": "x", "reasoning_content": "r"}, True),
    ({"role": "tool", "content": "42"}, False),
    ({"role": "user", "content": "hi", "tool_call_id": "c1"}, False),
    ({"role": "user", "content": "hi", "reasoning_content": "r"}, False),
])
def test_the_chat_roles_rules_are_in_the_document(server: Server, message: dict[str, Any],
                                                  ok: bool) -> None:
    doc = document(server)
    assert valid(doc, message, "ChatMessage") is ok
    if not ok:  # and the server refuses what the document refuses
        r = httpx.post(f"{server.base}/tokenize", json={"messages": [message]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def app_without_engine(key: str | None) -> FastAPI:
    """The app alone (no engine: enough for the document and for refusals before the engine)."""
    state = ServerState(core=None, tokenizer=None, model_name="m",  # type: ignore[arg-type]
                        max_model_len=64, vocab_size=8, metrics=None, api_key=key)
    return create_app(state)


def test_an_api_key_declares_401_and_a_bearer_scheme() -> None:
    keyed, open_ = app_without_engine("sesame").openapi(), app_without_engine(None).openapi()
    assert keyed["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}}
    assert "securitySchemes" not in open_["components"]
    for key, op in operations(keyed).items():
        guarded = key[1].startswith("/v1/") or key[1] in ("/tokenize", "/detokenize")
        assert ("401" in op["responses"]) is guarded, key
        assert (op.get("security") == [{"bearer": []}]) is guarded, key
        if guarded:
            assert op["responses"]["401"]["content"]["application/json"]["schema"] == ERROR
        assert set(op["responses"]) - {"401"} == STATUSES[key], key


def test_without_the_key_every_body_is_a_401_and_with_it_the_body_is_judged() -> None:
    client = TestClient(app_without_engine("sesame"))  # no lifespan: the engine never starts
    bodies = [{"content": b"{not json", "headers": {"content-type": "application/json"}},
              {}, {"json": []}, {"json": {"model": "m", "prompt": "hi", "temperature": "hot"}},
              {"json": {"model": "m", "prompt": "hi", "best_of": 1, "n": 2}},  # a model rule
              {"json": {"model": "m", "messages": [{"role": "tool", "content": "x"}]}}]
    for path in POSTS:
        for kwargs in bodies:
            r = client.post(path, **kwargs)
            assert r.status_code == 401, (path, kwargs, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            kwargs = {**kwargs, "headers": {**kwargs.get("headers", {}),
                                            "Authorization": "Bearer sesame"}}
            r = client.post(path, **kwargs)
            assert r.status_code == 400, (path, kwargs, r.text)
    assert client.get("/v1/models/m").status_code == 401
    assert client.get("/version").status_code == 200  # not guarded


BODIES = [  # (what, httpx kwargs, words the message holds)
    ("no body", {}, "request body is missing"),
    ("empty JSON body", {"content": b"", "headers": {"content-type": "application/json"}},
     "request body is missing"),
    ("not JSON", {"content": b"{not json", "headers": {"content-type": "application/json"}},
     "request body is not valid JSON"),
    ("plain text", {"content": b"hello", "headers": {"content-type": "text/plain"}},
     "request body must be a JSON object"),
    ("a JSON array", {"json": []}, "request body must be a JSON object"),
    ("a JSON string", {"json": "hello"}, "request body must be a JSON object"),
]


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize(("what", "kwargs", "words"), BODIES, ids=[b[0] for b in BODIES])
def test_a_missing_or_non_json_body_is_a_400_naming_the_body(
        server: Server, path: str, what: str, kwargs: dict[str, Any], words: str) -> None:
    r = httpx.post(f"{server.base}{path}", timeout=60, **kwargs)
    assert r.status_code == 400, (what, r.text)
    err = r.json()["error"]
    assert err["param"] == "body" and words in err["message"], (what, err)
    assert err["type"] == "invalid_request_error" and err["code"] is None


STRICT = [  # a value of another JSON type than the document says: refused, not converted
    ("a number as a string", {"temperature": "0.5"}, "temperature"),
    ("a boolean as 1", {"echo": 1}, "echo"),
    ("a boolean as a string", {"stream": "true"}, "stream"),
    ("a number as a boolean", {"top_p": True}, "top_p"),
]


@pytest.mark.parametrize(("what", "fields", "param"), STRICT, ids=[s[0] for s in STRICT])
def test_values_of_another_json_type_are_refused(server: Server, what: str,
                                                 fields: dict[str, Any], param: str) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2, **fields}
    r = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (what, r.text)
    assert not valid(document(server), body, "CompletionRequest")
