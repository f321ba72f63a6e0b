"""Open-loop load against ``pagedhybrid serve`` and ``transformers serve``, same model, one run.

Both servers serve the built-in model folder on 127.0.0.1 (one at a time, so they never share
the 2 cores). ``transformers serve`` runs without continuous batching: with it, transformers
5.24 refuses the hybrid model (``ValueError: Invalid layer type: linear_attention`` in its paged
cache), which the report's notes record.

Load: Poisson arrivals at each ``--rates`` value (requests/s) for ``--seconds`` seconds; prompts
are held-out KJV passages of 20-100 tokens, outputs 32-64 tokens (greedy; EOS ignored where
the server accepts ``ignore_eos``; tokens/s counts the tokens actually streamed), all streamed
over ``/v1/completions``. Per rate and server: output tokens/s, TTFT and inter-token
latency p50/p99, and the highest rate sustained with p99 TTFT under 2 s. Writes JSON.

guidellm's sweep against the server: ``benchmarks/guidellm_sweep.py``.

    python benchmarks/serve.py [--rates 0.5 1 2 4 8 16] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from itertools import pairwise
from pathlib import Path

import httpx

from _server import free_port, start, stop
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.default_model import heldout_text_path


async def one(h: httpx.AsyncClient, url: str, model: str, prompt: str, n: int,
              extra: dict[str, object]) -> tuple[float, list[float], int] | None:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, **extra}
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async with h.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
    except httpx.HTTPError:
        return None
    if not stamps:
        return None
    itl = [b - a for a, b in pairwise(stamps)]
    return stamps[0] - t0, itl, len(stamps)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


async def run_rate(url: str, model: str, rate: float, seconds: float,
                   work: list[tuple[str, int]], seed: int,
                   extra: dict[str, object]) -> dict[str, float]:
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as h:
        t, i = 0.0, 0
        while t < seconds:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            prompt, n = work[i % len(work)]
            tasks.append(asyncio.create_task(one(h, url, model, prompt, n, extra)))
            i += 1
            t += rng.expovariate(rate)
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
    elapsed = time.perf_counter() - start
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    return {"rate": rate, "requests": len(tasks), "completed": len(results),
            "output_tokens_per_s": sum(r[2] for r in results) / elapsed,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    a = ap.parse_args()
    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    ids = tok.encode(heldout_text_path().read_text(encoding="utf-8"))
    rng = random.Random(0)
    work = []
    for _ in range(200):
        n = rng.randint(20, 100)
        s = rng.randrange(1, len(ids) - n)
        work.append((tok.decode(ids[s:s + n]), rng.randint(32, 64)))
    logs = Path("benchmarks/results")
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    tbin = str(Path(py).with_name("transformers"))
    systems = {
        "pagedhybrid": lambda port: [py, "-m", "pagedhybrid", "serve", "--port", str(port),
                                     "--served-model-name", "m", "--max-num-seqs", "64",
                                     "--max-waiting", "4096"],
        "transformers": lambda port: [tbin, "serve", str(model_dir), "--port", str(port)],
    }
    # transformers serve rejects unknown request fields (422), so only pagedhybrid gets
    # ignore_eos; throughput counts the tokens each server actually streamed.
    extras: dict[str, dict[str, object]] = {"pagedhybrid": {"ignore_eos": True},
                                            "transformers": {}}
    notes = {"transformers": "transformers serve without continuous batching: "
                             "--continuous-batching fails for this hybrid model in 5.24 "
                             "(ValueError: Invalid layer type: linear_attention)"}
    report: dict[str, object] = {"rates": a.rates, "seconds": a.seconds, "notes": notes}
    for name, cmd in systems.items():
        port = free_port()
        proc = start(cmd(port), port, logs / f"serve-{name}.log")
        model = "m" if name == "pagedhybrid" else str(model_dir)
        extra = extras[name]
        url = f"http://127.0.0.1:{port}/v1/completions"
        rows = []
        try:
            asyncio.run(run_rate(url, model, 1.0, 2.0, work, 99, extra))  # warm-up
            for rate in a.rates:
                row = asyncio.run(run_rate(url, model, rate, a.seconds, work, int(rate * 10),
                                         extra))
                rows.append(row)
                print(f"{name:12s} rate {rate:5.1f}/s: {row['completed']}/{row['requests']} done"
                      f", {row['output_tokens_per_s']:7.1f} tok/s, TTFT p50 "
                      f"{row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f} s, ITL p50 "
                      f"{1e3 * row['itl_p50_s']:.1f} p99 {1e3 * row['itl_p99_s']:.1f} ms",
                      flush=True)
                if row["ttft_p99_s"] > 10:
                    break  # saturated: higher rates only queue
        finally:
            stop(proc)
        ok = [r["rate"] for r in rows if r["ttft_p99_s"] < 2.0 and r["completed"] ==
              r["requests"]]
        report[name] = {"rows": rows, "sustained_rate": max(ok) if ok else 0.0}
    ours = report["pagedhybrid"]["sustained_rate"]  # type: ignore[index]
    theirs = report["transformers"]["sustained_rate"]  # type: ignore[index]
    report["sustained_ratio"] = ours / theirs if theirs else float("inf")
    print(f"sustained rate (p99 TTFT < 2 s): pagedhybrid {ours}/s, transformers {theirs}/s "
          f"-> {report['sustained_ratio']:.1f}x")
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
