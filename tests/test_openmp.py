"""OpenMP's spin (``pagedhybrid.openmp``): set before torch loads libgomp, never over the user's
setting, and said in the engine's kernel line -- each case in a fresh interpreter, since libgomp
reads the variable once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
{first}
import pagedhybrid
from pagedhybrid import openmp
from pagedhybrid.engine import load_engine
line = load_engine(None, num_blocks=64, max_num_seqs=2).runner.kernel_summary()
print(json.dumps({{"env": os.environ.get("GOMP_SPINCOUNT"), "state": openmp.configure(),
                  "line": line}}))
"""


def probe(first: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("first", "given", "state", "said"), [
    ("", None, "set", "OpenMP spin: GOMP_SPINCOUNT=1000 (pagedhybrid's)"),
    ("", "20000", "user", "OpenMP spin: GOMP_SPINCOUNT=20000 (the environment's)"),
    ("import torch", None, "late", "OpenMP spin: libgomp's default (loaded before pagedhybrid"),
])
def test_the_spin_is_set_before_torch_loads_and_said(first: str, given: str | None, state: str,
                                                      said: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    got = probe(first, env)
    assert got["state"] == state
    assert got["env"] == {"set": "1000", "user": given, "late": None}[state]
    assert said in got["line"], got["line"]
