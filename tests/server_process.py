"""What the tests that start real processes share (``tests/`` is on pytest's ``pythonpath``):
a free 127.0.0.1 port, and the wait for a started server's ``/health``."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, what: str = "server",
                 timeout: float = 180.0) -> None:
    """Return once ``base``/health answers 200; fail with the process's log if it exits first
    or does not come up within ``timeout`` seconds (then it is killed)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"{what} did not come up: {log.read_text()}")
