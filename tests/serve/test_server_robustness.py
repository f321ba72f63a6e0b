"""No request can stop the server: one regression test per class of bad input, every fault path
injected into a real server process, disconnects of both kinds, and the endpoints and metrics
that real clients look for. After each, a known greedy request is answered correctly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import PROMPT, Server, flood, greedy_text, start_server, still_serving
from fault_server import DETOK, FINISH, HOOK, INTAKE, SAMPLE, SCHED, STEP

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM


def post_raw(server: Server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=raw, timeout=60,
                      headers={"content-type": "application/json"})


BAD = [  # (what, body fields, param)
    ("seed past int64", {"seed": 2 ** 63}, "seed"),
    ("seed below int64", {"seed": -(2 ** 63) - 1}, "seed"),
    ("top_k past int64", {"top_k": 2 ** 70}, "top_k"),
    ("top_k past the vocabulary", {"top_k": 10 ** 6}, "top_k"),
    ("top_k -2", {"top_k": -2}, "top_k"),
    ("stop id outside the vocabulary with min_tokens",
     {"min_tokens": 2, "stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ("stop id past int64", {"stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ("logit_bias key outside the vocabulary", {"logit_bias": {"99999999": 5}}, "logit_bias"),
    ("logit_bias key not an id", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("logit_bias value out of range", {"logit_bias": {"5": 1000}}, "logit_bias.5"),
    ("huge n", {"n": 10 ** 9}, "n"),
    ("n past int64", {"n": 2 ** 65}, "n"),
    ("huge max_tokens", {"max_tokens": 2 ** 80}, "max_tokens"),
    ("min_tokens over max_tokens", {"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("best_of below n", {"n": 3, "best_of": 2}, "best_of"),
    ("presence_penalty out of range", {"presence_penalty": 3}, "presence_penalty"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("min_p above 1", {"min_p": 1.5}, "min_p"),
    ("logprobs past 20", {"logprobs": 21}, "logprobs"),
    ("prompt_logprobs negative", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("empty stop string", {"stop": [""]}, "stop"),
    ("unknown field", {"frobnicate": 1}, "frobnicate"),
    ("suffix", {"suffix": "amen"}, "suffix"),
    ("response_format regex type", {"response_format": {"type": "regex"}}, "response_format"),
    ("json_schema without a schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("json_schema with a bad type", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format"),
    ("unimplemented schema keyword", {"guided_json": {"not": {"type": "string"}}},
     "guided_json"),
    ("regex that does not compile", {"guided_regex": "(["}, "guided_regex"),
    ("two grammars", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex"),
    ("structured_outputs with two kinds", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("structured_outputs unknown key", {"structured_outputs": {"frob": 1}},
     "structured_outputs"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}},
     "stream_options"),
    ("bool as an int", {"max_tokens": True}, "max_tokens"),
    ("token prompt past int64", {"prompt": [1, 2 ** 64]}, "prompt"),
    ("too many choices", {"prompt": ["a"] * 40, "n": 100}, "n"),
]


@pytest.mark.parametrize(("what", "fields", "param"), BAD, ids=[b[0] for b in BAD])
def test_every_bad_field_is_a_400_naming_it(server: Server, what: str, fields: dict,
                                            param: str) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, **fields}
    r = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert r.status_code == 400, (what, r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), (what, err)
    assert err["type"] == "invalid_request_error" and err["message"]


RAW = [  # bodies json.dumps would not write: NaN/Infinity literals, lone surrogates
    ("NaN temperature", b'{"model": "M", "prompt": "hi", "temperature": NaN}', "temperature"),
    ("Infinity top_p", b'{"model": "M", "prompt": "hi", "top_p": Infinity}', "top_p"),
    ("-Infinity penalty", b'{"model": "M", "prompt": "hi", "frequency_penalty": -Infinity}',
     "frequency_penalty"),
    ("lone surrogate in the prompt", b'{"model": "M", "prompt": "abc\\ud800def"}', "prompt"),
    ("lone surrogate in a stop string", b'{"model": "M", "prompt": "hi", "stop": "\\udfff"}',
     "stop"),
]


@pytest.mark.parametrize(("what", "raw", "param"), RAW, ids=[r[0] for r in RAW])
def test_non_finite_numbers_and_invalid_unicode_are_400(server: Server, llm: LLM, what: str,
                                                        raw: bytes, param: str) -> None:
    r = post_raw(server, "/completions", raw.replace(b'"M"', json.dumps(server.model).encode()))
    assert r.status_code == 400, (what, r.text)
    assert r.json()["error"]["param"] == param


def test_surrogates_in_chat_and_tools_are_400_and_the_server_keeps_serving(
        server: Server, llm: LLM) -> None:
    model = json.dumps(server.model).encode()
    for raw in (b'{"model": M, "messages": [{"role": "user", "content": "x\\ud83d"}]}',
                b'{"model": M, "messages": [{"role": "user", "content": [{"type": "text", '
                b'"text": "\\ud83d"}]}]}'):
        r = post_raw(server, "/chat/completions", raw.replace(b"M", model, 1))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("messages")
    for fields, param in (({"tools": [{"type": "function", "function": {
                               "name": "f", "parameters": {"type": "array"}}}]},
                           "tools[0].function.parameters"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
                          ({"messages": [{"role": "user", "content": [
                              {"type": "image_url", "image_url": {"url": "x"}}]}]},
                           "messages.0.content.0.type")):
        body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, **fields}
        r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    still_serving(server, llm)


def test_extreme_but_valid_values_work(server: Server, llm: LLM) -> None:
    """int64 seeds at both ends (with n > 1: seed + i wraps), top_k = vocab, -1 and 0."""
    vocab = llm.engine.model.config.vocab_size
    for fields in ({"seed": 2 ** 63 - 1, "n": 2}, {"seed": -(2 ** 63)}, {"top_k": vocab},
                   {"top_k": -1}, {"top_k": 0, "min_tokens": 3, "stop_token_ids": [vocab - 1]}):
        r = httpx.post(f"{server.url}/completions", timeout=60, json={
            "model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0,
            **fields})
        assert r.status_code == 200, (fields, r.text)
    still_serving(server, llm)


def test_unknown_paths_methods_and_the_vllm_endpoints(server: Server, llm: LLM) -> None:
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("POST", "/health", 405)):
        r = httpx.request(method, f"{server.base}{path}", timeout=30)
        assert r.status_code == status, (method, path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and path in err["message"]
    assert httpx.get(f"{server.base}/version", timeout=30).json()["version"]
    card = httpx.get(f"{server.url}/models/{server.model}", timeout=30).json()
    listed = httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]
    assert card == listed and card["id"] == server.model
    assert card["parent"] is None and card["root"] and card["permission"][0]["allow_sampling"]
    r = httpx.get(f"{server.url}/models/other", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    tok = llm.engine.tokenizer
    t = httpx.post(f"{server.base}/tokenize", timeout=30, json={
        "model": server.model, "prompt": PROMPT, "return_token_strs": True}).json()
    assert t["tokens"] == tok.encode(PROMPT) and t["count"] == len(t["tokens"])
    assert len(t["token_strs"]) == t["count"] and t["max_model_len"] > 0
    msgs = [{"role": "user", "content": "hi"}]
    t = httpx.post(f"{server.base}/tokenize", timeout=30, json={"messages": msgs}).json()
    assert t["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert t["tokens"].count(tok.bos_token_id) == 1  # from the template, not added again
    t2 = httpx.post(f"{server.base}/tokenize", timeout=30,
                    json={"messages": msgs, "add_special_tokens": True}).json()
    assert t2["tokens"] == [tok.bos_token_id, *t["tokens"]]  # the field takes effect
    r = httpx.post(f"{server.url}/chat/completions", timeout=30, json={
        "model": server.model, "messages": msgs, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    d = httpx.post(f"{server.base}/detokenize", timeout=30,
                   json={"model": server.model, "tokens": tok.encode(PROMPT)}).json()
    assert d["prompt"] == tok.decode(tok.encode(PROMPT))
    for path, body, param in (("/detokenize", {"tokens": [10 ** 8]}, "tokens"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
        r = httpx.post(f"{server.base}{path}", json=body, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_sampling_controls_take_effect_through_the_api(server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    base = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    forced = tok.encode(" Egypt", add_special_tokens=False)[0]
    r = httpx.post(f"{server.url}/completions", timeout=60,
                   json={**base, "logit_bias": {str(forced): 100}}).json()
    assert r["choices"][0]["text"] == tok.decode([forced] * 6)
    plain = greedy_text(llm, PROMPT, 6)
    first = tok.encode(plain, add_special_tokens=False)
    word = tok.decode(first[:1]).strip()
    r = httpx.post(f"{server.url}/completions", timeout=60,
                   json={**base, "bad_words": [word]}).json()
    assert r["choices"][0]["text"] != plain
    for fields in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                   {"repetition_penalty": 1.3}, {"min_p": 0.2, "temperature": 1.0, "seed": 3}):
        want = llm.generate([PROMPT], SamplingParams(**{**{"temperature": 0.0, "max_tokens": 6},
                                                        **fields}),
                            use_progress=False)[0]
        r = httpx.post(f"{server.url}/completions", timeout=60, json={**base, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(want.token_ids), fields
    r = httpx.post(f"{server.url}/completions", timeout=60, json={
        **base, "temperature": 1.0, "n": 2, "best_of": 4, "seed": 1, "max_tokens": 5}).json()
    assert len(r["choices"]) == 2 and [c["index"] for c in r["choices"]] == [0, 1]


def _wait_idle(server: Server, timeout: float = 30) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if m["pagedhybrid:num_requests_running"] == 0 or time.time() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request_within_a_step(server: Server, llm: LLM,
                                                               stream: bool) -> None:
    before = server.metrics()["pagedhybrid:generation_tokens_total"]
    body = json.dumps({"model": server.model, "prompt": PROMPT, "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0, "stream": stream}).encode()
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        time.sleep(1.0)  # it is generating now
    left = time.time()
    m = _wait_idle(server)
    gone = time.time() - left
    generated = m["pagedhybrid:generation_tokens_total"] - before
    assert m["pagedhybrid:num_requests_running"] == 0, m
    assert generated < 1000, generated  # far from the 1,500 asked
    assert gone < 5.0, gone
    assert m["pagedhybrid:request_success_total"] >= 1
    still_serving(server, llm)


def test_metrics_have_every_series_from_the_start_and_no_created(tmp_path: Path) -> None:
    s = start_server(tmp_path, "--max-num-seqs", "4")
    try:
        text = httpx.get(f"{s.base}/metrics", timeout=30).text
    finally:
        assert s.stop() == 0
    assert "_created" not in text
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f'pagedhybrid:{name}{{model_name="{s.model}"}} 0.0' in text, name
    for reason in ("stop", "length", "abort", "error"):
        assert f'finished_reason="{reason}"' in text
    assert 'pagedhybrid:time_to_first_token_seconds_count{model_name=' in text


def test_backpressure_queues_by_default(tmp_path: Path) -> None:
    """No ``--max-waiting``: 40 requests on one running slot all complete (vLLM queues)."""
    s = start_server(tmp_path, "--max-num-seqs", "1")
    try:
        rs = flood(s, 40, max_tokens=3, timeout=300)
        assert [r.status_code for r in rs] == [200] * 40
        assert all(r.json()["usage"]["completion_tokens"] == 3 for r in rs)
    finally:
        assert s.stop() == 0


FAULTS = [  # (poison, where, how the poisoned request ends)
    (INTAKE, "intake", 500), (SCHED, "admission", 500), (STEP, "step", 500),
    (SAMPLE, "sampling", 500), (FINISH, "finishing", 500), (HOOK, "hook", 200),
]


def test_injected_faults_fail_their_request_alone(tmp_path: Path, llm: LLM) -> None:
    """Each fault path in a real server: the poisoned request fails (or, for the metrics hook,
    nothing fails), requests in other steps are answered exactly as alone, /health stays 200,
    and the pools are all free afterwards."""
    here = Path(__file__).parent
    s = start_server(tmp_path, "--max-num-seqs", "8", launcher=here / "fault_server.py")
    tok = llm.engine.tokenizer
    good_ids = tok.encode(PROMPT)
    want = greedy_text(llm, good_ids, 24)
    try:
        async def one(h: httpx.AsyncClient, prompt: list[int], n: int, **kw: object
                      ) -> httpx.Response:
            return await h.post(f"{s.url}/completions", json={
                "model": s.model, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})

        async def scenario(poison: int) -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as h:
                goods = [asyncio.ensure_future(one(h, good_ids, 24)) for _ in range(3)]
                await asyncio.sleep(0.5)  # the good ones are decoding: other steps
                bad = await one(h, [*good_ids[:5], poison, 7], 4)
                return list(await asyncio.gather(*goods)), bad

        for poison, where, status in FAULTS:
            goods, bad = asyncio.run(scenario(poison))
            assert bad.status_code == status, (where, bad.text)
            if status == 500:
                err = bad.json()["error"]
                assert "injected fault" in err["message"] and where in err["message"], err
                assert err["type"] == "server_error"
            if where != "step":  # a step's fault fails that step's requests, as asked
                for g in goods:
                    assert g.status_code == 200, (where, g.text)
                    assert g.json()["choices"][0]["text"] == want, where
            assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200, where
        # detokenisation: a generated token that cannot be decoded fails its choice alone
        r = httpx.post(f"{s.url}/completions", timeout=120, json={
            "model": s.model, "prompt": good_ids, "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(DETOK): 100}})
        assert r.status_code == 500 and "detokenisation" in r.json()["error"]["message"]
        chunks = [line for line in httpx.post(f"{s.url}/completions", timeout=120, json={
            "model": s.model, "prompt": [*good_ids, STEP], "max_tokens": 3,
            "stream": True}).text.splitlines() if line.startswith("data: ")]
        finish = json.loads(chunks[-3][6:])["choices"][0]["finish_reason"]
        assert finish == "error" and "error" in json.loads(chunks[-2][6:]), chunks
        assert chunks[-1] == "data: [DONE]"
        r = httpx.post(f"{s.url}/completions", timeout=120, json={
            "model": s.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want
        m = _wait_idle(s)
        assert m["pagedhybrid:num_requests_running"] == 0
        assert m["pagedhybrid:num_requests_waiting"] == 0
        assert m["pagedhybrid:kv_cache_usage_perc"] == 0
    finally:
        assert s.stop() == 0


def test_the_engine_runs_in_its_own_process_and_its_death_fails_requests_not_the_server(
        tmp_path: Path) -> None:
    """The engine is a child process of the server. Killed in the middle of a stream (as the
    OOM killer would), the stream ends with ``finish_reason: "error"``, an error object naming
    the exit and ``[DONE]``; ``/health`` turns 503 "error", new requests get a 503, and the
    server still exits 0 on SIGTERM."""
    s = start_server(tmp_path)
    try:
        (core,) = s.children()
        with httpx.stream("POST", f"{s.url}/completions", timeout=120, json={
                "model": s.model, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "error"
        err = json.loads(rest[-2][6:])["error"]
        assert "engine process exited (code -9)" in err["message"], err
        h = httpx.get(f"{s.base}/health", timeout=30)
        assert (h.status_code, h.json()["status"]) == (503, "error")
        r2 = httpx.post(f"{s.url}/completions", timeout=30, json={
            "model": s.model, "prompt": PROMPT, "max_tokens": 3})
        assert r2.status_code == 503 and "engine process exited" in r2.json()["error"]["message"]
    finally:
        assert s.stop() == 0


def test_a_folder_without_a_tokenizer_is_refused_at_once_and_the_engine_process_goes(
        tmp_path: Path) -> None:
    """``serve`` on a checkpoint with no tokenizer: exit 2 naming the cause, within seconds of
    the load (the engine process is told to stop over its pipe, not waited out and killed)."""
    from pagedhybrid.models.qwen35.synthetic import (
        random_weights,
        tiny_byte_config,
        write_checkpoint,
    )
    from pagedhybrid.models.qwen35.tokenizer import BYTE_TOKENIZER_FILE

    cfg = tiny_byte_config()
    write_checkpoint(tmp_path / "ckpt", cfg, random_weights(cfg, seed=1))
    (tmp_path / "ckpt" / BYTE_TOKENIZER_FILE).unlink()  # token ids only: no tokenizer at all
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pagedhybrid", "serve", str(tmp_path / "ckpt"),
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "has no tokenizer" in r.stderr, r.stderr
    # the engine process used to be waited out (10 s more) and killed here
    assert time.monotonic() - t0 < 12, time.monotonic() - t0  # ~6 s here
