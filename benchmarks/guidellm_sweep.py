"""guidellm's default sweep (the real guidellm 0.8.1) against ``pagedhybrid serve``, its defaults.

Starts ``pagedhybrid serve`` on the built-in model on 127.0.0.1 (a free port; the server's own
defaults -- dtype auto, requests queue, no ``--max-waiting`` -- unless ``--dtype`` /
``--serve-arg`` say otherwise) and runs::

    guidellm run --backend kind=openai_http,target=http://127.0.0.1:PORT,model=default-model
      --profile kind=sweep[,sweep_size=N] --data kind=synthetic_text,prompt_tokens=P,output_tokens=O
      --tokenizer kind=huggingface_auto,model=<built-in model folder>
      --constraint kind=max_duration,seconds=S --output kind=json,path=... --disable-progress

guidellm's sweep: synchronous, throughput (``max_concurrency`` requests in flight, 512 by
default, cut off by the time limit), then ``sweep_size - 2`` constant rates between the two
measured rates; streamed over ``/v1/chat/completions`` (guidellm's default) or
``--format completions``. ``--workers`` sets guidellm's worker processes
(``GUIDELLM__MAX_WORKER_PROCESSES``, 10 by default). Nothing is downloaded (the tokenizer is the
model folder, ``HF_*_OFFLINE=1``); the run is bounded (``sweep_size * (seconds + 90) + 120`` s).

A known greedy completion (``KNOWN_PROMPT``, 8 tokens) is asked before the sweep and again after
it; after the sweep ``/health`` must be 200, the server process alive and the known request
answered 200 with the same text. Then the server is stopped.

Prints one line per strategy from guidellm's JSON report (requests successful / incomplete /
errored, successful requests/s, output tokens/s, mean concurrency, TTFT and ITL p50 / p99 of the
successful requests) and the checks; writes that as JSON (``--out``); guidellm's own report
(several MB) is kept only with ``--report``. Exit status 0 when guidellm finished every strategy,
no request errored and the checks passed.

    python benchmarks/guidellm_sweep.py [--seconds 20] [--prompt-tokens 64] [--output-tokens 64]
        [--sweep-size 10] [--workers 10] [--format chat] [--dtype auto] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from _server import OFFLINE_ENV, free_port, start_pagedhybrid, stop
from latency import bench_lock
from pagedhybrid.models.qwen35 import default_model_dir

MODEL = "default-model"
KNOWN_PROMPT = "And it came to pass, when the king heard"
FORMATS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def guidellm_command(base: str, a: argparse.Namespace, report: Path) -> list[str]:
    profile = "kind=sweep" + (f",sweep_size={a.sweep_size}" if a.sweep_size else "") + \
        (f",max_concurrency={a.max_concurrency}" if a.max_concurrency else "")
    backend = f"kind=openai_http,target={base},model={MODEL}"
    if a.format != "chat":
        backend += f",request_format={FORMATS[a.format]}"
    return [str(Path(sys.executable).with_name("guidellm")), "run",
            "--backend", backend, "--profile", profile,
            "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},"
                      f"output_tokens={a.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={default_model_dir()}",
            "--constraint", f"kind=max_duration,seconds={a.seconds:g}",
            "--output", f"kind=json,path={report}", "--disable-progress"]


def known_answer(base: str) -> dict[str, Any]:
    """``/health`` and the known greedy completion: status codes and text."""
    out: dict[str, Any] = {}
    try:
        out["health"] = httpx.get(f"{base}/health", timeout=30).status_code
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": KNOWN_PROMPT, "max_tokens": 8, "temperature": 0})
        out["status"] = r.status_code
        out["text"] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:500]
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy of guidellm's JSON report."""
    rows = []
    for b in report["benchmarks"]:
        st, m = b["config"]["strategy"], b["metrics"]
        label = st["type_"]
        if st.get("rate"):
            label += f"@{st['rate']:.2f}/s"
        elif st["type_"] == "throughput":
            label += f"@{st['max_concurrency']}"
        pc = {k: m[k]["successful"]["percentiles"]
              for k in ("time_to_first_token_ms", "inter_token_latency_ms")}
        errors = sorted({str(r.get("info", {}).get("error"))[:200]
                         for r in b["requests"]["errored"]})
        rows.append({
            "strategy": label, "type": st["type_"], "rate": st.get("rate"),
            **{k: int(v) for k, v in m["request_totals"].items()},
            "requests_per_s": m["requests_per_second"]["successful"]["mean"],
            "output_tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
            "concurrency_mean": m["request_concurrency"]["total"]["mean"],
            "ttft_ms_p50": pc["time_to_first_token_ms"]["p50"],
            "ttft_ms_p99": pc["time_to_first_token_ms"]["p99"],
            "itl_ms_p50": pc["inter_token_latency_ms"]["p50"],
            "itl_ms_p99": pc["inter_token_latency_ms"]["p99"],
            "seconds": b["duration"], "errors": errors[:5]})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'strategy':18s} {'ok/inc/err':>13s} {'req/s':>6s} {'out tok/s':>9s} "
          f"{'conc':>6s} {'TTFT p50':>9s} {'p99 ms':>8s} {'ITL p50':>8s} {'p99 ms':>7s}")
    for r in rows:
        print(f"{r['strategy']:18s} {r['successful']:>4d}/{r['incomplete']:>4d}/"
              f"{r['errored']:>3d} {r['requests_per_s']:6.2f} {r['output_tokens_per_s']:9.1f} "
              f"{r['concurrency_mean']:6.1f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:8.1f} "
              f"{r['itl_ms_p50']:8.1f} {r['itl_ms_p99']:7.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per strategy")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--sweep-size", type=int, default=0,
                    help="strategies (synchronous, throughput, N-2 rates); 0: guidellm's (10)")
    ap.add_argument("--max-concurrency", type=int, default=0,
                    help="requests in flight at most; 0: guidellm's (512)")
    ap.add_argument("--workers", type=int, default=0,
                    help="guidellm's worker processes; 0: guidellm's (10)")
    ap.add_argument("--format", choices=sorted(FORMATS), default="chat")
    ap.add_argument("--dtype", default=None, help="the server's --dtype (default: its own)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more argument for pagedhybrid serve (repeatable)")
    ap.add_argument("--report", default=None, help="keep guidellm's own JSON report here")
    ap.add_argument("--lock", default="/tmp/pagedhybrid-bench.lock",
                    help="lock file serialising timing runs ('' = none)")
    ap.add_argument("--out", default="benchmarks/results/guidellm_sweep.json")
    a = ap.parse_args()

    logs = Path("benchmarks/results")
    logs.mkdir(parents=True, exist_ok=True)
    serve_args = [*(["--dtype", a.dtype] if a.dtype else []), *a.serve_arg]
    env = {**os.environ, **OFFLINE_ENV}
    if a.workers:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(a.workers)
    limit = (a.sweep_size or 10) * (a.seconds + 90) + 120
    result: dict[str, Any] = {
        "guidellm_version": version("guidellm"), "format": a.format,
        "seconds_per_strategy": a.seconds, "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens, "sweep_size": a.sweep_size or None,
        "max_concurrency": a.max_concurrency or None, "workers": a.workers or None,
        "serve_args": serve_args, "known_prompt": KNOWN_PROMPT}
    with tempfile.TemporaryDirectory() as tmp, bench_lock(a.lock):
        report = Path(tmp) / "guidellm.json"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server_log = logs / "guidellm_sweep-server.log"
        proc = start_pagedhybrid(port, server_log, MODEL, *serve_args)
        try:
            result["before"] = known_answer(base)
            cmd = guidellm_command(base, a, report)
            print("$ " + " ".join(cmd), flush=True)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, env=env, timeout=limit, check=False).returncode
            except subprocess.TimeoutExpired:
                print(f"guidellm: killed after {limit:.0f} s", file=sys.stderr)
                rc = None
            result["guidellm_rc"] = rc
            result["guidellm_seconds"] = time.perf_counter() - t0
            result["server_alive_after"] = proc.poll() is None
            result["after"] = known_answer(base)
        finally:
            stop(proc)
        result["server_log"] = str(server_log)
        rows = summarize(json.loads(report.read_text())) if report.is_file() else []
        if a.report and report.is_file():
            shutil.copy(report, a.report)
    result["strategies"] = rows
    before, after = result["before"], result["after"]
    checks = {
        "guidellm finished": result["guidellm_rc"] == 0,
        "every strategy ran": len(rows) == (a.sweep_size or 10),
        "every strategy had successful requests": bool(rows) and all(
            r["successful"] > 0 for r in rows),
        "no request errored": bool(rows) and all(r["errored"] == 0 for r in rows),
        "server alive after": result["server_alive_after"],
        "/health 200 after": after.get("health") == 200,
        "known request 200 after": after.get("status") == 200,
        "known request same answer": after.get("status") == 200
        and after.get("text") == before.get("text"),
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())

    print(f"\nguidellm {result['guidellm_version']} sweep against pagedhybrid serve "
          f"({' '.join(serve_args) or 'defaults'}), {FORMATS[a.format]}, "
          f"{a.prompt_tokens} prompt / {a.output_tokens} output tokens, {a.seconds:g} s per "
          f"strategy, guidellm ran {result['guidellm_seconds']:.0f} s")
    print_table(rows)
    for r in rows:
        if r["errors"]:
            print(f"  {r['strategy']} errors: {r['errors']}")
    print(f"known request before: {before}\nknown request after:  {after}")
    for name, ok in checks.items():
        print(f"  {name}: {'yes' if ok else 'NO'}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
