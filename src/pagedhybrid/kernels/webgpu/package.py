"""A WebGPU kernel package on disk: files, digests, manifest expressions and template rendering.

Layout (the Hugging Face ``webgpu-kernels`` format, manifest spec 2.1)::

    <package>/README.md                 the kernel card
    <package>/build/webgpu/manifest.json   op contract: ports, attributes, variants, passes
    <package>/build/webgpu/metadata.json   id, backend, variants -> templates, sha256 digests
    <package>/build/webgpu/test.json       correctness cases (project-defined schema)
    <package>/build/webgpu/bench.json      benchmark and tuning cases (project-defined schema)
    <package>/build/webgpu/*.wgsl.jinja    WGSL templates, one entry point ``main`` each

Digests are standard base64 of the raw SHA-256 of each file's UTF-8 text (what the JS loader's
``btoa(SHA-256(TextEncoder().encode(text)))`` computes). Manifest expressions are Jinja
expressions in ``{{ }}``; a string that is exactly one ``{{ expr }}`` evaluates to the
expression's native value, any other string is rendered and parsed as JSON when possible.
Templates render with ``trim_blocks`` and ``lstrip_blocks``; ``enable f16;`` is prepended when
the source uses ``f16`` without enabling it, and ``env.wgsl.resourceDeclarations`` holds the
``@group(0) @binding(i)`` lines generated from the pass's ``bindings``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from pagedhybrid import dtypes
from pagedhybrid.errors import ContractViolation

MANIFEST_SPEC = "2.1"
TOP_LEVEL_KEYS = frozenset({
    "$schema", "domain", "name", "description", "conformance", "sinceVersion", "inputs",
    "outputs", "args", "attributes", "attributeConstraints", "typeConstraints", "tunables",
    "derive", "when", "requires", "bindings", "variants", "onnx",
})
PORT_KEYS = frozenset({"description", "onnx", "dtype", "rank", "optional", "layout", "shape",
                       "storage", "narrowing"})
LOGICAL_DTYPES = ("float16", "float32", "int8", "int16", "int32", "uint8", "uint32", "bool",
                  "int64")
WGSL_SCALAR = {"float16": "f16", "float32": "f32", "int32": "i32", "uint32": "u32"}
KNOWN_FEATURES = ("shader-f16", "subgroups", "subgroup-size-control",
                  "chromium-experimental-subgroup-matrix", "timestamp-query",
                  "texture-formats-tier1", "texture-formats-tier2")
DEFAULT_PACKAGE = "com.microsoft.PagedAttention"


def repo_kernels_dir() -> Path:
    """``kernels/webgpu`` of the source tree (editable installs); a wheel may carry it as
    ``pagedhybrid/_kernels/webgpu``; ``PAGEDHYBRID_WEBGPU_KERNELS`` overrides both."""
    env = os.environ.get("PAGEDHYBRID_WEBGPU_KERNELS")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    source_tree = here.parents[4] / "kernels" / "webgpu"
    bundled = here.parents[2] / "_kernels" / "webgpu"
    return source_tree if source_tree.is_dir() or not bundled.is_dir() else bundled


def package_dir(op_id: str = DEFAULT_PACKAGE, explicit: str | os.PathLike[str] | None = None
                ) -> Path:
    return Path(explicit) if explicit else repo_kernels_dir() / op_id


def digest(text: str) -> str:
    """base64(SHA-256(UTF-8 text)), the package's digest encoding."""
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


# -- expressions ------------------------------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _pow2ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _numel(shape: list[int]) -> int:
    return math.prod(int(s) for s in shape)


EXPR_FUNCTIONS: dict[str, Any] = {
    "ceil": math.ceil, "floor": math.floor, "min": min, "max": max, "pow": pow,
    "ceilDiv": _ceil_div, "pow2ceil": _pow2ceil,
    "log2ceil": lambda n: max(0, (int(n) - 1).bit_length()), "numel": _numel,
    "dim": lambda shape, i: int(shape[i]), "has": lambda m, k: k in m,
    "dtypeBytes": lambda d: dtypes.itemsize(d, op="manifest expression", where="dtypeBytes"),
    "range": range, "DISPATCH_FOLD_WIDTH": 65535,
}


