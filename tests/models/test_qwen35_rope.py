"""Interleaved partial MRoPE tables against HF ``Qwen3_5TextRotaryEmbedding``."""

from __future__ import annotations

import pytest
import torch
from qwen35_tiny import tiny_hf_config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from pagedhybrid.models.qwen35 import Qwen35Config
from pagedhybrid.models.qwen35.rope import mrope_cos_sin, mrope_plane_index


@pytest.mark.parametrize("head_dim,factor,section", [
    (32, 0.5, [4, 2, 2]), (32, 0.25, [2, 1, 1]), (64, 0.5, [8, 4, 4]), (256, 0.25, [11, 11, 10]),
])
def test_cos_sin_match_hf_for_distinct_planes(head_dim, factor, section):
    hf_cfg = tiny_hf_config(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": factor,
        "mrope_section": section, "mrope_interleaved": True})
    cfg = Qwen35Config.from_dict(hf_cfg.to_dict())
    pos = torch.randint(0, 5000, (3, 1, 23), generator=torch.Generator().manual_seed(0))
    hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(hf_cfg)(torch.zeros(1), pos)  # [1, 23, rd]
    cos, sin = mrope_cos_sin(cfg, pos[:, 0])  # [23, rd]
    assert cos.shape == (23, cfg.rotary_dim)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_plane_index_follows_the_interleaved_rule():
    cfg = Qwen35Config.from_dict(tiny_hf_config(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}).to_dict())
    idx = mrope_plane_index(cfg).tolist()
    assert len(idx) == 32
    for i, plane in enumerate(idx):
        expect = 1 if i % 3 == 1 and i < 33 else 2 if i % 3 == 2 and i < 30 else 0
        assert plane == expect, i
