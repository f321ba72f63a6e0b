"""Deterministic CP attention on real gloo process groups (2 and 4 ranks, file:// rendezvous).

One spawn per world size runs every case (``cp_worker``); each rank compares its rows with a CP=1
call of the same global problem (bitwise) and with a float64 dense oracle
(``|fp32 - float64| <= 1e-6 * max(1, |float64|)``).
"""

from __future__ import annotations

from typing import Any

import pytest
from cp_cases import DECODE_CASES, PREFILL_CASES
from cp_worker import cp_worker

from pagedhybrid.parallel.launch import run_gloo

CASES = [c.name for c in PREFILL_CASES] + [c.name for c in DECODE_CASES]
FP32 = [c.name for c in (*PREFILL_CASES, *DECODE_CASES) if c.dtype == "fp32"]
BF16 = [c.name for c in (*PREFILL_CASES, *DECODE_CASES) if c.dtype == "bf16"]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_gloo(cp_worker, world, tmp_path_factory.mktemp(f"cp{world}"),
                           timeout_s=240)


def test_cp_out_and_lse_bitwise_equal_cp1(cp_run: tuple[int, list[dict[str, Any]]]) -> None:
    world, ranks = cp_run
    assert len(ranks) == world
    for rank, res in enumerate(ranks):
        for name in CASES:
            assert res[name]["bitwise_out"], f"CP={world} rank {rank} {name}: out differs"
            assert res[name]["bitwise_lse"], f"CP={world} rank {rank} {name}: lse differs"


def test_cp_fp32_matches_float64_oracle(cp_run: tuple[int, list[dict[str, Any]]]) -> None:
    """|fp32 - float64| <= 1e-6 * max(1, |float64|) for out and lse, elementwise."""
    world, ranks = cp_run
    worst = max(max(r[n]["rel_out"], r[n]["rel_lse"]) for r in ranks for n in FP32)
    worst_abs = max(max(r[n]["err_out"], r[n]["err_lse"]) for r in ranks for n in FP32)
    assert worst <= 1e-6, f"CP={world}: max relative error {worst:.3e} (abs {worst_abs:.3e})"
    assert worst_abs <= 1e-5


def test_cp_bf16_downcasts_once_at_the_final_write(
        cp_run: tuple[int, list[dict[str, Any]]]) -> None:
    _world, ranks = cp_run
    for res in ranks:
        for name in BF16:
            assert res[name]["dtype_out"] == "torch.bfloat16"
            assert res[name]["dtype_lse"] == "torch.float32"
            assert res[name]["rel_lse"] <= 1e-6  # lse stays fp32 from bf16 inputs
            assert res[name]["err_out"] <= 2 ** -7 * 4  # one bf16 rounding of |out| < 4
            if "bf16_is_fp32_cast_once" in res[name]:
                assert res[name]["bf16_is_fp32_cast_once"]
                assert res[name]["bf16_lse_is_fp32_lse"]
    for res in ranks:
        for name in FP32:
            assert res[name]["dtype_out"] == "torch.float32"


def test_cp_rejections_fail_on_every_rank(cp_run: tuple[int, list[dict[str, Any]]]) -> None:
    _, ranks = cp_run
    for rank, res in enumerate(ranks):
        rej = res["rejections"]
        assert rej["bad_shape_on_one_rank"].startswith("ContractViolation"), rej
        if rank != 1:
            assert "another CP rank rejected the call" in rej["bad_shape_on_one_rank"]
        else:
            assert "'key' must have shape" in rej["bad_shape_on_one_rank"]
        assert "must agree on all CP ranks" in rej["contracts_disagree"]
        assert rej["tile_split_across_ranks"].startswith("UnsupportedConfiguration")
        assert "split across CP ranks 0 and 1" in rej["tile_split_across_ranks"]
