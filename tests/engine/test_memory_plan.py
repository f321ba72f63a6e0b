"""The cache planned from the model and the machine: the budget, its split, shrinking what can
shrink with a warning, and refusals that say which option to change by how much."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.engine.core.config import page_bytes, slot_bytes
from pagedhybrid.engine.core.memory import (
    DEFAULT_CACHE_FRACTION,
    MIN_CONTEXT,
    available_memory,
    plan_memory,
    workspace_bytes,
)
from pagedhybrid.errors import CapacityError, ContractViolation
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.synthetic import tiny_byte_config

GIB = 1 << 30


def hybrid_100m() -> Qwen35Config:
    """The ~100M hybrid of the issue (hidden 768, 8 layers, 16k vocabulary) whose 1.3 MB state
    slots did not fit the old fixed 64 MiB cache."""
    return dataclasses.replace(
        tiny_byte_config(), vocab_size=16384, hidden_size=768, intermediate_size=2048,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention"
                          for i in range(8)),
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, mrope_section=(4, 2, 2), max_position_embeddings=32768)


def test_available_memory_reads_meminfo_and_a_lower_cgroup_limit(tmp_path: Path) -> None:
    meminfo = "MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 2048 kB\n"
    assert available_memory(meminfo, None) == 2048 * 1024
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("5\n")
    assert available_memory(meminfo, tmp_path) == 2048 * 1024
    (tmp_path / "memory.max").write_text(f"{1 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 19}\n")
    assert available_memory(meminfo, tmp_path) == 1 << 19
    assert available_memory() > 0  # this machine


def test_the_default_budget_is_a_share_of_what_is_left_and_the_split_adds_up() -> None:
    cfg, dtype = hybrid_100m(), torch.bfloat16
    weights, free = 200 << 20, 2 * GIB  # the budget, not the demand, bounds the pages
    plan = plan_memory(cfg, EngineConfig(), dtype, weights, free)
    ws = workspace_bytes(cfg, EngineConfig())
    assert plan.budget == int(DEFAULT_CACHE_FRACTION * (free - weights - ws))
    s = plan.sizes
    assert s.num_slots == 32 and s.num_checkpoints == 32 and not plan.warnings
    used = s.num_blocks * page_bytes(cfg, 16, dtype) + 64 * slot_bytes(cfg, dtype)
    assert used == plan.cache_bytes <= plan.budget
    assert plan.cache_bytes + plan.workspace + weights <= free
    # pages: what fits, never more than max_num_seqs sequences at the model's limit use
    assert s.num_blocks == min((plan.budget - 64 * slot_bytes(cfg, dtype))
                               // page_bytes(cfg, 16, dtype), 32 * 32768 // 16)
    assert s.max_model_len == min(32768, s.num_blocks * 16)
    line = plan.summary()
    for part in (f"{s.num_blocks} KV pages", "32 state slots", "32 state checkpoints",
                 "weights 0.20 GiB", "sequences at full context", f"at {MIN_CONTEXT}"):
        assert part in line, line
    half = plan_memory(cfg, EngineConfig(cache_memory_fraction=0.25), dtype, weights, free)
    assert half.budget == int(0.25 * (free - weights - ws))
    assert half.sizes.num_blocks < s.num_blocks


def test_an_explicit_budget_at_the_edge_fits_and_one_byte_less_says_how_much_more() -> None:
    cfg, dtype = hybrid_100m(), torch.bfloat16
    per_page, per_slot = page_bytes(cfg, 16, dtype), slot_bytes(cfg, dtype)
    base = dict(num_state_slots=4, num_state_checkpoints=2, max_model_len=1024)
    edge = 6 * per_slot + (1024 // 16) * per_page
    plan = plan_memory(cfg, EngineConfig(cache_memory_bytes=edge, **base), dtype)
    assert plan.sizes.num_blocks == 64 and plan.cache_bytes == edge and not plan.warnings
    with pytest.raises(CapacityError) as err:
        plan_memory(cfg, EngineConfig(cache_memory_bytes=edge - 1, **base), dtype)
    msg = str(err.value)
    assert "raise cache_memory_bytes so that the cache gets 1 B more" in msg, msg
    assert f"at least {edge} B" in msg and "lower max_model_len from 1024 to 1008" in msg, msg
    assert "lower num_state_slots from 4" in msg and "num_state_checkpoints from 2" in msg


def test_defaults_shrink_checkpoints_first_then_slots_with_a_warning() -> None:
    cfg, dtype = hybrid_100m(), torch.bfloat16
    per_page, per_slot = page_bytes(cfg, 16, dtype), slot_bytes(cfg, dtype)
    pages = MIN_CONTEXT // 16
    room = 40 * per_slot + pages * per_page  # 32 slots and 8 of the 32 checkpoints
    plan = plan_memory(cfg, EngineConfig(cache_memory_bytes=room, max_model_len=MIN_CONTEXT),
                       dtype)
    assert (plan.sizes.num_slots, plan.sizes.num_checkpoints) == (32, 8)
    assert len(plan.warnings) == 1 and "state checkpoints cut from 32 to 8" in plan.warnings[0]
    room = 5 * per_slot + pages * per_page  # no checkpoints, 5 slots
    plan = plan_memory(cfg, EngineConfig(cache_memory_bytes=room, max_model_len=MIN_CONTEXT),
                       dtype)
    assert (plan.sizes.num_slots, plan.sizes.num_checkpoints) == (5, 0)
    assert any("state slots cut from 32 to 5" in w and "at most 5 sequences" in w
               for w in plan.warnings), plan.warnings
    assert plan.cache_bytes <= room
    with pytest.raises(CapacityError, match="raise cache_memory_bytes"):
        plan_memory(cfg, EngineConfig(cache_memory_bytes=per_slot + pages * per_page - 1,
                                      max_model_len=MIN_CONTEXT), dtype)


def test_the_fraction_is_checked_and_exclusive() -> None:
    for bad in (0.0, 1.5, -1, True, "0.5"):
        with pytest.raises(ContractViolation, match="cache_memory_fraction"):
            EngineConfig(cache_memory_fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(ContractViolation, match="exclusive"):
        EngineConfig(cache_memory_fraction=0.5, num_blocks=8)


def test_the_100m_hybrid_starts_with_no_memory_options_and_answers() -> None:
    from pagedhybrid.models.qwen35.model import build

    torch.manual_seed(0)
    model = build(hybrid_100m(), torch.bfloat16, "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    engine = Engine(model, EngineConfig())
    assert engine.states.capacity == 32 and engine.blocks.capacity > 0
    assert engine.memory.cache_bytes <= engine.memory.budget
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    outs = [o for o in engine.stream() if o.finished]
    assert len(outs) == 1 and len(outs[0].token_ids) == 4


def test_a_small_machine_shrinks_the_defaults_and_a_too_small_one_is_told_what_to_change(
) -> None:
    cfg, dtype = hybrid_100m(), torch.bfloat16
    per_page, per_slot = page_bytes(cfg, 16, dtype), slot_bytes(cfg, dtype)
    ws = workspace_bytes(cfg, EngineConfig())
    need = (MIN_CONTEXT // 16) * per_page
    free = ws + 2 * (need + 10 * per_slot)  # the default half holds 10 state rows
    plan = plan_memory(cfg, EngineConfig(), dtype, 0, free)
    assert plan.sizes.num_checkpoints == 0 and plan.sizes.num_slots == 10, plan
    assert plan.sizes.max_model_len >= MIN_CONTEXT and plan.cache_bytes <= plan.budget
    assert len(plan.warnings) == 2
    with pytest.raises(CapacityError) as err:
        plan_memory(cfg, EngineConfig(), dtype, 0, ws + 2 * need)
    assert "raise cache_memory_fraction / cache_memory_bytes" in str(err.value)
