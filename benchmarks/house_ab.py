"""Before / after a refactor: the engine's speed on this checkout against a baseline revision.

The gate of issue 52 (the house): a change of structure must keep today's speed -- decode at
batch 1 (tg128), batch-16 decode, the offline inter-token latency at batch 1 and start-up (load
-> first token). Both trees run the same child script (``--child``, through the public API both
have: ``pagedhybrid.engine.load_engine`` and ``SamplingParams``), one process at a time,
alternating baseline, current, baseline, current ... for ``--reps`` rounds, on the 141M random
hybrid of ``benchmarks/engine.py`` (``latency.write_small_model``) in fp32 and bf16 and on the
built-in model in bf16, 2 threads. Each figure is the median over rounds; the ratio is current /
baseline (for start-up and ITL, baseline / current: above 1 is faster). More than 3% slower on
any is a regression (``--gate``, the exit status).

The baseline is a git worktree of ``--baseline-rev`` (``latency.ensure_baseline``); when its
native sources equal this checkout's, this checkout's built kernels are copied in instead of
built again.

    python benchmarks/house_ab.py --baseline-rev 07f3fe4 [--reps 5] [--models builtin:bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NATIVE = Path("src/pagedhybrid/kernels/native")
MODELS = (("small", "float32"), ("small", "bfloat16"), ("builtin", "bfloat16"))


def child(model_dir: str, dtype: str, vocab: int) -> dict[str, float]:
    """One round in this process: start-up, tg128, ITL at batch 1, batch-16 decode."""
    t0 = time.perf_counter()
    from pagedhybrid.engine import SamplingParams, load_engine

    engine = load_engine(model_dir, dtype=dtype, enable_prefix_caching=False, max_num_seqs=16,
                         max_num_batched_tokens=512, num_blocks=512)
    engine.add_request("warm", [11, 12, 13, 14], SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    startup = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int) -> list[list[float]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        stamps: dict[str, list[float]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}-{time.perf_counter()}", p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps.setdefault(out.request_id, []).extend(
                    [time.perf_counter()] * len(out.new_token_ids))
        return list(stamps.values())

    def prompt(n: int, seed: int) -> list[int]:
        return [10 + (seed * 7919 + 104729 * j) % (vocab - 10) for j in range(n)]

    run([prompt(16, 1)], 8)  # warm-up
    (st,) = run([prompt(16, 2)], 128)
    gaps = [b - a for a, b in itertools.pairwise(st)]
    sts = run([prompt(128, 3 + i) for i in range(16)], 128)
    start, end = max(s[0] for s in sts), max(s[-1] for s in sts)
    return {"startup_s": startup, "tg128": (len(st) - 1) / (st[-1] - st[0]),
            "itl_ms": 1e3 * statistics.median(gaps),
            "b16": sum(sum(t > start for t in s) for s in sts) / (end - start)}


def measure(src: Path, model_dir: Path, dtype: str, vocab: int, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, __file__, "--child", str(model_dir), dtype, str(vocab)],
                       env=env, capture_output=True, text=True, check=False, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"child failed ({src}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def baseline_tree(rev: str, path: Path) -> tuple[Path, bool]:
    """The baseline's src (a worktree of ``rev`` at ``path``, its native kernels built or, when
    its native sources are this checkout's, copied); whether this run created it."""
    sys.path.insert(0, str(HERE))
    import latency

    fresh = not path.exists()
    if fresh:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
    same = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", rev, "--",
                           str(NATIVE / "csrc")], check=False).returncode == 0
    if same and (REPO / NATIVE / "_build").is_dir():
        shutil.copytree(REPO / NATIVE / "_build", path / NATIVE / "_build", dirs_exist_ok=True)
    src, _ = latency.ensure_baseline(argparse.Namespace(baseline=str(path), baseline_rev=rev))
    assert src is not None
    return src, fresh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", required=True)
    ap.add_argument("--baseline", default="/tmp/house-baseline")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gate", type=float, default=0.03)
    ap.add_argument("--models", nargs="+", default=[f"{m}:{d}" for m, d in MODELS],
                    help="model:dtype pairs (default: all three)")
    ap.add_argument("--out", default=str(HERE / "results" / "house_ab.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import latency
    from pagedhybrid.kernels.native import cpu_form
    from pagedhybrid.models.qwen35 import default_model_dir

    base_src, fresh = baseline_tree(a.baseline_rev, Path(a.baseline))
    trees = {"baseline": base_src, "current": REPO / "src"}
    report: dict[str, Any] = {"baseline_rev": a.baseline_rev, "cpu_form": cpu_form(),
                              "threads": a.threads, "reps": a.reps, "rows": []}
    worst = 1.0
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        latency.write_small_model(small, default_model_dir(), seed=0)
        dirs = {"small": (small, 32000), "builtin": (default_model_dir(), 4096)}
        for name, dtype in (m.split(":") for m in a.models):
            folder, vocab = dirs[name]
            runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
            for _ in range(a.reps):  # alternating, one process at a time
                for side in ("baseline", "current"):
                    runs[side].append(measure(trees[side], folder, dtype, vocab, a.threads))
            row: dict[str, Any] = {"model": name, "dtype": dtype}
            for key in ("tg128", "b16", "itl_ms", "startup_s"):
                b = statistics.median(r[key] for r in runs["baseline"])
                c = statistics.median(r[key] for r in runs["current"])
                ratio = c / b if key in ("tg128", "b16") else b / c  # > 1: current faster
                row[key] = {"baseline": b, "current": c, "ratio": ratio}
                worst = min(worst, ratio)
            report["rows"].append(row)
            print(f"{name:8s} {dtype:9s} " + "  ".join(
                f"{k} {row[k]['baseline']:.3g} -> {row[k]['current']:.3g} "
                f"({row[k]['ratio']:.3f}x)" for k in ("tg128", "b16", "itl_ms", "startup_s")),
                flush=True)
    if fresh:
        latency.remove_baseline(Path(a.baseline))
    report["worst_ratio"] = worst
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"worst ratio {worst:.3f} (gate: {1 - a.gate:.2f}); CPU form {cpu_form()}; "
          f"wrote {a.out}")
    return 0 if worst >= 1 - a.gate else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        raise SystemExit(main())
