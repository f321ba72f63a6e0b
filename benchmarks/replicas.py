"""Engine replicas behind the prefix-aware router (``pagedhybrid serve --replicas N``, Ray Serve):
throughput and TTFT of 1 vs 2 replicas on a shared-system-prompt workload, prefix-aware vs
round-robin routing.

Cluster: a local Ray head with 2 CPUs (``ray start --head --block``, free ports, its own
``--temp-dir``, ``RAY_AUTH_MODE=disabled``; SIGTERM stops it -- never ``ray stop``). One launcher
per configuration (``python -m pagedhybrid serve --replicas N --router R --ray-address ...``,
stopped with SIGTERM, exit code recorded): 1 replica; 2 x ``prefix``; 2 x ``round_robin``. Each
replica ``--cpus-per-replica 1`` and one engine thread: its server inherits its Ray worker's
environment, hence the head's, so the head starts with ``OMP_NUM_THREADS=1`` (Ray sets it to the
replica's CPUs only when unset); torch's threads and the adaptive-thread governor's ceiling
follow it. Rows record the servers' ``OMP_NUM_THREADS`` from ``/proc/<pid>/environ`` (pids from
``pagedhybrid:replica_info``). Model: the built-in one, ``--dtype float32`` (as the replica tests;
the checkpoint is bf16), ``--num-blocks 512`` (block 16, state checkpoints every 64 tokens),
``--num-state-checkpoints 64`` (the default, one row per state slot, holds too few for 5
interleaved system prompts: with it every configuration measured a hit rate of 0). The
launcher, Ray Serve's proxy, the ingress (which tokenizes every prompt for the router) and this
client share the 2 cores with the replicas.

Workload (the ``openai`` AsyncOpenAI client, streamed chat completions): ``--systems`` S system
prompts of ``--prefix-tokens`` tokens (slices of the built-in model's ``heldout.txt``) x
``--questions`` Q user questions, ``--max-tokens`` output tokens (greedy, EOS ignored),
``--concurrency`` in flight, question-major (q0 of every system, then q1, ...; S odd, so that
round-robin over 2 replicas splits each system's questions). First: wait until ``/metrics`` lists
all N replicas (``/health`` answers 200 "degraded" while the router knows only some), then one
warm-up request per replica, one after the other. Per configuration: total seconds, completion
tok/s, requests/s, TTFT (to the first content chunk) median / p90 and, as deltas of the
endpoint's aggregated ``/metrics`` over the run, the prefix-cache hit rate (hit / looked-up
tokens) and the router's requests by reason and by replica (``pinned`` -- ``/metrics`` reads --
left out).

    python benchmarks/replicas.py --quick
    python benchmarks/replicas.py            # writes benchmarks/results/replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _server import OFFLINE_ENV, free_port, start, stop  # noqa: E402

MODEL = "default-model"
CONFIGS = ((1, "prefix"), (2, "prefix"), (2, "round_robin"))
ENV = {**OFFLINE_ENV, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def port() -> int:
    """A free port outside Ray's default worker port range (10002-19999)."""
    while 10002 <= (p := free_port()) < 20000:
        pass
    return p


def ray_head(temp: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    gcs = port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
         "--num-cpus", "2", "--port", str(gcs), "--temp-dir", temp, "--disable-usage-stats",
         "--include-dashboard", "false", "--object-store-memory", str(200 << 20),
         "--ray-client-server-port", str(port()), "--dashboard-port", str(port()),
         "--dashboard-agent-listen-port", str(port())],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    deadline = time.time() + 180
    while "block forever" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise RuntimeError(f"ray start failed: {log.read_text()[-3000:]}")
        time.sleep(0.3)
    return proc, f"127.0.0.1:{gcs}"


def workload(systems: int, questions: int, prefix_tokens: int) -> list[list[dict[str, str]]]:
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    tok = load_tokenizer(default_model_dir())
    ids = tok.encode(heldout_text_path().read_text(encoding="utf-8"))
    sys_prompts = [f"You are assistant {k}. Answer from this passage only.\n"
                   + tok.decode(ids[k * prefix_tokens:(k + 1) * prefix_tokens])
                   for k in range(systems)]
    return [[{"role": "system", "content": sys_prompts[k]},
             {"role": "user", "content": f"Question {q}: what happens in verse {q + 1}?"}]
            for q in range(questions) for k in range(systems)]


