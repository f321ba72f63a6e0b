"""No answer size and no slow reader can take serving down (issue 51): answers far larger than
the engine-to-server pipe's buffer, many at once, many streams, a client that reads slowly --
each followed by ``/health`` 200 and a known request answered correctly.

The first test is the reproducer: lm-eval's loglikelihood request for a long context (``echo``,
``logprobs: 20``, ``max_tokens: 1``) made one engine message of several MB, which the server's
non-blocking pipe reader took for a dead engine: 500, then 503 for every request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from conftest import PROMPT, Server, greedy_text, still_serving

from pagedhybrid.engine import SamplingParams
from pagedhybrid.models.qwen35 import default_model_dir
from pagedhybrid.serve.llm import LLM


def max_model_len(server: Server) -> int:
    return int(httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]["max_model_len"])


def test_echo_with_20_logprobs_at_max_model_len(server: Server, llm: LLM) -> None:
    text = (default_model_dir() / "heldout.txt").read_text()[:6000]
    r = httpx.post(f"{server.url}/completions", timeout=600, json={
        "model": server.model, "prompt": text, "echo": True, "logprobs": 20, "max_tokens": 1,
        "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][0] != "" and len(lp["top_logprobs"]) == len(lp["tokens"]) > 1000
    assert all(len(t) >= 20 for t in lp["top_logprobs"][1:])
    # a whole context window of token ids: prompt + 1 = max_model_len
    n = max_model_len(server)
    ids = (llm.engine.tokenizer.encode(text) * 4)[:n - 1]
    r = httpx.post(f"{server.url}/completions", timeout=600, json={
        "model": server.model, "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1,
        "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n and len(lp["top_logprobs"][-1]) >= 20
    expect = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20,
                                                prompt_logprobs=20), use_progress=False)[0]
    assert lp["token_logprobs"][1] == expect.prompt_logprobs[1][ids[1]].logprob
    still_serving(server, llm)


def test_n_64_with_20_logprobs_and_long_outputs(server: Server, llm: LLM) -> None:
    r = httpx.post(f"{server.url}/completions", timeout=900, json={
        "model": server.model, "prompt": PROMPT, "n": 64, "logprobs": 20, "max_tokens": 160,
        "ignore_eos": True, "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(64))
    assert all(len(c["logprobs"]["top_logprobs"]) == 160 for c in choices)
    assert all(len(t) >= 20 for c in choices for t in c["logprobs"]["top_logprobs"])
    still_serving(server, llm)


async def _stream(h: httpx.AsyncClient, server: Server, i: int, delay: float = 0.0
                  ) -> tuple[str, str | None]:
    text, finish = "", None
    async with h.stream("POST", f"{server.url}/completions", json={
            "model": server.model, "prompt": f"And the {i}", "max_tokens": 48,
            "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 5}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if delay:
                await asyncio.sleep(delay)
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                finish = c["finish_reason"] or finish
    return text, finish


def test_100_concurrent_streams(server: Server, llm: LLM) -> None:
    async def run() -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(timeout=900) as h:
            return await asyncio.gather(*[_stream(h, server, i) for i in range(100)])

    results = asyncio.run(run())
    assert all(f == "length" for _, f in results), [f for _, f in results]
    for i in (0, 57, 99):  # greedy: the in-process engine's answer
        assert results[i][0] == greedy_text(llm, f"And the {i}", 48)
    still_serving(server, llm)


def test_a_slow_reader_holds_up_nobody(server: Server, llm: LLM) -> None:
    """A stream read at a chunk every 0.2 s while others are answered at full speed."""
    async def run() -> tuple[tuple[str, str | None], float, float]:
        async with httpx.AsyncClient(timeout=900) as h:
            slow = asyncio.create_task(_stream(h, server, 3, delay=0.2))
            await asyncio.sleep(0.5)
            start = time.perf_counter()
            r = await h.post(f"{server.url}/completions", json={
                "model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == \
                greedy_text(llm, PROMPT, 6)
            fast = time.perf_counter() - start
            out = await slow
            return out, fast, time.perf_counter() - start

    (text, finish), fast, slow_total = asyncio.run(run())
    assert finish == "length" and text == greedy_text(llm, "And the 3", 48)
    assert fast < slow_total  # answered while the slow stream was still being read
    still_serving(server, llm)
