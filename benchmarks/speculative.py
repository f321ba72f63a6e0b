"""Speculative decoding: decode speed, inter-token latency and acceptance, with and without.

Models: the built-in model (``builtin``: 8 layers, hidden 256, bf16 as shipped, with its trained
MTP head) and the 141M random hybrid of ``benchmarks/engine.py`` (``small``, fp32). Drafters
(``--methods``): n-gram prompt lookup (``{"method": "ngram", "num_speculative_tokens": K}``) and
the checkpoint's MTP head (``"mtp"``; only where the checkpoint has one: random weights give no
useful MTP acceptance). Workloads:

* ``repetitive`` -- an edit-style request: a passage of held-out text, then the instruction to
  write it out again and its first line (the built-in model's tokenizer; the small model reads
  the same ids), 128 tokens generated: the answer can reuse the prompt and the model's own
  repetitions;
* ``natural`` -- a plain held-out passage to continue, 128 tokens: drafts rarely match.

For each model, workload, batch size (1 / 4 / 16 copies of the request, different passages),
temperature (0 and 0.7, seeded) and side (speculation off / each method, in alternation,
``--repeats`` times): decode tok/s (tokens after each request's first, over the time from the
last first token to the end), the median inter-token latency per request, and for the method
sides the acceptance rate per draft position (accepted drafts at position ``j`` over verify
chunks); speedups as the ratio of the medians and as the median of each repeat's own ratio
(``speedup_paired``: every repeat runs each side in turn, so the machine's drift cancels).
The engine's default keeps only the drafts its step-time model says pay for their rows
(``DraftBudget``); ``--force-16`` also measures batch 16 with every draft verified (``adaptive:
false``) and with a second engine without speculation (``off_control``: what the same
comparison gives between two equal engines on this machine, the noise floor). Reports the
capsule memory per state slot against per-token copies of the recurrent state. Medians of the
repeats; writes JSON.

    python benchmarks/speculative.py [--models builtin small] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedhybrid.engine import Engine, SamplingParams, load_engine
from pagedhybrid.kernels.capsule import capsule_bytes, full_state_bytes
from pagedhybrid.kernels.native import cpu_form
from pagedhybrid.models.qwen35 import Qwen35Config, default_model_dir
from pagedhybrid.models.qwen35.default_model import heldout_text_path

MAX_TOKENS = 128


def passages(n: int, seed: int) -> list[str]:
    lines = [x for x in heldout_text_path().read_text(encoding="utf-8").splitlines() if x.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randrange(0, len(lines) - 6)
        out.append("\n".join(lines[s:s + 5]))
    return out


def prompts(workload: str, n: int, seed: int) -> list[str]:
    if workload == "natural":
        return passages(n, seed)
    return [f"{p}\n\nWrite that out again:\n{p.splitlines()[0]}\n" for p in passages(n, seed)]


def measure(engine: Engine, texts: list[str], params: list[SamplingParams]) -> dict[str, float]:
    """One batch run: decode tok/s, median ITL (ms), acceptance figures."""
    before = engine.stats.spec
    d0, t0a, a0 = before.drafts, before.draft_tokens, before.accepted_tokens
    pos0 = list(before.accepted_per_pos)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    start = time.perf_counter()
    for i, (t, p) in enumerate(zip(texts, params, strict=True)):
        engine.add_request(f"q{engine.stats.steps}-{i}", t, p)
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = o.num_generated
    end = time.perf_counter()
    decode_from = max(first.values())
    after = sum(max(0, c - 1) for c in count.values())  # tokens after each one's first
    itl = [(last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1]
    st = engine.stats.spec
    pos = [a - (pos0[i] if i < len(pos0) else 0) for i, a in enumerate(st.accepted_per_pos)]
    drafts = st.drafts - d0
    return {"decode_tok_s": after / max(end - decode_from, 1e-9) if end > decode_from else
            after / (end - start), "itl_ms": 1e3 * statistics.median(itl) if itl else 0.0,
            "wall_s": end - start, "generated": sum(count.values()),
            "drafts": drafts, "draft_tokens": st.draft_tokens - t0a,
            "accepted": st.accepted_tokens - a0,
            "accept_per_pos": [round(a / drafts, 3) if drafts else 0.0 for a in pos]}


def small_model(folder: Path) -> Path:
    from latency import write_small_model

    write_small_model(folder, default_model_dir(), seed=0)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["builtin", "small"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "natural"])
    ap.add_argument("--methods", nargs="+", default=["ngram", "mtp"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force-16", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    tmp = Path(tempfile.mkdtemp())
    memory = {}
    for name in args.models:
        folder = default_model_dir() if name == "builtin" else small_model(tmp / name)
        dtype = "auto" if name == "builtin" else "float32"
        has_head = Qwen35Config.from_model_dir(folder).mtp_num_hidden_layers == 1
        methods = [m for m in args.methods if m != "mtp" or has_head]
        sides = {"off": load_engine(folder, dtype=dtype, max_num_seqs=16, num_blocks=512)}
        for m in methods:
            spec = {"method": m, "num_speculative_tokens": args.k}
            sides[m] = load_engine(folder, dtype=dtype, max_num_seqs=16, num_blocks=512,
                                   speculative_config=spec)
            if args.force_16:
                sides[f"{m}_forced"] = load_engine(
                    folder, dtype=dtype, max_num_seqs=16, num_blocks=512,
                    speculative_config={**spec, "adaptive": False})
        if args.force_16:  # a second engine without drafts: the noise floor of a ratio
            sides["off_control"] = load_engine(folder, dtype=dtype, max_num_seqs=16,
                                               num_blocks=512)
        cfg = sides["off"].model.config
        memory[name] = {"capsule_bytes_per_slot": capsule_bytes(cfg, args.k + 1,
                                                                 sides["off"].model.dtype),
                        "full_state_copies_bytes_per_slot": full_state_bytes(cfg, args.k + 1)}
        for workload in args.workloads:
            for batch in args.batches:
                texts = prompts(workload, batch, seed=batch)
                for temp in args.temperatures:
                    params = [SamplingParams(temperature=temp, max_tokens=MAX_TOKENS,
                                             ignore_eos=True, seed=i if temp else None)
                              for i in range(batch)]
                    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
                    for _ in range(args.repeats):
                        for side, engine in sides.items():
                            if side.endswith(("_forced", "_control")) and batch < 16:
                                continue
                            runs[side].append(measure(engine, texts, params))
                    for side, rs in runs.items():
                        if not rs:
                            continue
                        row = {"model": name, "workload": workload, "batch": batch,
                               "temperature": temp, "side": side,
                               "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                               "itl_ms": statistics.median(r["itl_ms"] for r in rs),
                               "runs_tok_s": [round(r["decode_tok_s"], 1) for r in rs],
                               "drafts": rs[-1]["drafts"], "accepted": rs[-1]["accepted"],
                               "draft_tokens": rs[-1]["draft_tokens"],
                               "accept_per_pos": rs[-1]["accept_per_pos"]}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    for r in rows:
        if r["side"] != "off":
            base = next(b for b in rows if b["side"] == "off" and all(
                b[k] == r[k] for k in ("model", "workload", "batch", "temperature")))
            r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            # each repeat runs every side in turn: the median of the repeats' own ratios
            # (the machine's drift between repeats cancels)
            r["speedup_paired"] = statistics.median(
                a / b for a, b in zip(r["runs_tok_s"], base["runs_tok_s"], strict=True))
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = {"cpu": cpu, "cpu_form": cpu_form(), "threads": 2, "k": args.k,
           "max_tokens": MAX_TOKENS, "memory": memory, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\nmodel     workload    batch temp  off tok/s  on tok/s  speedup  paired  "
          "accept/pos side")
    for r in rows:
        if r["side"] == "off":
            continue
        base = r["decode_tok_s"] / r["speedup"]
        print(f"{r['model']:9} {r['workload']:11} {r['batch']:5} {r['temperature']:4} "
              f"{base:9.1f} {r['decode_tok_s']:9.1f} {r['speedup']:7.2f}x "
              f"{r['speedup_paired']:6.2f}x  "
              f"{r['accept_per_pos']} {r['side']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
