"""Per-rank body of the gloo TP test: the packed (and dense) Qwen3.5 forward, TP rank vs TP=1.

Every rank loads the same randomised checkpoint twice: whole (the TP=1 reference) and as its TP
rank (``load(path, parallel=ParallelConfig(rank, world))``: each parameter's weight loader keeps
the rank's slice of the file), and runs a packed prefill of three sequences followed by a packed
decode step (pages and state slots updated in place), plus a dense forward. It returns its logits
and the TP=1 logits, for each checkpoint it is given (``tiny_byte_config`` and a variant with one
KV head and one linear key head, replicated on both ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, build, load
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config
from pagedhybrid.parallel import ParallelConfig

BLOCK = 16
PROMPTS = ([5, 9, 200, 31, 7, 7, 64, 12, 3, 99, 150, 18, 4, 4, 4, 80, 81, 82, 11, 1],
           [17, 18, 19, 20, 21, 22, 23],
           [250, *range(40, 72)])


def _steps(model: Any) -> dict[str, torch.Tensor]:
    cfg = model.config
    tables = [[3 * b, 3 * b + 1, 3 * b + 2] for b in range(3)]
    cache = PagedHybridCache.allocate(cfg, num_pages=9, block_size=BLOCK, num_slots=3)
    prefill = PackedBatch.from_sequences(PROMPTS, [0, 0, 0], tables, [0, 1, 2])
    out = {"prefill": model.forward_packed(prefill, cache)}  # [N, V]
    decode = PackedBatch.from_sequences([[42], [43], [44]], [len(p) for p in PROMPTS], tables,
                                        [0, 1, 2])
    out["decode"] = model.forward_packed(decode, cache)  # [3, V]
    ids = torch.tensor([PROMPTS[1], PROMPTS[0][:7]], dtype=torch.int64)
    out["dense"] = model.forward_dense(ids)[0]  # [2, 7, V]
    return out


def tp_worker(rank: int, world: int, checkpoints: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in checkpoints.items():
        full = load(path)
        local = load(path, parallel=ParallelConfig(tp_rank=rank, tp_world_size=world))
        cfg = full.config
        assert local.config.num_attention_heads == cfg.num_attention_heads // world
        assert local.config.num_key_value_heads == max(1, cfg.num_key_value_heads // world)
        out[name] = {"tp": _steps(local), "tp1": _steps(full)}
    return out


def tp_rollout_worker(rank: int, world: int) -> dict[str, Any]:
    """TP=2 rollout (the engine, batched, chunked prefill) vs TP=2 recompute (``Engine.score``),
    in the batch-invariant mode and the default mode."""
    from pagedhybrid.engine import Engine, EngineConfig, SamplingParams

    cfg = tiny_byte_config()
    local = build(cfg, torch.float32, "cpu",
                  parallel=ParallelConfig(tp_rank=rank, tp_world_size=world))
    local.load_weights(random_weights(cfg, seed=7))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    out: dict[str, Any] = {}
    for invariant in (True, False):
        engine = Engine(local, EngineConfig(batch_invariant=invariant, num_blocks=32,
                                            max_num_batched_tokens=24))
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), list(p), params)
        done = {o.request_id: o for o in engine.stream() if o.finished}
        got = [done[str(i)] for i in range(len(PROMPTS))]
        rollout = [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids, strict=True)]
                   for o in got]
        scored = engine.score([list(p) for p in PROMPTS], [list(o.token_ids) for o in got])
        out["invariant" if invariant else "default"] = {
            "rollout": rollout, "score": scored, "backend": engine.kernels.backend.name}
    return out
