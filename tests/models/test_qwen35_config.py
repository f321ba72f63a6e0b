"""Qwen35Config from HF config.json: layer patterns, RoPE fields, VL wrapper, rejections."""

from __future__ import annotations

import json

import pytest
import torch
from qwen35_tiny import tiny_hf_config
from transformers import Qwen3_5Config

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35 import CheckpointError, Qwen35Config, build
from pagedhybrid.models.qwen35.attention import FullAttention
from pagedhybrid.models.qwen35.linear_attention import GatedDeltaNet

QWEN35_27B_TEXT = {  # the text_config of Qwen3.5-27B (reference/qwen35-model.md §2)
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


@pytest.mark.parametrize("interval,layers", [(4, 8), (2, 6), (3, 7)])
def test_layer_types_follow_hf(interval, layers):
    hf = tiny_hf_config(full_attention_interval=interval, num_hidden_layers=layers)
    saved = hf.to_dict()  # what save_pretrained writes: explicit layer_types
    assert Qwen35Config.from_dict(saved).layer_types == tuple(hf.layer_types)
    raw = {k: v for k, v in saved.items() if k != "layer_types"}
    raw["full_attention_interval"] = interval  # a hand-written config.json
    cfg = Qwen35Config.from_dict(raw)
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.full_attention_layers == tuple(i for i in range(layers) if (i + 1) % interval == 0)


def test_rope_and_dims_are_read():
    cfg = Qwen35Config.from_dict(tiny_hf_config().to_dict())
    assert (cfg.rotary_dim, cfg.mrope_section, cfg.rope_theta) == (16, (4, 2, 2), 10000.0)
    assert cfg.mrope_interleaved and cfg.head_dim == 32 and cfg.rms_norm_eps == 1e-6
    assert (cfg.key_dim, cfg.value_dim, cfg.conv_dim) == (32, 32, 96)
    # HF's default partial_rotary_factor (0.25) and mrope_section when they are left out
    big = dict(QWEN35_27B_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    cfg = Qwen35Config.from_dict(big)
    assert cfg.rotary_dim == 64 and cfg.mrope_section == (11, 11, 10)


def test_27b_class_config_on_meta_device():
    wrapper = {"model_type": "qwen3_5", "text_config": QWEN35_27B_TEXT,
               "vision_config": {"depth": 27, "hidden_size": 1152}, "tie_word_embeddings": False}
    cfg = Qwen35Config.from_dict(wrapper)
    assert len(cfg.full_attention_layers) == 16 and len(cfg.linear_attention_layers) == 48
    assert cfg.full_attention_layers == tuple(range(3, 64, 4))
    model = build(cfg, torch.bfloat16, device="meta")
    mixers = [m for m in model.modules() if isinstance(m, FullAttention | GatedDeltaNet)]
    assert sum(isinstance(m, FullAttention) for m in mixers) == 16
    assert sum(isinstance(m, GatedDeltaNet) for m in mixers) == 48
    assert all(p.is_meta for p in model.parameters())
    shapes = model.expected_shapes()
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128,
                                                                       5120)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    assert 26e9 < sum(p.numel() for p in model.parameters()) < 28e9


def test_vl_wrapper_reads_text_config():
    vl = Qwen3_5Config(text_config=tiny_hf_config().to_dict(), tie_word_embeddings=True)
    cfg = Qwen35Config.from_dict(vl.to_dict())
    assert cfg.source_model_type == "qwen3_5" and cfg.tie_word_embeddings
    assert cfg.layer_types == tuple(tiny_hf_config().layer_types)


def test_round_trip_through_hf_dict():
    cfg = Qwen35Config.from_dict(tiny_hf_config().to_dict())
    assert Qwen35Config.from_dict(cfg.to_hf_dict()) == cfg


def _write(tmp_path, text: str):
    path = tmp_path / "config.json"
    path.write_text(text)
    return path


def test_malformed_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Qwen35Config.from_file(_write(tmp_path, "{ not json"))
    with pytest.raises(CheckpointError, match="does not exist"):
        Qwen35Config.from_file(tmp_path / "nope.json")
    with pytest.raises(CheckpointError, match="must be a JSON object"):
        Qwen35Config.from_file(_write(tmp_path, "[1, 2]"))


@pytest.mark.parametrize("change,field", [
    ({"hidden_size": "64"}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"layer_types": [1, 2, 3, 4, 5, 6]}, "layer_types"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5,
                          "mrope_section": [4, 4, 4]}}, "mrope_section"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5,
                          "mrope_section": "4,2,2"}}, "mrope_section"),
    ({"model_type": None}, "model_type"),
    ({"num_experts": 64}, "num_experts"),  # a MoE field in a dense config
    ({"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 8},
     "num_experts_per_tok"),
    ({"model_type": "qwen3_5_moe_text", "moe_intermediate_size": 0}, "moe_intermediate_size"),
])
def test_malformed_fields_name_the_field(tmp_path, change, field):
    data = tiny_hf_config().to_dict() | change
    with pytest.raises(CheckpointError) as info:
        Qwen35Config.from_file(_write(tmp_path, json.dumps(data)))
    assert info.value.what.startswith(field)


@pytest.mark.parametrize("change,reason", [
    ({"model_type": "llama"}, "not a Qwen3.5 hybrid"),
    ({"model_type": "qwen3_next"}, "not a Qwen3.5 hybrid"),
    ({"model_type": "qwen3_5_moe_text", "norm_topk_prob": False}, "norm_topk_prob"),
    ({"model_type": "qwen3_5_moe_text", "mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "no mrope_section"),
    ({"rope_parameters": {"rope_type": "yarn", "mrope_section": [2, 1, 1],
                          "partial_rotary_factor": 0.25}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2],
                          "partial_rotary_factor": 0.5, "mrope_interleaved": False}},
     "mrope_interleaved"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_say_why(change, reason):
    data = tiny_hf_config().to_dict() | change
    with pytest.raises(UnsupportedConfiguration, match=reason):
        Qwen35Config.from_dict(data)


def test_vl_wrapper_rejections():
    with pytest.raises(CheckpointError, match="text_config"):
        Qwen35Config.from_dict({"model_type": "qwen3_5"})
    with pytest.raises(UnsupportedConfiguration, match=r"text_config\.model_type"):
        Qwen35Config.from_dict({"model_type": "qwen3_5",
                                "text_config": {"model_type": "qwen3_5_moe_text"}})
