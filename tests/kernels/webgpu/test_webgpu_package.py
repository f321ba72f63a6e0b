"""The package files: generated from the OpSpec (no drift), digests, format rules, limits."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.webgpu.build_package import generated_files
from pagedhybrid.kernels.webgpu.manifest_gen import bind_key, generate_manifest
from pagedhybrid.kernels.webgpu.package import TOP_LEVEL_KEYS, KernelPackage, package_dir
from pagedhybrid.ops.paged_attention import SPEC

# WebGPU defaults every browser guarantees (the JS loader's fallback table is a bit larger).
DEFAULT_MAX_STORAGE_BUFFERS = 8
DEFAULT_MAX_INVOCATIONS = 256


def test_manifest_is_generated_from_the_opspec(package: KernelPackage) -> None:
    assert package.manifest == generate_manifest(SPEC)


def test_every_generated_file_is_up_to_date() -> None:
    root = package_dir()
    stale = [rel for rel, text in generated_files(root).items()
             if (root / rel).read_text(encoding="utf-8") != text]
    assert not stale, ("regenerate with `python -m pagedhybrid.kernels.webgpu.build_package`: "
                       f"{stale}")


def test_ports_dtypes_attributes_follow_the_spec(package: KernelPackage) -> None:
    m = package.manifest
    spec_inputs = [p.name for p in SPEC.inputs]
    onnx_order = [p["onnx"] for p in m["inputs"].values()]
    assert onnx_order == [n for n in spec_inputs if n in onnx_order]  # ORT order kept
    for key, port in m["inputs"].items():
        sp = SPEC.input(port["onnx"])
        assert key == bind_key(sp.name)
        assert port["rank"] == sp.ranks[0]
        assert port.get("optional", False) == (sp.optional and sp.name != "value_cache")
    assert [p["onnx"] for p in m["outputs"].values()] == [p.name for p in SPEC.outputs]
    assert set(m["outputs"]) & set(m["inputs"]) == {"keyCacheT", "valueCacheT"}  # inout caches
    for name, attr in m["attributes"].items():
        a = SPEC.attribute(name)
        assert attr.get("default", "required") == ("required" if a.required else a.default)
    assert m["attributeConstraints"]["num_heads"] == {"required": True}
    assert m["attributeConstraints"]["is_causal"] == {"values": [0, 1]}
    assert m["typeConstraints"] == {"T": ["float16"], "S": ["int32"]}
    assert set(m["onnx"]["unsupportedInputs"]) == set(spec_inputs) - {
        p["onnx"] for p in m["inputs"].values()}


def test_digests_recomputed_independently(package: KernelPackage) -> None:
    build = package_dir() / "build" / "webgpu"
    files = package.metadata["digest"]["files"]
    on_disk = sorted(p.name for p in build.iterdir() if p.name != "metadata.json")
    assert sorted(files) == on_disk  # every file but metadata.json itself
    for rel, want in files.items():
        raw = hashlib.sha256((build / rel).read_bytes()).digest()
        assert base64.b64encode(raw).decode() == want, rel


def test_tampered_file_is_rejected(tmp_path) -> None:
    import shutil

    shutil.copytree(package_dir(), tmp_path / "pkg")
    t = tmp_path / "pkg" / "build" / "webgpu" / "paged-attention.wgsl.jinja"
    t.write_text(t.read_text() + "// edit\n")
    with pytest.raises(ContractViolation, match="sha256"):
        KernelPackage(tmp_path / "pkg")


def test_metadata_rules(package: KernelPackage) -> None:
    md, m = package.metadata, package.manifest
    assert md["name"] == "com.microsoft.PagedAttention" == f"{m['domain']}.{m['name']}"
    assert md["backend"]["type"] == "webgpu"
    assert md["webgpu"]["manifestSpec"] == "2.1"
    assert md["digest"]["algorithm"] == "sha256"
    assert set(md["webgpu"]["variants"]) == {v["id"] for v in m["variants"]}
    assert set(m) <= TOP_LEVEL_KEYS
    for v in m["variants"]:
        assert "shader-f16" in v["requires"]["features"]
        assert md["webgpu"]["variants"][v["id"]] == sorted({p["shader"] for p in v["passes"]})


def test_passes_fit_webgpu_default_limits(package: KernelPackage) -> None:
    for v in package.manifest["variants"]:
        for p in v["passes"]:
            storage = [b for b in p["bindings"] if b["buffer"] != "uniform"]
            assert len(storage) <= DEFAULT_MAX_STORAGE_BUFFERS, (v["id"], p["id"])
            names = [b.get("name") or b.get("scratch") for b in p["bindings"]]
            assert len(names) == len(set(names)), "a buffer bound twice in one pass"
    tun = package.manifest["tunables"]
    assert tun["scatterWorkgroupSize"]["default"] <= DEFAULT_MAX_INVOCATIONS
    assert tun["mergeWorkgroupSize"]["default"] <= DEFAULT_MAX_INVOCATIONS


def test_templates_splice_generated_bindings(package: KernelPackage) -> None:
    templates = [n for n in package.texts if n.endswith(".wgsl.jinja")]
    assert len(templates) == 3
    for name in templates:
        text = package.texts[name]
        assert "{{ env.wgsl.resourceDeclarations }}" in text
        assert "@binding(" not in text  # bindings come from the manifest only
        assert re.search(r"\bfn main\(", text)


def test_card_tables_list_every_bind_key(package: KernelPackage) -> None:
    card = (package_dir() / "README.md").read_text(encoding="utf-8")
    for key in [*package.manifest["inputs"], *package.manifest["outputs"]]:
        assert f"`{key}`" in card
    for name in package.manifest["attributes"]:
        assert f"| `{name}` |" in card
    assert "shader-f16" in card


def test_test_and_bench_json_are_json(package: KernelPackage) -> None:
    t = json.loads(package.texts["test.json"])
    b = json.loads(package.texts["bench.json"])
    assert t["reference"] == "pagedhybrid.ops.paged_attention"
    assert len(t["cases"]) >= 15 and len(t["rejections"]) >= 8
    assert {c["kind"] for c in b["cases"]} == {"decode", "prefill", "mixed"}
