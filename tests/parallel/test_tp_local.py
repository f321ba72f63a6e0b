"""TP sharding of Qwen3.5 weights on one process: shards reassemble the model, TP=1 is exact."""

from __future__ import annotations

import pytest
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.models.qwen35 import build
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config
from pagedhybrid.parallel.tensor_parallel import (
    attention_sharding,
    local_config,
    shard_state_dict,
    tensor_parallel_qwen35,
)


@pytest.fixture(scope="module")
def full() -> torch.nn.Module:
    cfg = tiny_byte_config()
    model = build(cfg, torch.float32, "cpu")
    model.load_weights(random_weights(cfg, seed=7))
    return model


def test_shards_reassemble_every_weight(full: torch.nn.Module) -> None:
    cfg = full.config
    state = full.state_dict()
    shards = [shard_state_dict(state, cfg, attention_sharding(cfg, r, 2)) for r in range(2)]
    hd, kd, vd = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for name, w in state.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w), name  # row-parallel: input columns
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            lk = cfg.key_dim // 2
            lv = cfg.value_dim // 2
            q = torch.cat([p[:lk] for p in parts])
            k = torch.cat([p[lk:2 * lk] for p in parts])
            v = torch.cat([p[2 * lk:] for p in parts])
            assert torch.equal(torch.cat([q, k, v]), w), name
            assert parts[0].shape[0] == 2 * lk + lv
        elif parts[0].shape != w.shape:
            assert torch.equal(torch.cat(parts), w), name  # column-parallel: output rows
        else:
            assert all(torch.equal(p, w) for p in parts), name  # replicated
    q0 = shards[1]["model.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(q0[: 2 * hd], state["model.layers.2.self_attn.q_proj.weight"][
        4 * hd: 6 * hd])  # rank 1's first head is global head 2 ([query | gate] rows)
    assert kd == 16 and vd == 16


def test_tp1_shard_is_the_model_bit_for_bit(full: torch.nn.Module) -> None:
    local = tensor_parallel_qwen35(full, sharding=attention_sharding(full.config, 0, 1))
    ids = torch.tensor([[17, 18, 19, 20, 21, 22, 23]])
    assert torch.equal(local.forward_dense(ids)[0], full.forward_dense(ids)[0])


def test_tp_rejections(full: torch.nn.Module) -> None:
    cfg = full.config
    with pytest.raises(UnsupportedConfiguration, match="TP=3 must divide"):
        local_config(cfg, 3)
    with pytest.raises(UnsupportedConfiguration, match=r"initialised torch\.distributed"):
        tensor_parallel_qwen35(full, sharding=attention_sharding(cfg, 0, 2))
    wrong = attention_sharding(tiny_byte_config().__class__(
        **{**cfg.__dict__, "num_attention_heads": 8, "num_key_value_heads": 4}), 0, 2)
    with pytest.raises(ContractViolation, match="must match the model's heads"):
        tensor_parallel_qwen35(full, sharding=wrong)
    assert local_config(cfg, 2).num_attention_heads == 2
