"""Start and stop real server processes for the benchmarks (127.0.0.1, a free port each).

``start`` runs the command with ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` (nothing is
downloaded) and 2 OpenMP threads (``env`` adds or overrides variables, e.g. ``PYTHONPATH`` to
serve another checkout), waits for ``GET /health`` to answer 200, and returns the process;
``stop`` sends SIGTERM, waits, and kills only if the process outlives the wait.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], port: int, log: Path, timeout: float = 300,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
            **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{cmd[:3]} did not come up in {timeout:.0f} s")


def start_pagedhybrid(port: int, log: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    """``pagedhybrid serve`` (the built-in model) on 127.0.0.1:``port``."""
    return start([sys.executable, "-m", "pagedhybrid", "serve", "--port", str(port),
                  "--served-model-name", name, *args], port, log)


def stop(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
