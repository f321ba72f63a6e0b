"""TP as layers on one process: each weight loader keeps its rank's slice of the checkpoint tensor
(per layer kind), the rank models reassemble the model, TP=1 is the plain model bit for bit, a
rank loaded from a file holds views of it, and unsplittable sizes are refused by field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.models.qwen35 import build, load
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config, write_checkpoint
from pagedhybrid.parallel import (
    ColumnParallelLinear,
    ParallelConfig,
    ReplicatedLinear,
    RowParallelLinear,
    Segment,
)
from pagedhybrid.parallel.linear import checkpoint_shape, weight_loader

IDS = torch.tensor([[17, 18, 19, 20, 21, 22, 23]])


def _load(layer: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
    w = layer.weight
    assert checkpoint_shape(w) == tuple(full.shape)
    got = weight_loader(w)(w, full)
    assert got.shape == w.shape and got.is_contiguous()
    return got


def _ranks(world: int) -> list[ParallelConfig]:
    return [ParallelConfig(tp_rank=r, tp_world_size=world) for r in range(world)]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(tiny_byte_config(), seed=7)


def test_column_parallel_loader_takes_whole_heads() -> None:
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # 4 heads of 2 rows
    heads = Segment(8, 4, "num_attention_heads")
    for p in _ranks(2):
        got = _load(ColumnParallelLinear(3, heads, torch.float32, p), full)
        assert torch.equal(got, full[4 * p.tp_rank:4 * p.tp_rank + 4])
        assert got.data_ptr() == full[4 * p.tp_rank:].data_ptr()  # a view: no copy
    one = ColumnParallelLinear(3, heads, torch.float32, ParallelConfig())
    assert weight_loader(one.weight)(one.weight, full) is full  # TP=1: the tensor itself


def test_qkv_loader_replicates_kv_heads_fewer_than_ranks() -> None:
    full = torch.arange(2 * 2 * 5, dtype=torch.float32).view(4, 5)  # 2 KV heads of 2 rows
    kv = Segment(4, 2, "num_key_value_heads", shared=True)
    got = [_load(ColumnParallelLinear(5, kv, torch.float32, p), full) for p in _ranks(4)]
    for r, g in enumerate(got):  # ranks 0, 1 read KV head 0; ranks 2, 3 KV head 1
        assert torch.equal(g, full[2 * (r // 2):2 * (r // 2) + 2])
    with pytest.raises(UnsupportedConfiguration, match="num_attention_heads=2"):
        ColumnParallelLinear(5, Segment(4, 2, "num_attention_heads"), torch.float32,
                             ParallelConfig(0, 4))  # partitioned heads are never replicated


def test_merged_column_loader_splits_each_segment() -> None:
    segs = (Segment(4, 2, "linear_num_key_heads", shared=True),) * 2 + (
        Segment(8, 4, "linear_num_value_heads"),)
    full = torch.randn(16, 3)
    q, k, v = full.split([4, 4, 8])
    for p in _ranks(2):
        r = p.tp_rank
        got = _load(ColumnParallelLinear(3, segs, torch.float32, p), full)
        assert torch.equal(got, torch.cat([q[2 * r:2 * r + 2], k[2 * r:2 * r + 2],
                                           v[4 * r:4 * r + 4]]))


def test_row_parallel_loader_takes_input_columns() -> None:
    full = torch.randn(3, 8)
    for p in _ranks(2):
        layer = RowParallelLinear(Segment(8, 4, "num_attention_heads"), 3, torch.float32, p)
        got = _load(layer, full)
        assert torch.equal(got, full[:, 4 * p.tp_rank:4 * p.tp_rank + 4])
    rep = ReplicatedLinear(8, 3, torch.float32)
    assert _load(rep, full) is full


def test_rank_models_reassemble_every_weight(weights: dict[str, torch.Tensor]) -> None:
    cfg = tiny_byte_config()
    full = build(cfg, torch.float32, "cpu")
    full.load_weights(weights)
    state = full.state_dict()
    shards = []
    for p in _ranks(2):
        rank = build(cfg, torch.float32, "cpu", parallel=p)
        assert rank.expected_shapes() == full.expected_shapes()  # checkpoint shapes
        assert rank.config.num_attention_heads == 2 and rank.config.num_key_value_heads == 1
        assert rank.config.linear_num_value_heads == 2 and rank.config.intermediate_size == 64
        assert rank.checkpoint_config == cfg
        rank.load_weights(weights)
        shards.append(rank.state_dict())
    hd = cfg.head_dim
    kinds = set()
    for name, w in state.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w), name  # row-parallel: input columns
            kinds.add("row")
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            lk, lv = cfg.key_dim // 2, cfg.value_dim // 2
            q = torch.cat([p[:lk] for p in parts])
            k = torch.cat([p[lk:2 * lk] for p in parts])
            v = torch.cat([p[2 * lk:] for p in parts])
            assert torch.equal(torch.cat([q, k, v]), w), name  # merged column-parallel
            assert parts[0].shape[0] == 2 * lk + lv
            kinds.add("merged")
        elif parts[0].shape != w.shape:
            assert torch.equal(torch.cat(parts), w), name  # column-parallel: output rows
            kinds.add("column")
        else:
            assert all(torch.equal(p, w) for p in parts), name  # replicated
            kinds.add("replicated")
    assert kinds == {"row", "merged", "column", "replicated"}
    q1 = shards[1]["model.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(q1[: 2 * hd], state["model.layers.2.self_attn.q_proj.weight"][
        4 * hd: 6 * hd])  # rank 1's first head is global head 2 ([query | gate] rows)
    a1 = shards[1]["model.layers.0.linear_attn.A_log"]
    assert torch.equal(a1, state["model.layers.0.linear_attn.A_log"][2:])  # value heads 2, 3


def test_tp1_is_the_plain_model_bit_for_bit(weights: dict[str, torch.Tensor]) -> None:
    cfg = tiny_byte_config()
    plain = build(cfg, torch.float32, "cpu")
    plain.load_weights(weights)
    one = build(cfg, torch.float32, "cpu", parallel=ParallelConfig(tp_rank=0, tp_world_size=1))
    one.load_weights(weights)
    assert one.config is cfg
    for name, p in one.state_dict().items():
        assert p.data_ptr() == weights[name if name in weights else
                                       "model.embed_tokens.weight"].data_ptr(), name
    assert torch.equal(one.forward_dense(IDS)[0], plain.forward_dense(IDS)[0])


def test_rank_loads_slices_of_the_mapped_file(tmp_path: Path,
                                              weights: dict[str, torch.Tensor]) -> None:
    cfg = tiny_byte_config()
    write_checkpoint(tmp_path, cfg, weights)
    size = (tmp_path / "model.safetensors").stat().st_size
    rank = load(tmp_path, parallel=ParallelConfig(tp_rank=1, tp_world_size=2))
    layer = rank.model.layers[2].self_attn
    q = layer.q_proj.weight  # rows of the mapped file: a view, not a copy
    assert q.untyped_storage().nbytes() == size
    full_q = weights["model.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(q, full_q[full_q.shape[0] // 2:])
    o = layer.o_proj.weight  # columns: the rank's copy only
    assert o.untyped_storage().nbytes() == o.numel() * o.element_size()
    assert rank.model.layers[0].linear_attn.A_log.dtype == torch.float32
    bf = load(tmp_path, torch.bfloat16, parallel=ParallelConfig(tp_rank=0, tp_world_size=2))
    w = bf.model.layers[0].mlp.gate_proj.weight  # sliced, then cast: the rank's part only
    assert w.dtype == torch.bfloat16 and w.shape == (64, 64)
    assert w.untyped_storage().nbytes() == w.numel() * 2


def test_unsplittable_sizes_are_refused_by_field() -> None:
    cfg = tiny_byte_config()
    cases = [
        (cfg, 3, "TP=3 must divide num_attention_heads=4"),
        (dataclasses.replace(cfg, num_attention_heads=12, num_key_value_heads=6), 4,
         "TP=4 must divide num_key_value_heads=6 or be a multiple of it"),
        (dataclasses.replace(cfg, linear_num_value_heads=6), 4,
         "TP=4 must divide linear_num_value_heads=6"),
        (dataclasses.replace(cfg, intermediate_size=130), 4,
         "TP=4 must divide intermediate_size=130"),
    ]
    for c, world, message in cases:
        with pytest.raises(UnsupportedConfiguration, match=message):
            build(c, parallel=ParallelConfig(tp_rank=0, tp_world_size=world))
        with pytest.raises(UnsupportedConfiguration, match=message):
            c.rank_local(ParallelConfig(tp_rank=0, tp_world_size=world))
    rank = build(cfg, parallel=ParallelConfig(tp_rank=0, tp_world_size=4))  # KV replicated
    assert rank.config.num_key_value_heads == 1 and rank.config.linear_num_key_heads == 1
    with pytest.raises(ContractViolation, match="tp_rank"):
        ParallelConfig(tp_rank=2, tp_world_size=2)


def test_tp2_forward_needs_a_process_group(weights: dict[str, torch.Tensor]) -> None:
    rank = build(tiny_byte_config(), torch.float32, "cpu",
                 parallel=ParallelConfig(tp_rank=0, tp_world_size=2))
    rank.load_weights(weights)
    with pytest.raises(UnsupportedConfiguration, match=r"initialised torch\.distributed"):
        rank.forward_dense(IDS)


def test_load_weights_names_bad_tensors(weights: dict[str, torch.Tensor]) -> None:
    model = build(tiny_byte_config(), torch.float32, "cpu")
    name = "model.layers.2.self_attn.q_proj.weight"
    with pytest.raises(ContractViolation, match=r"must have shape \[256, 64\]") as info:
        model.load_weights({**weights, name: weights[name][:128]})
    assert info.value.where == name and info.value.got == [128, 64]
    with pytest.raises(ContractViolation, match="is missing") as info:
        model.load_weights({k: v for k, v in weights.items() if not k.endswith("A_log")})
    assert info.value.where.endswith("A_log")
    with pytest.raises(ContractViolation, match="not a parameter"):
        model.load_weights({**weights, "model.layers.0.mlp.experts.0.weight": torch.zeros(2)})