def metrics(base: str) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[int]]:
    """(aggregated totals, router requests by reason, by replica, server pids)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedhybrid.serve.replica_metrics import parse_totals

    text = httpx.get(f"{base}/metrics", timeout=60).text
    reasons: dict[str, float] = {}
    replicas: dict[str, float] = {}
    pids: list[int] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pagedhybrid:router_requests_total" and s.labels["reason"] != "pinned":
                reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0) + s.value
                replicas[s.labels["replica"]] = replicas.get(s.labels["replica"], 0) + s.value
            elif s.name == "pagedhybrid:replica_info":
                pids.append(int(s.labels["pid"]))
    return parse_totals(text), reasons, replicas, pids


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def omp_threads(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError as exc:
        return f"? ({type(exc).__name__})"
    return next((e.split(b"=", 1)[1].decode() for e in env
                 if e.startswith(b"OMP_NUM_THREADS=")), "unset")


async def drive(base: str, chats: list[list[dict[str, str]]], concurrency: int,
                max_tokens: int) -> tuple[float, list[float], int]:
    """(seconds, TTFTs, completion tokens) of ``chats`` with ``concurrency`` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                timeout=600)
    todo = iter(chats)  # shared by the workers
    ttfts: list[float] = []
    tokens = 0

    async def one(messages: list[dict[str, str]]) -> None:
        nonlocal tokens
        t0, first = time.perf_counter(), None
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        if first is None:
            raise RuntimeError("a stream without content")
        ttfts.append(first)

    async def worker() -> None:
        for messages in todo:
            await one(messages)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    await client.close()
    return seconds, ttfts, tokens


def run_config(address: str, n: int, router: str, chats: list[list[dict[str, str]]],
               args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    p = port()
    base = f"http://127.0.0.1:{p}"
    log = tmp / f"launcher-{n}-{router}.log"
    t0 = time.perf_counter()
    proc = start([sys.executable, "-m", "pagedhybrid", "serve", "--replicas", str(n),
                  "--router", router, "--ray-address", address, "--port", str(p),
                  "--served-model-name", MODEL, "--dtype", "float32", "--cpus-per-replica", "1",
                  "--max-num-seqs", str(args.concurrency), "--num-blocks", "512",
                  "--num-state-checkpoints", "64",
                  "--health-check-period", "2", "--health-check-timeout", "30"],
                 p, log, timeout=600, env=ENV)
    row: dict[str, Any] = {"replicas": n, "router": router,
                           "start_s": round(time.perf_counter() - t0, 1)}
    try:  # /health is 200 already when degraded (some replicas): wait for all n
        deadline, row["replicas_seen_at_health"] = time.time() + 120, len(metrics(base)[3])
        while len(metrics(base)[3]) < n:
            if time.time() > deadline:
                raise RuntimeError(f"the router did not see {n} replicas in 120 s")
            time.sleep(0.5)
        row["ready_s"] = round(time.perf_counter() - t0, 1)
        warm = [[{"role": "user", "content": f"Warm-up {i}."}] for i in range(n)]
        asyncio.run(drive(base, warm, 1, 2))  # one after the other: concurrent ones may pile up
        before, reasons0, per0, pids = metrics(base)
        seconds, ttfts, tokens = asyncio.run(drive(base, chats, args.concurrency,
                                                   args.max_tokens))
        after, reasons1, per1, _ = metrics(base)
        d = delta(after, before)
        hits = d.get("pagedhybrid:prefix_cache_hits_total", 0.0)
        queries = d.get("pagedhybrid:prefix_cache_queries_total", 0.0)
        ttfts.sort()
        row.update({
            "requests": len(chats), "completion_tokens": tokens, "total_s": round(seconds, 3),
            "completion_tok_s": round(tokens / seconds, 2),
            "requests_s": round(len(chats) / seconds, 3),
            "ttft_median_s": round(statistics.median(ttfts), 4),
            "ttft_p90_s": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 4),
            "prefix_hit_rate": round(hits / queries, 4) if queries else None,
            "prefix_hit_tokens": hits, "prefix_query_tokens": queries,
            "router_reasons": delta(reasons1, reasons0),
            "requests_per_replica": sorted(delta(per1, per0).values(), reverse=True),
            "server_omp_threads": [omp_threads(pid) for pid in pids]})
    finally:
        stop(proc, timeout=180)
        row["launcher_exit"] = proc.returncode
    if proc.returncode != 0:
        print(f"{log}:\n{log.read_text()[-3000:]}", file=sys.stderr)
    return row


def main() -> int:
    from latency import cpu_line, loadavg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny workload; writes nothing")
    ap.add_argument("--systems", type=int, default=5)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "replicas.json"))
    args = ap.parse_args()
    if args.quick:
        args.systems, args.questions, args.prefix_tokens, args.max_tokens = 3, 2, 100, 4
    chats = workload(args.systems, args.questions, args.prefix_tokens)
    report: dict[str, Any] = {"cpu": cpu_line(), "loadavg_before": loadavg(), "workload": {
        k: getattr(args, k) for k in ("systems", "questions", "prefix_tokens", "max_tokens",
                                      "concurrency")}, "rows": []}
    print(report["cpu"], flush=True)
    temp = tempfile.mkdtemp(prefix="phray-", dir="/tmp")  # short: Ray's socket paths
    tmp = Path(tempfile.mkdtemp(prefix="phreplicas-"))
    head, address = ray_head(temp, tmp / "ray.log")
    try:
        for n, router in CONFIGS:
            row = run_config(address, n, router, chats, args, tmp)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop(head, timeout=120)  # SIGTERM: the head and everything it started
        shutil.rmtree(temp, ignore_errors=True)
    report["loadavg_after"] = loadavg()
    if ok := all(r["launcher_exit"] == 0 for r in report["rows"]):
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print("wrote", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
