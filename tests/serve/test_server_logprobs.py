"""Logprobs as lm-eval and vLLM read them, through a real server: lm-eval's loglikelihood
request shape (echo + logprobs + max_tokens 1) equals ``LLM.score``, ``max_tokens: 0`` + echo,
vLLM's ``prompt_logprobs``, and streamed completions with logprobs."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import Server

from pagedhybrid.serve.llm import LLM

PAIRS = [("And God said, Let there be", " light: and there was light."),
         ("In the beginning God created the heaven", " and the earth."),
         ("The LORD is my shepherd; I shall", " not want.")]


def lm_eval_payload(server: Server, prompt: object) -> dict:
    """What lm-eval 0.4's local-completions sends for loglikelihood requests."""
    return {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}


@pytest.mark.parametrize("tokenized", [True, False])
def test_loglikelihood_as_lm_eval_asks_equals_llm_score(server: Server, llm: LLM,
                                                        tokenized: bool) -> None:
    tok = llm.engine.tokenizer
    ctxs = [tok.encode(c) for c, _ in PAIRS]
    fulls = [tok.encode(c + x) for c, x in PAIRS]
    for ctx, full in zip(ctxs, fulls, strict=True):
        assert full[:len(ctx)] == ctx  # the pairs split cleanly at a token boundary
    want = llm.score([f[:len(c)] for c, f in zip(ctxs, fulls, strict=True)],
                     [f[len(c):] for c, f in zip(ctxs, fulls, strict=True)])
    prompt = fulls if tokenized else [c + x for c, x in PAIRS]
    r = httpx.post(f"{server.url}/completions", json=lm_eval_payload(server, prompt),
                   timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(PAIRS)
    for ch, ctx, full, w in zip(choices, ctxs, fulls, want, strict=True):
        lp = ch["logprobs"]
        assert len(lp["token_logprobs"]) == len(full) + 1  # prompt + the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][len(ctx):-1]  # lm-eval's slice
        assert got == pytest.approx(w, abs=1e-4)
        assert sum(got) == pytest.approx(sum(w), abs=1e-4)
        for top, mine in zip(lp["top_logprobs"][len(ctx):-1], got, strict=True):
            assert mine in top.values()  # the token's own entry is always there


def test_max_tokens_zero_with_echo_returns_the_prompt_and_its_logprobs(
        server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    ctx, cont = PAIRS[0]
    ids = tok.encode(ctx + cont)
    r = httpx.post(f"{server.url}/completions", timeout=60, json={
        "model": server.model, "prompt": ctx + cont, "max_tokens": 0, "echo": True,
        "logprobs": 2}).json()
    ch = r["choices"][0]
    assert ch["text"] == ctx + cont and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == len(ids)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                          "total_tokens": len(ids)}
    want = llm.score([ids[:1]], [ids[1:]])[0]
    assert ch["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) >= 2 for t in ch["logprobs"]["top_logprobs"][1:])


def test_prompt_logprobs_as_vllm_returns_them(server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    ids = tok.encode(PAIRS[1][0])
    want = llm.score([ids[:1]], [ids[1:]])[0]
    r = httpx.post(f"{server.url}/completions", timeout=60, json={
        "model": server.model, "prompt": ids, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 3}).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for t, d, w in zip(ids[1:], pl[1:], want, strict=True):
        assert d[str(t)]["logprob"] == pytest.approx(w, abs=1e-4)
        assert len(d) >= 3 and all({"logprob", "rank", "decoded_token"} <= set(v)
                                   for v in d.values())
    r = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == \
        r["usage"]["prompt_tokens"]


def test_streamed_completions_carry_the_same_logprobs(server: Server) -> None:
    body = {"model": server.model, "prompt": PAIRS[2][0], "max_tokens": 10, "temperature": 0,
            "logprobs": 2, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/completions", json=body, timeout=60).json()
    tokens, lps = [], []
    with httpx.stream("POST", f"{server.url}/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp is not None:
                    tokens += lp["tokens"]
                    lps += lp["token_logprobs"]
    want = whole["choices"][0]["logprobs"]
    assert tokens == want["tokens"] and lps == pytest.approx(want["token_logprobs"], abs=1e-6)
    assert len(tokens) == 10


def test_add_special_tokens_false_tokenizes_text_without_bos(server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    text = PAIRS[0][0]
    for special in (True, False):
        r = httpx.post(f"{server.url}/completions", timeout=60, json={
            "model": server.model, "prompt": text, "max_tokens": 0, "echo": True,
            "logprobs": 0, "add_special_tokens": special}).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=special))
    assert len(tok.encode(text, add_special_tokens=True)) != len(
        tok.encode(text, add_special_tokens=False))  # the check above can tell them apart
