"""The page count of an export without ``--num-blocks`` (``export/pages.py``).

On a provider whose genai runtime cannot size pages from free memory (``--ep webgpu``) the export
writes ``engine.dynamic_batching.num_blocks = min(max_batch_size * ceil(max_length /
block_size), what 1 GiB of pages and a 128 MiB layer buffer hold)`` and prints it; an explicit
``--num-blocks`` wins; a context one sequence cannot reach within the budget is refused with
what fits, before anything is written. The expected counts below are worked out by hand from
the configs (a page = block_size tokens of K and V in every full-attention layer, fp16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from export_helpers import TINY_OPTIONS

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.cli import options_from_args, register_subcommands
from pagedhybrid.export.package import export_package
from pagedhybrid.export.verify import verify_package


def genai(out: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((out / c.GENAI_CONFIG_FILE).read_text())


def test_default_pages_let_every_sequence_of_the_batch_reach_the_context(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    # tiny model: context 4096, 2 full-attention layers, 2 KV heads of 32: a page of 16 tokens
    # is 2 (K, V) * 2 layers * 16 * 2 * 32 * 2 B = 8 KiB; 8 sequences x 256 pages = 16 MiB
    out = tmp_path / "pkg"
    result = export_package(tiny_checkpoint, out,
                            dataclasses.replace(TINY_OPTIONS, num_blocks=None, weights=False))
    cfg = genai(out)
    assert cfg["engine"]["dynamic_batching"] == {"block_size": 16, "max_batch_size": 8,
                                                 "num_blocks": 8 * 4096 // 16}
    assert cfg["search"]["max_length"] == cfg["model"]["context_length"] == 4096
    assert result.pages.num_blocks == 2048 and result.pages.page_bytes == 8 << 10
    assert result.pages.summary().startswith("num_blocks 2048 of 16 tokens = 16.0 MiB (default "
                                             "for --ep webgpu: 8 sequences x 256 pages")
    assert verify_package(out).ok


@pytest.mark.parametrize(("interval", "blocks", "bound"), [
    # 16 full-attention layers, 4 KV heads of 256: a 256-token page is 2*16*256*4*256*2 B =
    # 16 MiB; the 1 GiB budget holds 64 of them (16,384 tokens; 16 x 1024 pages wanted)
    (4, 64, "capped at 1 GiB of pages in all"),
    # one full-attention layer: a page is 1 MiB (1024 fit in 1 GiB), but one layer's K buffer
    # of 512 KiB pages must stay within WebGPU's 128 MiB binding: 256 pages
    (64, 256, "capped at 128.0 MiB per layer buffer"),
])
def test_cli_prints_the_default_capped_by_the_budget(
        interval: int, blocks: int, bound: str, qwen27b_config_dir: Callable[..., Path],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pkg"
    assert cli_main(["export", str(qwen27b_config_dir(interval)), str(out), "--ep", "webgpu",
                     "--no-weights"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("pages: "))
    assert f"pages: num_blocks {blocks} of 256 tokens" in line and bound in line, line
    assert f"up to {blocks * 256} tokens per sequence" in line, line
    cfg = genai(out)
    assert cfg["engine"]["dynamic_batching"]["num_blocks"] == blocks
    assert cfg["search"]["max_length"] == 262144  # the model's; genai caps requests at the pages
    assert verify_package(out).ok


def test_explicit_num_blocks_and_max_length(qwen27b_config_dir: Callable[..., Path],
                                            tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = str(qwen27b_config_dir(4))
    assert cli_main(["export", model, str(tmp_path / "a"), "--ep", "webgpu", "--no-weights",
                     "--num-blocks", "7"]) == 0
    assert genai(tmp_path / "a")["engine"]["dynamic_batching"]["num_blocks"] == 7
    assert "pages: num_blocks 7 of 256 tokens = 112.0 MiB (--num-blocks)" in \
        capsys.readouterr().out
    # --max-length: the per-sequence demand (4 sequences x 4 pages) and search.max_length
    assert cli_main(["export", model, str(tmp_path / "b"), "--ep", "webgpu", "--no-weights",
                     "--max-length", "1024", "--max-batch-size", "4"]) == 0
    cfg = genai(tmp_path / "b")
    assert cfg["engine"]["dynamic_batching"]["num_blocks"] == 16
    assert cfg["search"]["max_length"] == 1024
    assert "every sequence reaches max_length" in capsys.readouterr().out
    # CUDA keeps genai's own sizing from free memory (its builder's default factor)
    assert cli_main(["export", model, str(tmp_path / "c"), "--ep", "cuda", "--no-weights"]) == 0
    assert genai(tmp_path / "c")["engine"]["dynamic_batching"]["gpu_utilization_factor"] == 0.6


@pytest.mark.parametrize(("overrides", "args", "reason"), [
    # 32,768 tokens = 128 pages of 16 MiB: twice the 1 GiB budget
    ({}, ["--max-length", "32768"],
     r"one sequence of 32768 tokens \(--max-length\) needs 128 pages of 256 tokens \(16\.0 MiB "
     r"each across 16 full-attention layers\), but the default budget \(1 GiB of pages in all\) "
     r"holds 64 pages = 16384 tokens; pass a smaller --max-length or pin --num-blocks"),
    # 64 full-attention layers of 8 KV heads: 128 MiB a page, 8 pages = 2048 tokens < 4096
    ({"full_attention_interval": 1, "num_key_value_heads": 8}, [],
     r"one sequence of 4096 tokens \(the default minimum context\) needs 16 pages .* holds 8 "
     r"pages = 2048 tokens"),
    ({}, ["--num-blocks", "2", "--max-length", "1024"],
     r"--num-blocks 2 x --block-size 256 = 512 tokens cannot hold one sequence of --max-length "
     r"1024; pass --num-blocks 4 or more"),
    ({}, ["--max-length", "300000"], r"--max-length 300000: must be in \[1, 262144\]"),
])
def test_a_context_that_cannot_fit_is_refused(
        overrides: dict[str, int], args: list[str], reason: str,
        qwen27b_config_dir: Callable[..., Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = qwen27b_config_dir(**overrides)
    out = tmp_path / "out"
    assert cli_main(["export", str(model), str(out), "--ep", "webgpu", "--no-weights",
                     *args]) == 2
    assert not out.exists()
    assert "unsupported configuration" in capsys.readouterr().err
    # the reason in full (the CLI's console wraps it)
    parser = argparse.ArgumentParser(prog="pagedhybrid")
    register_subcommands(parser.add_subparsers(dest="command", required=True))
    options = options_from_args(parser.parse_args(
        ["export", str(model), str(out), "--ep", "webgpu", "--no-weights", *args]))
    with pytest.raises(UnsupportedConfiguration, match=reason):
        export_package(model, out, options)
    assert not out.exists()
