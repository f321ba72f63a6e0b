"""Prefix caching for the hybrid model: TTFT and throughput with and without, in one run.

Model: the "small" random Qwen3.5-shaped hybrid of ``benchmarks/engine.py`` (141M parameters,
8 layers = 6 Gated DeltaNet + 2 full attention, hidden 1024), fp32, 2 threads; the same engine
configuration on both sides except ``enable_prefix_caching`` (checkpoint interval 64, block 16).

Workloads (random token ids, greedy, EOS ignored):

* ``shared_system_prompt`` -- a 1024-token system prompt + 32 user turns of 20-60 tokens, 16
  output tokens each, arriving as a stream (request i is added at engine step 2i);
* ``multi_turn`` -- 8 conversations of 4 turns: each turn's prompt is the previous prompt, its
  answer (32 tokens) and a new 30-token user message; the 8 conversations advance in rounds;
* ``ttft_90pct`` -- one 1000-token prompt whose first 900 tokens (a multiple of the interval)
  were served before, alone: TTFT with the hit vs without caching;
* ``short_prompts`` -- two 100-token prompts sharing their first 64 tokens: the second hits 64
  (vLLM's align mode needs one whole state block per hit and cannot).

Reported per workload and side: TTFT median / p90 (add_request -> first token), total seconds
and tokens/s, hit rate, cached-token fraction; the checkpoint pool's memory. Writes JSON.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import small_config
from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.models.qwen35 import load
from pagedhybrid.models.qwen35.synthetic import random_weights, write_checkpoint


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run_stream(engine: Engine, arrivals: list[tuple[int, list[int], int]]
               ) -> tuple[list[float], float, dict[str, list[int]]]:
    """Requests (arrival step, prompt, max tokens); returns TTFTs, seconds, outputs."""
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    queue = sorted(arrivals, key=lambda a: a[0])
    step, start, k = 0, time.perf_counter(), 0
    while queue or engine.has_unfinished_requests():
        while queue and queue[0][0] <= step:
            _, prompt, n = queue.pop(0)
            rid = f"r{k}"
            k += 1
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                           ignore_eos=True))
            added[rid] = time.perf_counter()
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter()
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
        step += 1
    seconds = time.perf_counter() - start
    return [first[r] - added[r] for r in added], seconds, outs


def summary(ttft: list[float], seconds: float, engine: Engine, n_tokens: int
            ) -> dict[str, float]:
    q = sorted(ttft)
    st = engine.prefix_cache_stats()
    return {"ttft_median_s": statistics.median(q), "ttft_p90_s": q[int(0.9 * (len(q) - 1))],
            "seconds": seconds, "tokens_per_s": n_tokens / seconds,
            "hit_rate": st["hit_rate"], "cached_token_fraction": st["cached_token_fraction"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    cfg = small_config()
    vocab = cfg.vocab_size
    rows: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="ph-prefix-") as tmp:
        write_checkpoint(Path(tmp), cfg, random_weights(cfg, seed=0))
        model = load(tmp, dtype=torch.float32)

        def engine(caching: bool) -> Engine:
            e = Engine(model, EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=16,
                                           max_num_batched_tokens=2048,
                                           enable_prefix_caching=caching,
                                           state_checkpoint_interval=64,
                                           num_state_checkpoints=64))
            e.add_request("warm", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
            list(e.stream())
            e.scheduler.alloc.stats = type(e.scheduler.alloc.stats)()
            return e

        rng = random.Random(0)
        system = tokens(rng, 1024, vocab)
        shared = [(2 * i, system + tokens(rng, rng.randint(20, 60), vocab), 16)
                  for i in range(32)]
        convs = [tokens(rng, rng.randint(40, 120), vocab) for _ in range(8)]
        turns = [[tokens(rng, 30, vocab) for _ in range(4)] for _ in range(8)]
        long_prompt = tokens(rng, 1000, vocab)
        p1 = tokens(rng, 64, vocab)
        short = [p1 + tokens(rng, 36, vocab), p1 + tokens(rng, 36, vocab)]
        for caching in (False, True):
            side = "cache" if caching else "no_cache"
            e = engine(caching)
            ttft, secs, _ = run_stream(e, shared)
            n = sum(len(p) + m for _, p, m in shared)
            rows.setdefault("shared_system_prompt", {})[side] = summary(ttft, secs, e, n)
            e = engine(caching)
            prompts = list(convs)
            all_ttft, total_s, n = [], 0.0, 0
            for t in range(4):
                ttft, secs, outs = run_stream(e, [(0, p, 32) for p in prompts])
                all_ttft += ttft
                total_s += secs
                n += sum(len(p) + 32 for p in prompts)
                prompts = [p + outs[f"r{i}"] + turns[i][t] for i, p in enumerate(prompts)]
            rows.setdefault("multi_turn", {})[side] = summary(all_ttft, total_s, e, n)
            e = engine(caching)
            run_stream(e, [(0, long_prompt[:900] + tokens(rng, 50, vocab), 1)])
            ttft, secs, _ = run_stream(e, [(0, long_prompt, 1)])
            rows.setdefault("ttft_90pct", {})[side] = {
                "ttft_s": ttft[0], "hit_tokens": e.prefix_cache_stats()["hit_tokens"]}
            e = engine(caching)
            run_stream(e, [(0, short[0], 4)])
            run_stream(e, [(0, short[1], 4)])
            rows.setdefault("short_prompts", {})[side] = {
                "hit_tokens_second": e.prefix_cache_stats()["hit_tokens"]}
            if caching:
                rows["checkpoint_memory_bytes"] = {"cache": e.prefix_cache_stats()[
                    "checkpoint_bytes"]}
    for name in ("shared_system_prompt", "multi_turn"):
        off, on = rows[name]["no_cache"], rows[name]["cache"]
        print(f"{name:22s} TTFT median {off['ttft_median_s']:.3f} -> {on['ttft_median_s']:.3f} s"
              f" (p90 {off['ttft_p90_s']:.3f} -> {on['ttft_p90_s']:.3f}), total "
              f"{off['seconds']:.1f} -> {on['seconds']:.1f} s = "
              f"{off['seconds'] / on['seconds']:.2f}x faster, hit rate {on['hit_rate']:.2f}, "
              f"cached tokens {100 * on['cached_token_fraction']:.0f}%")
    t90 = rows["ttft_90pct"]
    print(f"ttft_90pct             {t90['no_cache']['ttft_s']:.3f} -> {t90['cache']['ttft_s']:.3f}"
          f" s = {t90['cache']['ttft_s'] / t90['no_cache']['ttft_s']:.2f}x "
          f"(hit {t90['cache']['hit_tokens']} tokens)")
    print(f"short_prompts          second prompt hit "
          f"{rows['short_prompts']['cache']['hit_tokens_second']} of 100 tokens")
    print(f"checkpoint pool        {rows['checkpoint_memory_bytes']['cache'] / 2**20:.1f} MiB")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
