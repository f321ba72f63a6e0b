"""Greedy agreement and perplexity of engine configurations against a baseline, one run.

Prompts: ``--prompts`` windows of 16-48 tokens cut at random places from the built-in model's
held-out text; each request generates ``--tokens`` greedy tokens (EOS ignored). The first of
``--configs`` is the baseline. Configurations: ``fp32``; ``bf16`` (bf16 weights, activations and
KV pages with fp32 recurrent state and logits); ``bf16-int8-pc`` / ``bf16-int8-pt`` /
``bf16-fp8-pc`` / ``bf16-fp8-pt``: the bf16 model with int8 / fp8 (e4m3) KV pages and
per-channel / per-tensor scales (the built-in model's calibrated scale files). For each we
report:

* token agreement -- the fraction of generated positions equal to the baseline's, counting a
  sequence's positions up to its first divergence as agreeing and every later one as not (so one
  early flip costs the rest of the sequence);
* exact sequences -- the fraction of requests whose whole output equals the baseline's;
* first divergence -- the median position of the first differing token among diverging ones;
* held-out perplexity (``pagedhybrid.perplexity``: windows of 512 every 256) and its relative
  difference to the baseline.

    python benchmarks/quality.py [--prompts 64] [--tokens 64]          # fp32 vs bf16
    python benchmarks/quality.py --configs bf16 bf16-int8-pc bf16-int8-pt bf16-fp8-pc \
        bf16-fp8-pt --out benchmarks/results/quality_kv.json            # quantized KV pages
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from pagedhybrid.engine import SamplingParams, load_engine
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.default_model import heldout_text_path
from pagedhybrid.perplexity import engine_perplexity

CONFIGS: dict[str, dict[str, object]] = {
    "fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
    **{f"bf16-{d}-{q}": {"dtype": "bfloat16", "kv_cache_dtype": d,
                         "kv_quant": "per-channel" if q == "pc" else "per-tensor"}
       for d in ("int8", "fp8") for q in ("pc", "pt")}}


def greedy(engine_kw: dict[str, object], prompts: list[list[int]], tokens: int
           ) -> list[list[int]]:
    engine = load_engine(None, **engine_kw)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {o.request_id: list(o.token_ids) for o in engine.stream() if o.finished}
    return [done[str(i)] for i in range(len(prompts))]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    agree, exact, firsts = 0, 0, []
    for a, b in zip(base, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree += first
        exact += first == len(a)
        if first < len(a):
            firsts.append(first)
    total = sum(len(a) for a in base)
    return {"token_agreement": agree / total, "exact_sequences": exact / len(base),
            "median_first_divergence": statistics.median(firsts) if firsts else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["fp32", "bf16"])
    ap.add_argument("--out", default="benchmarks/results/quality.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok = load_tokenizer(default_model_dir())
    text_ids = tok.encode(heldout_text_path().read_text(encoding="utf-8"))
    rng = random.Random(0)
    prompts = []
    for _ in range(a.prompts):
        n = rng.randint(16, 48)
        s = rng.randrange(1, len(text_ids) - n)
        prompts.append(text_ids[s:s + n])
    rows: dict[str, dict[str, object]] = {}
    base = None
    base_ppl = None
    for name in a.configs:
        kw = CONFIGS[name]
        outs = greedy(kw, prompts, a.tokens)
        ppl = engine_perplexity(load_engine(None, max_model_len=513, **kw),  # type: ignore[arg-type]
                                text_ids, 512, 256).perplexity
        if base is None:
            base, base_ppl = outs, ppl
        row: dict[str, object] = {"perplexity": ppl, "ppl_rel_vs_base": ppl / base_ppl - 1}
        row.update(agreement(base, outs))
        rows[name] = row
        print(f"{name:12s} ppl {ppl:.4f} ({row['ppl_rel_vs_base']:+.2e})  token agreement "
              f"{100 * row['token_agreement']:.1f}%  exact {100 * row['exact_sequences']:.0f}%"
              f"  first divergence {row['median_first_divergence']}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": a.prompts, "tokens": a.tokens,
                               "base": a.configs[0], "rows": rows},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