@functools.cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                              undefined=jinja2.Undefined, autoescape=False)


_WHOLE = re.compile(r"^\s*\{\{(.*)\}\}\s*$", re.S)


@functools.cache
def _compiled(expr: str) -> Any:
    return _env().compile_expression(expr, undefined_to_none=False)


class _Dotted:
    """Read-only attribute view of a dict (``shapes.queryT``) for the fast evaluation path."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, Any]) -> None:
        self._d = d

    def __getattr__(self, name: str) -> Any:
        try:
            v = self._d[name]
        except KeyError:
            raise AttributeError(name) from None
        return _Dotted(v) if isinstance(v, dict) else v

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)

    def __contains__(self, name: object) -> bool:
        return name in self._d


@functools.cache
def _python_code(expr: str) -> Any:
    try:
        return compile(expr, "<manifest expression>", "eval")
    except SyntaxError:
        return None


def _fast(expr: str, scope: Mapping[str, Any]) -> tuple[bool, Any]:
    """Evaluate with Python when the expression is also Python (all of this package's are);
    any failure (undefined name, Jinja-only syntax) falls back to Jinja's exact semantics."""
    code = _python_code(expr)
    if code is None:
        return False, None
    env = {k: _Dotted(v) if isinstance(v, dict) else v for k, v in scope.items()}
    try:
        return True, eval(code, {"__builtins__": {}, **EXPR_FUNCTIONS}, env)
    except Exception:
        return False, None


def evaluate(value: Any, scope: Mapping[str, Any]) -> Any:
    """Evaluate a manifest value: ``"{{ expr }}"`` strings, lists and dicts of them, constants."""
    if isinstance(value, str):
        whole = _WHOLE.match(value)
        if whole and "{{" not in whole.group(1):
            expr = whole.group(1).strip()
            ok, out = _fast(expr, scope)
            if ok:
                return out
            out = _compiled(expr)(**scope, **EXPR_FUNCTIONS)
            return None if isinstance(out, jinja2.Undefined) else out
        if "{{" in value or "{%" in value:
            text = _env().from_string(value).render(**scope, **EXPR_FUNCTIONS)
            try:
                return json.loads(text)
            except ValueError:
                return text
        return value
    if isinstance(value, list):
        return [evaluate(v, scope) for v in value]
    if isinstance(value, dict):
        return {k: evaluate(v, scope) for k, v in value.items()}
    return value


# -- resource declarations and rendering --------------------------------------------------------
def resource_declarations(entries: list[dict[str, Any]]) -> str:
    """The ``@group(0) @binding(i)`` lines (and uniform structs) of resolved binding entries."""
    lines: list[str] = []
    for i, e in enumerate(entries):
        if e["buffer"] == "uniform":
            fields = "\n".join(f"  {f['name']}: {f['type']}," for f in e["struct"])
            lines.append(f"struct {e['structName']} {{\n{fields}\n}}")
            lines.append(f"@group(0) @binding({i}) var<uniform> {e['name']}: {e['structName']};")
        else:
            access = "read" if e["buffer"] == "read-only-storage" else "read_write"
            lines.append(f"@group(0) @binding({i}) var<storage, {access}> {e['name']}: "
                         f"array<{e['elementType']}>;")
    return "\n".join(lines)


def render_template(source: str, context: Mapping[str, Any]) -> str:
    """Render a ``*.wgsl.jinja`` template and apply the loader's post-processing."""
    return finish_wgsl(_env().from_string(source).render(**context, **EXPR_FUNCTIONS))


def finish_wgsl(text: str) -> str:
    """Strip one trailing newline, prepend ``enable f16;`` when needed, drop
    ``enable subgroups;`` (naga implements the builtins without it)."""
    if text.endswith("\n"):
        text = text[:-1]
    uses_f16 = re.search(r"\bf16\b|\d[hH]\b", text) is not None
    if uses_f16 and not re.search(r"^\s*enable\s+f16\s*;", text, re.M):
        text = "enable f16;\n" + text
    return re.sub(r"^\s*enable\s+subgroups\s*;\s*$", "", text, flags=re.M)


class KernelPackage:
    """The files of one package directory, digests verified on load."""

    def __init__(self, root: str | os.PathLike[str], *, verify: bool = True) -> None:
        self.root = Path(root)
        self.build = self.root / "build" / "webgpu"
        if not (self.build / "manifest.json").is_file():
            raise ContractViolation("webgpu-kernel-package", str(self.build),
                                    "must contain manifest.json", "missing")
        self.texts: dict[str, str] = {}
        for p in sorted(self.build.iterdir()):
            if p.is_file():
                self.texts[p.name] = p.read_text(encoding="utf-8")
        self.manifest: dict[str, Any] = json.loads(self.texts["manifest.json"])
        self.metadata: dict[str, Any] = json.loads(self.texts["metadata.json"])
        self.check_structure()
        if verify:
            self.verify_digests()

    @property
    def op_id(self) -> str:
        return f"{self.manifest.get('domain', 'ai.onnx')}.{self.manifest['name']}"

    def _fail(self, where: str, rule: str, got: object = None) -> ContractViolation:
        return ContractViolation(f"webgpu-kernel-package {self.root.name}", where, rule, got)

    def check_structure(self) -> None:
        """The metadata rules the JS loader checks, and the manifest's key sets."""
        m, md = self.manifest, self.metadata
        unknown = set(m) - TOP_LEVEL_KEYS
        if unknown:
            raise self._fail("manifest.json", "has unknown top-level keys", sorted(unknown))
        for side in ("inputs", "outputs"):
            for key, port in m.get(side, {}).items():
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                    raise self._fail(f"{side}.{key}", "must be a WGSL identifier")
                bad = set(port) - PORT_KEYS
                if bad:
                    raise self._fail(f"{side}.{key}", "has unknown port keys", sorted(bad))
        if md.get("name") != self.op_id:
            raise self._fail("metadata.name", f"must equal {self.op_id}", md.get("name"))
        if md.get("backend", {}).get("type") != "webgpu":
            raise self._fail("metadata.backend.type", "must be 'webgpu'", md.get("backend"))
        web = md.get("webgpu", {})
        if web.get("manifestSpec") != MANIFEST_SPEC:
            raise self._fail("metadata.webgpu.manifestSpec", f"must be {MANIFEST_SPEC}",
                             web.get("manifestSpec"))
        variants = {v["id"]: v for v in m["variants"]}
        if set(web.get("variants", {})) != set(variants):
            raise self._fail("metadata.webgpu.variants", "must list exactly the manifest variants",
                             sorted(web.get("variants", {})))
        for vid, files in web["variants"].items():
            shaders = {p["shader"] for p in variants[vid]["passes"]}
            if set(files) != shaders:
                raise self._fail(f"metadata.webgpu.variants.{vid}",
                                 "must list every template its passes render", files)
            for f in files:
                if not (f.endswith(".wgsl") or f.endswith(".wgsl.jinja")) or f not in self.texts:
                    raise self._fail(f"metadata.webgpu.variants.{vid}",
                                     "templates must be .wgsl/.wgsl.jinja files of the package", f)

    def verify_digests(self) -> None:
        d = self.metadata.get("digest", {})
        if d.get("algorithm") != "sha256":
            raise self._fail("metadata.digest.algorithm", "must be 'sha256'", d.get("algorithm"))
        files = d.get("files", {})
        if "manifest.json" not in files:
            raise self._fail("metadata.digest.files", "must include manifest.json")
        for rel, want in files.items():
            if rel not in self.texts or "/" in rel or rel.startswith("."):
                raise self._fail(f"metadata.digest.files.{rel}",
                                 "must name a file of build/webgpu by canonical relative path")
            got = digest(self.texts[rel])
            if got != want:
                raise self._fail(f"metadata.digest.files.{rel}",
                                 "sha256 does not match the file (regenerate with "
                                 "`python -m pagedhybrid.kernels.webgpu.build_package`)", got)
