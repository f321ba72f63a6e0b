"""Concurrent sequences at a fixed cache memory budget: bf16 vs int8 vs fp8 KV pages, one run.

The built-in model in bf16 (its shipped calibrated per-channel scales for the quantized pages)
serves ``--requests`` requests queued at once: held-out passages of ``--prompt`` tokens, each
generating ``--tokens`` greedy tokens (EOS ignored). The engine gets the same
``cache_memory_bytes`` in every run -- ``--slots`` state slots (no prefix caching, so no
checkpoint rows) plus ``--page-mib`` MiB of KV pages at bf16 size -- and admits as many
sequences as their pages allow (``max_num_seqs`` = ``--slots``). Reported per page type: KV
pages in the budget, the peak number of running sequences, preemptions, generated tokens/s and
the ratios to bf16. Greedy agreement with the bf16 run is printed too.

    python benchmarks/kv_capacity.py [--requests 128] [--prompt 512] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pagedhybrid.engine import SamplingParams, load_engine
from pagedhybrid.engine.core.config import slot_bytes
from pagedhybrid.models.qwen35 import Qwen35Config, default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.default_model import heldout_text_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--page-mib", type=float, default=16.0)
    ap.add_argument("--out", default="benchmarks/results/kv_capacity.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = default_model_dir()
    cfg = Qwen35Config.from_model_dir(model_dir)
    ids = load_tokenizer(model_dir).encode(heldout_text_path().read_text(encoding="utf-8"))
    rng = random.Random(0)
    prompts = []
    for _ in range(a.requests):
        s = rng.randrange(0, len(ids) - a.prompt)
        prompts.append(ids[s:s + a.prompt])
    budget = int(a.slots * slot_bytes(cfg, torch.bfloat16) + a.page_mib * 2**20)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    rows: dict[str, dict[str, float]] = {}
    outs: dict[str, list[list[int]]] = {}
    for name in ("auto", "int8", "fp8"):
        engine = load_engine(None, dtype="bfloat16", cache_memory_bytes=budget,
                             num_state_slots=a.slots, max_num_seqs=a.slots,
                             max_num_batched_tokens=2048, enable_prefix_caching=False,
                             kv_cache_dtype=name, max_model_len=a.prompt + a.tokens)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        t0 = time.perf_counter()
        done = {o.request_id: list(o.token_ids) for o in engine.stream() if o.finished}
        secs = time.perf_counter() - t0
        outs[name] = [done[str(i)] for i in range(a.requests)]
        st = engine.stats
        rows[name] = {"pages": engine.sizes.num_blocks, "peak_running": st.peak_running,
                      "preemptions": st.preemptions, "seconds": secs,
                      "generated_tok_s": st.generated_tokens / secs}
    base = rows["auto"]
    for name, row in rows.items():
        row["x_concurrency"] = row["peak_running"] / base["peak_running"]
        row["x_throughput"] = row["generated_tok_s"] / base["generated_tok_s"]
        same = sum(x == y for a_, b_ in zip(outs["auto"], outs[name], strict=True)
                   for x, y in zip(a_, b_, strict=True))
        row["token_agreement_vs_bf16"] = same / sum(len(x) for x in outs["auto"])
        label = "bf16" if name == "auto" else name
        print(f"{label:5s}: {row['pages']:5d} pages, peak {row['peak_running']:4.0f} running "
              f"({row['x_concurrency']:.2f}x), {row['preemptions']:.0f} preemptions, "
              f"{row['generated_tok_s']:7.1f} gen tok/s ({row['x_throughput']:.2f}x), "
              f"positionwise agreement {100 * row['token_agreement_vs_bf16']:.1f}%", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"budget_bytes": budget, "args": vars(a), "rows": rows},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
