"""Real ``pagedhybrid serve`` processes on 127.0.0.1 (a free port each), and the in-process
``LLM`` on the same model for the expected answers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM
from server_process import free_port, wait_healthy

PROMPT = "And it came to pass, when the king heard"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    base: str
    model: str
    log: Path

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    def children(self) -> list[int]:
        """The server's child processes (the engine process)."""
        pid = self.proc.pid
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    def rss_kib(self) -> int:
        """Resident memory of the server and its engine process together."""
        total = 0
        for pid in (self.proc.pid, *self.children()):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return total

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pagedhybrid:") and "{" in line:
                name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        return int(self.proc.returncode)


def start_server(tmp: Path, *args: str, name: str = "default-model",
                 launcher: Path | None = None, dtype: str | None = "float32") -> Server:
    """A real server process; ``launcher`` runs a script instead of ``-m pagedhybrid`` (the
    fault-injection wrapper). ``dtype`` float32 by default: answers are compared with the
    in-process ``LLM``'s under other batch compositions, and bf16 (the built-in model's own
    dtype, what ``--dtype auto`` loads) rounds differently per batch; None: the server's
    default."""
    if dtype is not None:
        args = ("--dtype", dtype, *args)
    port = free_port()
    log = tmp / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    entry = [str(launcher)] if launcher is not None else ["-m", "pagedhybrid"]
    proc = subprocess.Popen(
        [sys.executable, *entry, "serve", "--port", str(port),
         "--served-model-name", name, *args],
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log)
    return Server(proc, base, name, log)


def flood(s: Server, n: int, max_tokens: int, timeout: float) -> list[httpx.Response]:
    """``n`` completions posted at once ("And the {i}", ``max_tokens`` each, EOS ignored)."""
    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=timeout) as h:
            return await asyncio.gather(*[h.post(
                f"{s.url}/completions", json={"model": s.model, "prompt": f"And the {i}",
                                              "max_tokens": max_tokens, "ignore_eos": True})
                for i in range(n)])

    return asyncio.run(post_all())


def greedy_text(llm: LLM, prompt: str | list[int], n: int) -> str:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n),
                       use_progress=False)[0]
    return llm.engine.tokenizer.decode(out.token_ids)


def still_serving(server: Server, llm: LLM) -> None:
    """``/health`` is 200 and a known greedy request gets the in-process engine's answer."""
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
    r = httpx.post(f"{server.url}/completions", timeout=120, json={
        "model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(llm, PROMPT, 6)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "16",
                     "--max-waiting", "512")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(None, dtype="float32", max_num_seqs=16)  # as the servers (start_server)
