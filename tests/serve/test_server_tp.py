"""``pagedhybrid serve --tensor-parallel-size 2`` driven by the real ``openai`` client.

The server process forks its engine process (rank 0), which starts rank 1 as a worker process
(the ``mp`` executor). Greedy answers equal the in-process TP=1 ``LLM``'s, streamed or not; a
stream the client drops is aborted on both ranks and the server keeps serving; a killed rank 1
ends the in-flight stream with an error naming it, ``/health`` turns 503 "error", new requests
get a 503, and SIGTERM still stops everything with exit 0 (no process left behind).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import Server, start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM

PROMPTS = ["The LORD is my shepherd;", "And the children of Israel"]


def _rank1(core: int) -> int:
    """The engine process's worker process (rank 1), among its children."""
    (pid,) = [int(c) for c in Path(f"/proc/{core}/task/{core}/children").read_text().split()
              if b"pagedhybrid.engine.worker.distributed"
              in Path(f"/proc/{c}/cmdline").read_bytes()]
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


@pytest.fixture
def tp_server(tmp_path: Path) -> Server:
    return start_server(tmp_path, "--tensor-parallel-size", "2", "--max-num-seqs", "4",
                        "--num-blocks", "64")


def test_tp2_server_answers_as_tp1_and_survives_a_dropped_stream(tp_server: Server,
                                                                  llm: LLM) -> None:
    s = tp_server
    try:
        (core,) = s.children()
        rank1 = _rank1(core)
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        want = [o.text for o in llm.generate(PROMPTS, params, use_progress=False)]
        got = [client.completions.create(model=s.model, prompt=p, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
               for p in PROMPTS]
        assert got == want
        stream = client.completions.create(model=s.model, prompt=PROMPTS[1], max_tokens=16,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == want[1]
        # a client that goes away mid-stream: its request is aborted, the ranks go on
        with httpx.stream("POST", f"{s.url}/completions", timeout=60, json={
                "model": s.model, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.time() + 30
        while s.metrics().get("pagedhybrid:num_requests_running", 1) and time.time() < deadline:
            time.sleep(0.2)
        assert s.metrics()["pagedhybrid:num_requests_running"] == 0
        again = client.completions.create(model=s.model, prompt=PROMPTS[0], max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == want[0]
        assert _alive(rank1)
    finally:
        assert s.stop() == 0
    assert not _alive(core) and not _alive(rank1)


def test_a_killed_rank_fails_the_stream_and_the_health_check(tp_server: Server) -> None:
    s = tp_server
    try:
        (core,) = s.children()
        rank1 = _rank1(core)
        with httpx.stream("POST", f"{s.url}/completions", timeout=120, json={
                "model": s.model, "prompt": PROMPTS[0], "max_tokens": 800, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            os.kill(rank1, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "error"
        err = json.loads(rest[-2][6:])["error"]
        assert "tensor-parallel rank 1 exited with code -9" in err["message"], err
        h = httpx.get(f"{s.base}/health", timeout=30)
        assert (h.status_code, h.json()["status"]) == (503, "error")
        r2 = httpx.post(f"{s.url}/completions", timeout=30, json={
            "model": s.model, "prompt": PROMPTS[0], "max_tokens": 3})
        assert r2.status_code == 503 and "rank 1" in r2.json()["error"]["message"]
    finally:
        assert s.stop() == 0
    assert not _alive(core)
