"""The real guidellm (0.8.1) sweep against a real ``pagedhybrid serve`` with the server's defaults.

guidellm's default sweep profile (``guidellm run --profile kind=sweep``): synchronous, then
throughput (512 requests in flight, cut off by the time limit), then 8 constant rates between the
two, on its synthetic text over ``/v1/chat/completions``, streamed. Each strategy is bounded by
``--constraint kind=max_duration`` (``SECONDS``) and guidellm runs 2 worker processes instead of
its 10 (``GUIDELLM__MAX_WORKER_PROCESSES``; with 10 on 2 busy cores it once hung in its first
step), so the whole sweep takes under 3 minutes. Its tokenizer is the built-in model folder and
nothing is downloaded.

Every strategy must have completed with successful requests and no errored ones; afterwards the
same server process still answers ``/health`` with 200 and a known greedy request with the
in-process engine's answer (``still_serving``). The throughput step's 512 requests, all cut off
at once, are what killed the server before issue 51's fix: the outputs of the requests cut off
(each with its prompt's token ids) made engine -> server messages larger than the pipe's buffer,
which the non-blocking pipe reader took for a dead engine (503 for everything after). 256-token
prompts make those messages large enough with 2 workers too (with 64-token prompts the old
server survived the step in 1 run of 3).
``benchmarks/guidellm_sweep.py`` runs the sweep at full length and prints its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Server, start_server, still_serving

from pagedhybrid.models.qwen35 import default_model_dir
from pagedhybrid.serve.llm import LLM

SECONDS = 8          # per strategy
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64
SWEEP_SIZE = 10      # guidellm's default: synchronous, throughput, 8 constant rates
THROUGHPUT_CONCURRENCY = 512  # guidellm's default for the throughput step
LIMIT_S = 480        # the whole guidellm run at most (it takes ~150 s on 2 cores)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server's defaults (requests queue, no --max-waiting), fp32 as ``llm``."""
    s = start_server(tmp_path_factory.mktemp("guidellm"))
    yield s
    s.stop()


def run_sweep(server: Server, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    report = out / "guidellm.json"
    cmd = [str(Path(sys.executable).with_name("guidellm")), "run",
           "--backend", f"kind=openai_http,target={server.base},model={server.model}",
           "--profile", "kind=sweep",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                    f"output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={default_model_dir()}",
           "--constraint", f"kind=max_duration,seconds={SECONDS}",
           "--output", f"kind=json,path={report}", "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "2"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"guidellm did not finish in {LIMIT_S} s; server log:\n"
                             f"{server.log.read_text()[-3000:]}") from exc
    return proc, report


@pytest.mark.slow
def test_guidellm_default_sweep_completes(default_server: Server, llm: LLM,
                                          tmp_path: Path) -> None:
    s = default_server
    proc, report = run_sweep(s, tmp_path)
    context = (f"guidellm rc {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}\n"
               f"server alive: {s.proc.poll() is None}; server log:\n"
               f"{s.log.read_text()[-3000:]}")
    assert proc.returncode == 0, context
    benchmarks = json.loads(report.read_text())["benchmarks"]
    strategies = [b["config"]["strategy"] for b in benchmarks]
    assert [st["type_"] for st in strategies] == \
        ["synchronous", "throughput"] + ["constant"] * (SWEEP_SIZE - 2), context
    assert strategies[1]["max_concurrency"] == THROUGHPUT_CONCURRENCY
    for b, st in zip(benchmarks, strategies, strict=True):
        totals = b["metrics"]["request_totals"]
        errors = [r.get("info", {}).get("error") for r in b["requests"]["errored"][:3]]
        assert totals["successful"] > 0 and totals["errored"] == 0, \
            f"{st['type_']} {st.get('rate')}: {totals}, errors {errors}\n{context}"
    assert s.proc.poll() is None, context
    still_serving(s, llm)
