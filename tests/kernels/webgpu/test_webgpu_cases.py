"""test.json on the local WebGPU adapter (lavapipe in CI) against pagedhybrid.ops.paged_attention.

Each case checks ``outputT`` and both in-place caches within the file's fp16 tolerance, that the
caches come back as the caller's own objects, and (where given) which variant ran, so the
split-K path is proven to be exercised. Every rejection case must raise its typed error.
On an adapter with subgroups (lavapipe has them) the default renders the subgroup-lanes attention
body; a representative subset is rerun with ``useSubgroups=0`` so the portable body is covered too.
"""

from __future__ import annotations

import json

import pytest

from pagedhybrid.kernels.webgpu.package import KernelPackage, package_dir
from pagedhybrid.kernels.webgpu.testsuite import run_case, run_rejection

_SPEC = json.loads((package_dir() / "build" / "webgpu" / "test.json").read_text())


def test_cases_cover_the_issue(package: KernelPackage) -> None:
    recipes = [c["recipe"] for c in _SPEC["cases"] if "recipe" in c]
    ratios = {r["num_heads"] // r["kv_num_heads"] for r in recipes}
    assert {1, 2, 4, 8} <= ratios
    assert {64, 128} <= {r["head_size"] for r in recipes}
    assert any(r["packed_qkv"] for r in recipes)
    assert any(r["slot_mapping"] == "skip" for r in recipes)
    assert any(sum(n for _, n in r["seqs"]) == 0 for r in recipes)  # token_count 0
    assert any(len({p for p, _ in r["seqs"]}) >= 3 for r in recipes)  # several past lengths
    assert any(any(p % 16 in (0, 15) and p > 0 for p, _ in r["seqs"]) for r in recipes)
    assert sum("splitk" in c.get("expectVariant", "") for c in _SPEC["cases"]) >= 2
    # a block drafter's masks: a bidirectional block, a local window, both
    assert any(r.get("is_causal") == 0 for r in recipes)
    assert any(r.get("local_window_size", -1) > 0 for r in recipes)
    assert any(r.get("is_causal") == 0 and r.get("local_window_size", -1) > 0 for r in recipes)


@pytest.mark.parametrize("case", _SPEC["cases"], ids=[c["name"] for c in _SPEC["cases"]])
def test_case(kernel, case) -> None:
    result = run_case(kernel, case, _SPEC["tolerance"])
    assert result.passed, result.detail
    assert result.errors["outputT"] <= 4e-3


# (test.json itself also holds portable-body cases: head size 24, decode split-K, packed prefill)
PORTABLE = ["several-sequences-gqa4-d64", "slot-mapping-skips-minus-one",
            "decode-splitk-gqa4-d128", "gqa8-d128", "bidirectional-block-gqa4-d64",
            "local-window-prefill-gqa2-d128", "local-window-decode-splitk"]


@pytest.mark.parametrize("name", PORTABLE)
def test_case_portable_body(kernel, name) -> None:
    case = next(c for c in _SPEC["cases"] if c["name"] == name)
    case = {**case, "tunables": {**case.get("tunables", {}), "useSubgroups": 0}}
    result = run_case(kernel, case, _SPEC["tolerance"])
    assert result.passed, result.detail
    assert kernel.last["derive"]["subgroupLanes"] is False


def test_default_uses_subgroup_body_on_lavapipe(kernel) -> None:
    case = next(c for c in _SPEC["cases"] if c["name"] == "gqa2-d64")
    assert run_case(kernel, case, _SPEC["tolerance"]).passed
    assert kernel.last["derive"]["subgroupLanes"] is True


@pytest.mark.parametrize("rej", _SPEC["rejections"], ids=[r["name"] for r in _SPEC["rejections"]])
def test_rejection(kernel, rej) -> None:
    result = run_rejection(kernel, rej)
    assert result.passed, result.detail
