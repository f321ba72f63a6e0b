"""Regenerate the PagedAttention package's generated files.

``python -m pagedhybrid.kernels.webgpu.build_package [--package DIR] [--check]`` writes (or with
``--check`` compares) ``build/webgpu/manifest.json`` (from the OpSpec, see ``manifest_gen``),
``test.json`` and ``bench.json`` (from ``package_cases``; the literal case's expected output
comes from the torch reference), the kernel card ``README.md`` (tables from the manifest) and
last ``metadata.json`` with the sha256 digests of every file under ``build/webgpu``. Hand-written
files: the three ``*.wgsl.jinja`` templates. Output is deterministic (no timestamps), so a test
can regenerate everything and demand byte equality.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedhybrid.kernels.webgpu.manifest_gen import generate_manifest
from pagedhybrid.kernels.webgpu.package import MANIFEST_SPEC, digest, package_dir
from pagedhybrid.kernels.webgpu.package_cases import bench_json, test_json
from pagedhybrid.kernels.webgpu.readme import render_readme


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def generated_files(root: Path) -> dict[str, str]:
    """Relative path (from the package root) -> text of every generated file."""
    from pagedhybrid.ops.paged_attention import SPEC

    build = root / "build" / "webgpu"
    manifest = generate_manifest(SPEC)
    files = {
        "build/webgpu/manifest.json": dumps(manifest),
        "build/webgpu/test.json": dumps(test_json()),
        "build/webgpu/bench.json": dumps(bench_json()),
    }
    templates = sorted({p["shader"] for v in manifest["variants"] for p in v["passes"]})
    texts = {name.split("/")[-1]: text for name, text in files.items()}
    for t in templates:
        texts[t] = (build / t).read_text(encoding="utf-8")
    metadata = {
        "name": f"{manifest['domain']}.{manifest['name']}",
        "id": f"webgpu-kernels/{manifest['domain']}.{manifest['name']}",
        "version": 1,
        "license": "apache-2.0",
        "backend": {"type": "webgpu"},
        "webgpu": {
            "manifestSpec": MANIFEST_SPEC,
            "variants": {v["id"]: sorted({p["shader"] for p in v["passes"]})
                         for v in manifest["variants"]},
        },
        "digest": {"algorithm": "sha256", "encoding": "base64",
                   "files": {name: digest(texts[name]) for name in sorted(texts)}},
        "provenance": {
            "generator": "python -m pagedhybrid.kernels.webgpu.build_package",
            "contract": "pagedhybrid.ops.paged_attention.SPEC (ONNX Runtime 1.32.0 schema of "
                        "com.microsoft.PagedAttention, since_version 1)",
            "templates": "hand-written WGSL (pagedhybrid)",
            "testSchema": "project-defined (pagedhybrid), not upstream-verified",
        },
    }
    files["build/webgpu/metadata.json"] = dumps(metadata)
    files["README.md"] = render_readme(manifest)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedhybrid.kernels.webgpu.build_package",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=None, help="package directory (default: the repo's)")
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ns = ap.parse_args(argv)
    root = package_dir(explicit=ns.package)
    stale = []
    for rel, text in generated_files(root).items():
        path = root / rel
        if ns.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print("stale generated files: " + ", ".join(stale), file=sys.stderr)
        return 1
    if not ns.check:
        print(f"wrote {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
