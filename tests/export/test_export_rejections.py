"""Typed rejections: every unsupported EP / dtype / block size / model / option combination
raises ``UnsupportedConfiguration`` with an actionable reason, before anything is written."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from export_helpers import tiny_config

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.options import ExportOptions, check_export
from pagedhybrid.export.package import export_package

OK = ExportOptions(ep="webgpu", dtype="fp16", block_size=16, num_blocks=8)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"ep": "cpu"}, r"no CPU kernel for com\.microsoft\.PagedAttention.*--ep webgpu.*lavapipe"),
    ({"ep": "dml"}, r"--ep 'dml'.*\['cuda', 'webgpu'\]"),
    ({"dtype": "fp32"}, r"--dtype fp32.*float16/bfloat16"),
    ({"dtype": "int8"}, r"--dtype 'int8'"),
    ({"dtype": "bf16"}, r"bf16 with --ep webgpu.*float16 only"),
    ({"block_size": 8}, r"--block-size 8.*power of two >= 16"),
    ({"block_size": 48}, r"--block-size 48"),
    ({"num_blocks": None, "gpu_utilization": 0.5}, r"--gpu-utilization with --ep webgpu.*only "
     r"on CUDA"),
    ({"max_length": 0}, r"--max-length 0: must be >= 1"),
    ({"max_length": 5000}, r"--max-length 5000: must be in \[1, 4096\]"),
    ({"gpu_utilization": 0.5}, r"mutually exclusive"),
    ({"ep": "cuda", "num_blocks": None, "gpu_utilization": 1.5}, r"fraction in \(0, 1\]"),
    ({"num_blocks": 0}, r"--num-blocks 0"),
    ({"max_batch_size": 0}, r"--max-batch-size 0"),
    ({"max_batch_size": 1000}, r"--max-batch-size 1000"),
    ({"max_scheduled_tokens": 0}, r"--max-scheduled-tokens 0"),
    ({"prefill_chunk_size": 0}, r"--prefill-chunk-size 0"),
])
def test_option_rejections(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=reason):
        check_export(tiny_config(), dataclasses.replace(OK, **changes))  # type: ignore[arg-type]


def test_valid_options_pass() -> None:
    check_export(tiny_config(), OK)
    check_export(tiny_config(), dataclasses.replace(OK, num_blocks=None))  # the default count
    check_export(tiny_config(), ExportOptions(ep="cuda", dtype="bf16"))  # factor 0.6 default


def test_model_rejections() -> None:
    odd_head = tiny_config(head_dim=12, partial_rotary_factor=0.5, mrope_section=(1, 1, 1))
    with pytest.raises(UnsupportedConfiguration, match=r"head_dim=12.*% 8"):
        check_export(odd_head, OK)
    all_linear = tiny_config(layer_types=("linear_attention",) * 6)
    with pytest.raises(UnsupportedConfiguration, match=r"no full_attention layer"):
        check_export(all_linear, OK)


@pytest.mark.parametrize(("model_type", "reason"), [
    ("qwen3", r"model_type='qwen3' is not a Qwen3\.5 hybrid decoder"),
    ("llama", r"'llama'"),
])
def test_unsupported_model_types(model_type: str, reason: str, tmp_path: Path,
                                 qwen27b_config_dir: Callable[..., Path]) -> None:
    src = qwen27b_config_dir(4)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    data = json.loads((src / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**data, "model_type": model_type}))
    out = tmp_path / "out"
    with pytest.raises(UnsupportedConfiguration, match=reason):
        export_package(model_dir, out, dataclasses.replace(OK, weights=False))
    assert not out.exists()


def test_cli_reports_rejection(qwen27b_config_dir: Callable[..., Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = cli_main(["export", str(qwen27b_config_dir(4)), str(out), "--ep", "cpu",
                   "--no-weights"])
    assert rc == 2
    assert "--ep webgpu" in capsys.readouterr().err
    assert not out.exists()
