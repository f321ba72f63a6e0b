"""Load, disconnects, memory and shutdown of a real ``pagedhybrid serve`` process.

64 concurrent streaming clients with random prompt and output lengths, a quarter of them
hanging up mid-stream at random times: every completed answer equals the request run alone,
and afterwards the metrics show nothing running or waiting and every page and slot free; two
rounds do not grow the server's RSS beyond noise. SIGTERM during load exits 0 within the bound,
without a traceback.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
from conftest import Server, start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM

WORDS = ("and", "the", "LORD", "said", "unto", "Moses", "children", "of", "Israel", "went",
         "up", "into", "land", "of", "Egypt", "king", "house", "people")


def workload(seed: int, n: int = 64) -> list[tuple[str, int, float | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        hang_up = rng.uniform(0.05, 1.5) if i % 4 == 0 else None  # 25% disconnect
        out.append((prompt, rng.randint(4, 48), hang_up))
    return out


async def one(h: httpx.AsyncClient, server: Server, prompt: str, n: int,
              hang_up: float | None) -> str | None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start, text = time.perf_counter(), []
    async with h.stream("POST", f"{server.url}/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if hang_up is not None and time.perf_counter() - start > hang_up:
                return None  # leaving the block closes the connection mid-stream
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


async def round_of(server: Server, jobs: list[tuple[str, int, float | None]]
                   ) -> list[str | None]:
    async with httpx.AsyncClient(timeout=300) as h:
        return await asyncio.gather(*[one(h, server, *j) for j in jobs])


def wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m["pagedhybrid:num_requests_running"] == 0 and
                m["pagedhybrid:num_requests_waiting"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.2)


def test_load_with_disconnects_frees_everything_and_rss_holds(server: Server, llm: LLM
                                                              ) -> None:
    tok = llm.engine.tokenizer
    rss = []
    for seed in (1, 2):
        jobs = workload(seed)
        got = asyncio.run(round_of(server, jobs))
        alone = llm.generate([p for p, _, _ in jobs],
                             [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                              for _, n, _ in jobs], use_progress=False)
        completed = 0
        for (prompt, _, _), text, want in zip(jobs, got, alone, strict=True):
            if text is not None:
                assert text == tok.decode(want.token_ids), prompt
                completed += 1
        assert completed >= 40
        m = wait_idle(server)
        assert m["pagedhybrid:num_requests_running"] == 0
        assert m["pagedhybrid:num_requests_waiting"] == 0
        assert m["pagedhybrid:kv_cache_usage_perc"] == 0.0  # cached prefix pages are not owned
        assert m["pagedhybrid:state_slot_usage_perc"] == 0.0
        assert m["pagedhybrid:request_success_total"] >= completed
        rss.append(server.rss_kib())
    assert rss[1] <= rss[0] * 1.10 + 20_000, rss  # no growth beyond noise (KiB)


async def outcome(h: httpx.AsyncClient, server: Server, prompt: str, n: int) -> str:
    """How a streamed request ended: its finish_reason, or the error code and message sent."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    end, done = None, False
    async with h.stream("POST", f"{server.url}/completions", json=body) as r:
        if r.status_code != 200:
            return f"http {r.status_code}: {(await r.aread()).decode()}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    end = f"{data['error']['code']}: {data['error']['message']}"
                elif data["choices"] and data["choices"][0]["finish_reason"] and end is None:
                    end = data["choices"][0]["finish_reason"]
    assert done, f"the stream was cut without [DONE] (last: {end})"
    return str(end)


def test_sigterm_during_load_exits_cleanly(tmp_path) -> None:
    """Requests that cannot finish within --shutdown-timeout get a last answer (an error chunk
    saying the server is shutting down, then [DONE]), never a cut connection; the process
    exits 0 without a traceback."""
    s = start_server(tmp_path, "--max-num-seqs", "4", "--shutdown-timeout", "2")

    async def load_then_term() -> list[str | BaseException]:
        async with httpx.AsyncClient(timeout=60) as h:
            # 32 answers of 1,900 tokens, 4 at a time: more than any machine finishes in the
            # 2 s grace, so some are always cut however fast the CI machine is
            tasks = [asyncio.create_task(outcome(h, s, p, 1900)) for p, _, _ in workload(3, 32)]
            deadline = time.time() + 30
            while (await asyncio.to_thread(s.metrics))["pagedhybrid:num_requests_running"] == 0:
                assert time.time() < deadline, "no request started within 30 s"
                await asyncio.sleep(0.1)
            s.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks, return_exceptions=True)

    start = time.time()
    ends = asyncio.run(load_then_term())
    code = s.proc.wait(30)
    assert code == 0 and time.time() - start < 60
    log = s.log.read_text()
    assert "Traceback" not in log, log
    assert all(isinstance(e, str) for e in ends), ends
    cut = [e for e in ends if isinstance(e, str) and "shutting down" in e]
    assert cut and all(e.startswith("service_unavailable") for e in cut), ends
    assert all(e in ("length",) or e in cut for e in ends), ends
