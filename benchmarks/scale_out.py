"""Scale-out: tensor parallelism's cost on this machine, on paper for a 27B-class model on 2-8
machines, and engine replicas behind the prefix-aware router.

``tp`` -- TP=1 vs TP=2 (``mp`` executor: rank 1 a worker process, each rank ``cores // 2``
threads; TP=1 gets all the cores) on the built-in model and on the 141M random hybrid of
``benchmarks/engine.py`` (hidden 1024, 8 layers): ``tg`` one request decoding ``--tokens``
tokens (decode tok/s, first token excluded) and ``b8`` eight requests decoding together (tok/s
after all have their first token); for TP=2 the share of rank 0's step time spent inside the
row-parallel all-reduces (``ParallelConfig.all_reduce`` timed in this process: it includes
waiting for the slower rank) and the all-reduces per step. Medians of ``--reps``.

``paper`` -- a 27B-class model (Qwen3.8-27B geometry: hidden 5120, 64 layers, two row-parallel
all-reduces per layer, bf16 activations): the bytes each rank sends per token per step with a
ring all-reduce (``2 (W-1) / W`` of the activations), the time that takes at the stated network
bandwidths, and the per-step latency floor (``2 (W-1)`` hops per all-reduce x 128 all-reduces x
the stated one-way latency), against the decode step's weight-reading time on each machine
(54 GB of bf16 weights / W at the stated memory bandwidth per machine).

``replicas`` -- 1 vs 2 replicas, prefix vs round-robin routing: ``replicas.py`` (Ray Serve).

    python benchmarks/scale_out.py --quick
    python benchmarks/scale_out.py            # writes benchmarks/results/scale_out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

NETWORKS_GBIT = (10, 25, 100)  # network bandwidths on paper, Gbit/s
LATENCY_US = 25.0  # one-way latency of one hop (TCP on a datacentre LAN), microseconds
MEMORY_GBS = 200.0  # memory bandwidth of one CPU machine reading weights, GB/s
PAPER = {"hidden": 5120, "layers": 64, "params": 27e9, "bytes": 2}


def _timed_all_reduce() -> dict[str, float]:
    """Time spent inside ``ParallelConfig.all_reduce`` in this process (rank 0)."""
    from pagedhybrid.parallel.linear import ParallelConfig

    acc = {"s": 0.0, "n": 0}
    orig = ParallelConfig.all_reduce

    def timed(self: Any, t: Any) -> Any:
        t0 = time.perf_counter()
        out = orig(self, t)
        acc["s"] += time.perf_counter() - t0
        acc["n"] += 1
        return out

    ParallelConfig.all_reduce = timed  # type: ignore[method-assign]
    return acc


def _decode(llm: Any, prompts: list[str], tokens: int) -> tuple[float, int]:
    """Decode tok/s of ``prompts`` together (after every one has its first token), steps."""
    from pagedhybrid.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{time.perf_counter_ns()}-{i}", p, params)
    first: set[str] = set()
    t0, steps0, n = None, engine.stats.steps, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if t0 is not None:
                n += len(o.new_token_ids)
            first.add(o.request_id)
        if t0 is None and len(first) == len(prompts):
            t0, steps0 = time.perf_counter(), engine.stats.steps
    return n / (time.perf_counter() - (t0 or 0.0)), engine.stats.steps - steps0


def tp_rows(model: str | None, name: str, reps: int, tokens: int) -> list[dict[str, Any]]:
    from pagedhybrid.serve.llm import LLM

    acc = _timed_all_reduce()
    prompts = [f"And the {i} children of Israel went" for i in range(8)]
    rows = []
    for tp in (1, 2):
        with LLM(model, dtype="float32", tensor_parallel_size=tp, num_blocks=256,
                 max_num_seqs=8, enable_prefix_caching=False, adaptive_threads=False) as llm:
            _decode(llm, prompts[:1], 8)  # warm-up
            for label, batch in (("tg", prompts[:1]), ("b8", prompts)):
                speeds, shares, per_step = [], [], []
                for _ in range(reps):
                    acc["s"], acc["n"] = 0.0, 0
                    t0 = time.perf_counter()
                    tps, steps = _decode(llm, batch, tokens)
                    wall = time.perf_counter() - t0
                    speeds.append(tps)
                    shares.append(acc["s"] / wall)
                    per_step.append(acc["n"] / max(steps, 1))
                row = {"model": name, "tp": tp, "case": label,
                       "tok_s": round(statistics.median(speeds), 1)}
                if tp > 1:
                    row["all_reduce_share"] = round(statistics.median(shares), 3)
                    row["all_reduces_per_step"] = round(statistics.median(per_step), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def paper() -> list[dict[str, Any]]:
    """The 27B-class all-reduce traffic on 2-8 machines (module docstring)."""
    per_token = PAPER["hidden"] * PAPER["bytes"]  # one all-reduce's activations per token
    count = 2 * PAPER["layers"]
    out = []
    for w in (2, 4, 8):
        sent = 2 * (w - 1) / w * per_token * count  # bytes each rank sends per token per step
        weights_s = PAPER["params"] * PAPER["bytes"] / w / (MEMORY_GBS * 1e9)
        floor = count * 2 * (w - 1) * LATENCY_US * 1e-6
        row: dict[str, Any] = {"machines": w, "all_reduces_per_step": count,
                               "bytes_per_all_reduce_per_token": per_token,
                               "bytes_sent_per_rank_per_token": int(sent),
                               "latency_floor_ms_per_step": round(floor * 1e3, 2),
                               "decode_weight_read_ms_per_step": round(weights_s * 1e3, 1)}
        for g in NETWORKS_GBIT:
            bw = g * 1e9 / 8
            row[f"ms_per_token_at_{g}gbit"] = round(sent / bw * 1e3, 3)
            # decode at batch 1: network time (latency floor + bytes) vs weight reading
            net = floor + sent / bw
            row[f"b1_decode_network_share_at_{g}gbit"] = round(net / (net + weights_s), 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    from latency import cpu_line, write_small_model
    from pagedhybrid.models.qwen35 import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "scale_out.json"))
    args = ap.parse_args()
    reps, tokens = (1, 16) if args.quick else (args.reps, args.tokens)
    report: dict[str, Any] = {"cpu": cpu_line(), "paper": {
        "model": "27B-class (hidden 5120, 64 layers, bf16 activations)",
        "one_way_latency_us": LATENCY_US, "memory_bandwidth_gb_s_per_machine": MEMORY_GBS,
        "rows": paper()}}
    print(report["cpu"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        write_small_model(small, default_model_dir(), seed=0)
        report["tp"] = (tp_rows(None, "built-in", reps, tokens)
                        + tp_rows(str(small), "141M random", reps, tokens))
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
