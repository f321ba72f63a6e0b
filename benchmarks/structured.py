"""Structured outputs: what the grammar mask costs a decode step, and what a grammar costs to
compile.

Built-in model, batches of 1 / 16 / 64 requests decoding 64 tokens each, greedy; side ``off``:
unconstrained; side ``on``: every request constrained by a grammar that never ends early
(``regex`` ``[a-z ]{300}``: the batch keeps its size) -- decode tok/s and the step time, medians
of ``--repeats`` alternating runs. Then llguidance compile time (a new matcher of a new grammar)
for JSON schemas of growing size. States the CPU; writes JSON.

    python benchmarks/structured.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pagedhybrid.engine import SamplingParams, load_engine
from pagedhybrid.engine.structured import StructuredOutputs
from pagedhybrid.kernels.native import cpu_form

PROMPT = "And the LORD said unto Moses,"


def decode_rate(engine, batch: int, params: SamplingParams) -> tuple[float, float]:
    """(decode tok/s, median step ms) of ``batch`` requests after their first token."""
    for i in range(batch):
        engine.add_request(f"r{engine.stats.steps}-{i}", PROMPT, params)
    steps: list[float] = []
    tokens = 0
    started = False
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if started:
            steps.append(dt)
            tokens += sum(len(o.new_token_ids) for o in outs)
        started = started or (all(o.num_generated for o in outs) and len(outs) == batch)
    return tokens / max(sum(steps), 1e-9), 1e3 * statistics.median(steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/structured.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    engine = load_engine(None, num_blocks=1024, max_num_seqs=64)
    sides = {"off": SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
             "on": SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                  structured_outputs={"regex": "[a-z ]{300}"})}
    rows = []
    for batch in args.batches:
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
        for _ in range(args.repeats):
            for side, params in sides.items():
                runs[side].append(decode_rate(engine, batch, params))
        row = {"batch": batch}
        for side, rs in runs.items():
            row[f"{side}_tok_s"] = statistics.median(r[0] for r in rs)
            row[f"{side}_step_ms"] = statistics.median(r[1] for r in rs)
        row["slowdown"] = 1 - row["on_tok_s"] / row["off_tok_s"]  # the mask's share
        rows.append(row)
        print(json.dumps(row), flush=True)
    grammars = engine._grammars("bench")
    compile_ms = []
    for n in (2, 8, 32):
        schema = {"type": "object", "required": [f"k{i}" for i in range(n)],
                  "properties": {f"k{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                 for i in range(n)}}
        t0 = time.perf_counter()
        grammars.matcher(StructuredOutputs(json=schema))
        compile_ms.append({"properties": n, "ms": 1e3 * (time.perf_counter() - t0)})
    print(json.dumps(compile_ms))
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = {"cpu": cpu, "cpu_form": cpu_form(), "threads": 2, "rows": rows,
           "compile": compile_ms}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
