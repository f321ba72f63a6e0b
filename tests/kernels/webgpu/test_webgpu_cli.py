"""``pagedhybrid kernels test|bench`` plumbing and the package regeneration entry point."""

from __future__ import annotations

import argparse
import json

from pagedhybrid.kernels.webgpu import build_package
from pagedhybrid.kernels.webgpu.cli import kernels_bench, register_subcommands


def test_subcommands_parse() -> None:
    p = argparse.ArgumentParser()
    register_subcommands(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(["kernels", "test", "--package", "/x"])
    assert ns.package == "/x" and callable(ns.func)
    ns = p.parse_args(["kernels", "bench", "--json", "o.json", "--no-ort", "--case", "a"])
    assert (ns.json_out, ns.no_ort, ns.case) == ("o.json", True, ["a"])


def test_bench_one_case_without_ort_writes_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    rc = kernels_bench(None, str(out), with_ort=False, only=["decode-b4-ctx512-gqa4-d128"])
    assert rc == 0
    report = json.loads(out.read_text())
    (row,) = report["cases"]
    assert row["variant"] == "flash-decode-splitk"
    assert row["ours_max_err"] < 2e-3
    assert row["ours_ms"] > 0 and row["ours_first_ms"] > 0
    assert report["adapter"]["backend_type"] == "Vulkan"


def test_build_package_check_passes() -> None:
    assert build_package.main(["--check"]) == 0
