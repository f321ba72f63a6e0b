"""Issue 52's second route, measured: the model's modules compiled (torch.compile, inductor's C++
wrapper on CPU) against the whole-step native call the runner's graph executor makes.

"One definition of each layer" had two routes to weigh: bind a hand-written C++ layer from a
layer specification (taken: ``kernels/layer_spec.py``), or compile the same modules with the
native kernels as custom ops. This script runs one engine on the 141M random hybrid of
``benchmarks/engine.py`` (``latency.write_small_model``), 2 threads, batch-1 greedy decode of 128
tokens, with the runner's eager executor replaced in turn by:

* ``graph`` -- the runner's own choice: the whole decode step in one native call (``DecodeStack``);
* ``eager`` -- the model's modules op by op, the native bundle's kernels in them;
* ``compiled`` -- the same modules through ``torch.compile`` (``dynamic=True``), the native
  bundle's kernels as the custom ops they are (``torch.ops.pagedhybrid``).

For each: decode tokens/s (median of ``--reps`` runs after one warm-up run), the first run's
seconds (compilation included) and dynamo's counters (graphs compiled, graph breaks, recompiles
by guard failure). Writes ``benchmarks/results/compile_route.json``.

    python benchmarks/compile_route.py [--dtype bfloat16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


class _Compiled:
    """An eager executor whose forward is the compiled one."""

    name = "eager"

    def __init__(self, model: Any) -> None:
        self.forward = torch.compile(model.forward_packed, dynamic=True)

    def why_not(self, meta: Any, num_logits: int) -> str | None:
        return None

    def __call__(self, batch: Any, cache: Any, rows: Any, meta: Any, hidden: Any) -> Any:
        return self.forward(batch, cache, rows, meta, hidden)


def _decode(engine: Any, vocab: int, n: int, seed: int) -> float:
    """Seconds per generated token of one batch-1 greedy request of ``n`` tokens (after the
    first token: decode steps only)."""
    from pagedhybrid.engine import SamplingParams

    prompt = [10 + (seed * 7919 + 104729 * j) % (vocab - 10) for j in range(16)]
    engine.add_request(f"r{seed}", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                          ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run(mode: str, folder: Path, dtype: str, vocab: int, reps: int) -> dict[str, Any]:
    import torch._dynamo

    from pagedhybrid.engine import load_engine

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = load_engine(str(folder), dtype=dtype, enable_prefix_caching=False, max_num_seqs=4,
                         max_num_batched_tokens=256, num_blocks=128)
    _decode(engine, vocab, 2, 0)  # the cache allocated, the executors bound
    ex = engine.runner.executors
    if mode != "graph":
        ex.graph = ex.layers = None
    if mode == "compiled":
        ex.eager = _Compiled(engine.runner.model)
    t0 = time.perf_counter()
    _decode(engine, vocab, 128, 1)
    first = time.perf_counter() - t0
    per_token = [_decode(engine, vocab, 128, 2 + i) for i in range(reps)]
    c = torch._dynamo.utils.counters
    return {"mode": mode, "tokens_per_s": 1.0 / statistics.median(per_token),
            "first_run_s": first, "steps": dict(ex.steps),
            "graphs": int(c["stats"]["unique_graphs"]),
            "graph_breaks": sum(c["graph_break"].values()),
            "break_reasons": dict(Counter({k[:160]: v for k, v in c["graph_break"].items()})
                                  .most_common(5)),
            "recompiles": int(c["recompiles"].get("total", 0)) if "recompiles" in c else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["graph", "eager", "compiled"])
    ap.add_argument("--out", default=str(HERE / "results" / "compile_route.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    sys.path.insert(0, str(HERE))
    import latency
    from pagedhybrid.kernels.native import cpu_form
    from pagedhybrid.models.qwen35 import default_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        latency.write_small_model(small, default_model_dir(), seed=0)
        for mode in a.modes:
            try:
                rows.append(run(mode, small, a.dtype, 32000, a.reps))
            except Exception as exc:  # a route that does not run is a result too
                rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(json.dumps(rows[-1]), flush=True)
    report = {"cpu_form": cpu_form(), "dtype": a.dtype, "threads": 2, "torch": torch.__version__,
              "rows": rows}
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'mode':<10} {'tok/s':>8} {'first run s':>12}  graphs / breaks")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<10} failed: {r['error'][:200]}")
        else:
            print(f"{r['mode']:<10} {r['tokens_per_s']:8.1f} {r['first_run_s']:12.1f}  "
                  f"{r['graphs']} / {r['graph_breaks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
