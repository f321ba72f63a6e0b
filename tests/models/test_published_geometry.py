"""The published Qwen3.5 geometries (0.8B, 2B, 27B) and the sharded random-checkpoint writer.

Parameter counts are of the text model only, as ``build(..., "meta")`` has it (no vision tower,
no multi-token-prediction layer): 0.8B -> 752,393,024 and 2B -> 1,881,825,088 (the published
names count the ~0.1B vision tower too), 27B -> 26,895,998,464. No full-size checkpoint is
written here: the writer is checked on a shrunken 0.8B.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedhybrid.models.qwen35 import Qwen35Config, build, load
from pagedhybrid.models.qwen35.config import FULL_ATTENTION, LINEAR_ATTENTION
from pagedhybrid.models.qwen35.synthetic import (
    INDEX_FILE,
    PUBLISHED,
    iter_random_weights,
    per_layer,
    write_random_checkpoint,
)

# name -> (hidden, intermediate, layers, Q heads, KV heads, head_dim, DeltaNet K heads,
#          DeltaNet V heads, DeltaNet head dim, tied embeddings)
TABLE = {
    "0.8B": (1024, 3584, 24, 8, 2, 256, 16, 16, 128, True),
    "2B": (2048, 6144, 24, 8, 2, 256, 16, 16, 128, True),
    "27B": (5120, 17408, 64, 24, 4, 256, 16, 48, 128, False),
}


def _shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    return build(config, torch.float32, "meta").expected_shapes()


@pytest.mark.parametrize("name", sorted(TABLE))
def test_published_values(name):
    c = PUBLISHED[name]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.linear_num_key_heads, c.linear_num_value_heads,
            c.linear_key_head_dim, c.tie_word_embeddings) == TABLE[name]
    assert c.linear_value_head_dim == c.linear_key_head_dim
    assert (c.vocab_size, c.linear_conv_kernel_dim, c.max_position_embeddings) == (
        248320, 4, 262144)
    # full_attention_interval 4: layers 3, 7, 11, ... are full attention
    assert c.full_attention_layers == tuple(range(3, c.num_hidden_layers, 4))
    assert (c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (1e7, 0.25, 64)
    assert (c.mrope_section, c.mrope_interleaved) == ((11, 11, 10), True)
    assert c.eos_token_id == (248044,)
    assert Qwen35Config.from_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize(("name", "count", "nominal"), [
    ("0.8B", 752_393_024, 0.8e9),
    ("2B", 1_881_825_088, 2e9),
    ("27B", 26_895_998_464, 27e9),
])
def test_text_model_parameter_count(name, count, nominal):
    got = sum(math.prod(s) for s in _shapes(PUBLISHED[name]).values())
    assert got == count
    assert 0.9 * nominal < got <= nominal


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in {INDEX_FILE}"
    return dict(pairs)


def _shrunken_08b() -> Qwen35Config:
    return dataclasses.replace(
        PUBLISHED["0.8B"], vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, layer_types=(LINEAR_ATTENTION, FULL_ATTENTION),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32)


def test_sharded_random_checkpoint_round_trip(tmp_path: Path):
    cfg = _shrunken_08b()
    files = write_random_checkpoint(tmp_path, cfg, seed=5, shard_bytes=1 << 20)
    index = json.loads((tmp_path / INDEX_FILE).read_text(), object_pairs_hook=_no_duplicate_keys)
    expected = dict(iter_random_weights(cfg, 5))  # the writer's draws, float32

    n = len(files)
    assert n >= 3
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                       for i in range(1, n + 1)]
    assert sorted(tmp_path.glob("*.safetensors")) == files
    # the index lists every tensor once, in the shard that holds it (and only there)
    assert sorted(index["weight_map"]) == sorted(expected)
    stored: dict[str, list[str]] = {}
    for f in files:
        with safe_open(str(f), "pt") as shard:
            for key in shard.keys():  # noqa: SIM118
                stored.setdefault(key, []).append(f.name)
                assert shard.get_slice(key).get_dtype() == "BF16", key
    assert stored == {k: [v] for k, v in index["weight_map"].items()}
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in expected.values())
    assert Qwen35Config.from_model_dir(tmp_path) == dataclasses.replace(
        cfg, checkpoint_dtype="bfloat16")

    model = load(tmp_path, dtype=torch.bfloat16)
    params = model.state_dict()
    assert set(params) == set(expected) | {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, value in expected.items():
        want = value.to(torch.bfloat16).to(params[name].dtype)  # A_log / dt_bias stay fp32
        assert torch.equal(params[name], want), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_one_shard_when_it_fits(tmp_path: Path):
    cfg = _shrunken_08b()
    files = write_random_checkpoint(tmp_path, cfg, seed=1, dtype=torch.float32)
    assert [f.name for f in files] == ["model-00001-of-00001.safetensors"]
    params = load(tmp_path).state_dict()
    for name, value in iter_random_weights(cfg, 1):
        assert torch.equal(params[name], value), name


def test_per_layer_27b_has_the_published_widths():
    full = PUBLISHED["27B"]
    cfg = per_layer(full)
    assert cfg.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION)
    shapes = _shapes(cfg)
    gdn, attn = "model.layers.0.linear_attn.", "model.layers.1.self_attn."
    assert shapes[gdn + "in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert shapes[gdn + "in_proj_z.weight"] == (48 * 128, 5120)
    assert shapes[gdn + "conv1d.weight"] == (2 * 16 * 128 + 48 * 128, 1, 4)
    assert shapes[gdn + "A_log"] == (48,)
    assert shapes[attn + "q_proj.weight"] == (2 * 24 * 256, 5120)  # [query | gate] per head
    assert shapes[attn + "k_proj.weight"] == (4 * 256, 5120)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (5120, 17408)
    assert shapes["lm_head.weight"] == (248320, 5120)  # untied
    # layer 0 / 1 are the full model's layers 0 (linear) and 3 (full), tensor for tensor
    whole = _shapes(full)
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            assert whole[f"model.layers.{(0, 3)[int(i)]}.{rest}"] == shape, name
        else:
            assert whole[name] == shape, name


def test_per_layer_rejects_an_unknown_layer_type():
    with pytest.raises(ValueError, match="sliding_attention"):
        per_layer(PUBLISHED["27B"], ("linear_attention", "sliding_attention"))
