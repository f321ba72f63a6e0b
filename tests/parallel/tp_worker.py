"""Per-rank body of the gloo TP test: the packed (and dense) Qwen3.5 forward, TP shard vs TP=1.

Every rank loads the same randomised default-shaped model, keeps the full model as the TP=1
reference and its TP shard (``tensor_parallel_qwen35``), and runs a packed prefill of three
sequences followed by a packed decode step (pages and state slots updated in place), plus a
dense forward. It returns its logits and the TP=1 logits.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, build
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config
from pagedhybrid.parallel.tensor_parallel import attention_sharding, tensor_parallel_qwen35

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


def tp_worker(rank: int, world: int) -> dict[str, Any]:
    cfg = tiny_byte_config()
    full = build(cfg, torch.float32, "cpu")
    full.load_weights(random_weights(cfg, seed=7))
    local = tensor_parallel_qwen35(full, sharding=attention_sharding(cfg, rank, world))
    assert local.config.num_attention_heads == cfg.num_attention_heads // world
    return {"tp": _steps(local), "tp1": _steps(full)}


def tp_rollout_worker(rank: int, world: int) -> dict[str, Any]:
    """TP=2 rollout (the engine, batched, chunked prefill) vs TP=2 recompute (``Engine.score``),
    in the batch-invariant mode and the default mode."""
    from pagedhybrid.engine import Engine, EngineConfig, SamplingParams

    cfg = tiny_byte_config()
    full = build(cfg, torch.float32, "cpu")
    full.load_weights(random_weights(cfg, seed=7))
    local = tensor_parallel_qwen35(full, sharding=attention_sharding(cfg, rank, world))
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
