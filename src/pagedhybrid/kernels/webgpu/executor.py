"""Execute a manifest's variant: pick it, derive its values, render its passes, bind and dispatch.

Given the expression scope of one call (``shapes``, ``ranks``, ``dtypes``, ``logicalDtypes``,
``present``, ``args``, ``attrs``, ``tunables``, ``device``) and the call's device buffers:

1. the manifest ``derive`` entries are evaluated in order into ``derive``;
2. the variant with the highest ``priority`` whose ``when`` clauses all hold and whose
   ``requires.features`` the device has is chosen; its own ``derive`` entries are added;
3. every pass's ``bindings`` are resolved in listed order: port entries whose optional port is
   absent are left out (binding indices stay dense), ``scratch`` entries get pooled intermediates
   of the variant's ``intermediates`` shapes, uniform entries get their ``struct`` values packed;
4. each template is rendered with ``env.wgsl.resourceDeclarations`` generated from those
   bindings, compiled once per source text, and dispatched (``threads``/``workgroupSize`` and
   ``workgroups`` shorthands fold into x = min(n, 65535), y = ceilDiv(n, 65535)).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jinja2
import numpy as np

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.webgpu import runner
from pagedhybrid.kernels.webgpu.package import (
    WGSL_SCALAR,
    KernelPackage,
    evaluate,
    finish_wgsl,
    resource_declarations,
)

FOLD = 65535
# uniform struct fields are one 32-bit word each: WGSL scalar name -> numpy type
_STRUCT_NP = {WGSL_SCALAR[n]: dtypes.numpy_dtype(n) for n in ("uint32", "int32", "float32")}


class Plan(NamedTuple):
    variant: str
    dispatches: list[runner.Dispatch]
    sources: dict[str, str]  # pass id -> rendered WGSL


def _fold(n: int) -> tuple[int, int, int]:
    n = int(n)
    return (min(n, FOLD), -(-n // FOLD), 1) if n > 0 else (0, 1, 1)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "0", "none")
    return bool(value)


def evaluate_derive(entries: Mapping[str, Any], scope: dict[str, Any]) -> None:
    derive = scope.setdefault("derive", {})
    for name, expr in entries.items():
        derive[name] = evaluate(expr, scope)


def choose_variant(pkg: KernelPackage, scope: dict[str, Any],
                   features: frozenset[str]) -> dict[str, Any]:
    reasons: list[str] = []
    for v in sorted(pkg.manifest["variants"], key=lambda v: -v.get("priority", 0)):
        need = set(v.get("requires", {}).get("features", []))
        if not need <= features:
            reasons.append(f"{v['id']}: device lacks {sorted(need - features)}")
            continue
        failed = [w for w in v.get("when", []) if not _truthy(evaluate(w, scope))]
        if failed:
            reasons.append(f"{v['id']}: {failed[0]} is false")
            continue
        return v
    raise UnsupportedConfiguration(
        f"{pkg.op_id}: no kernel variant serves this call ({'; '.join(reasons)})")


@functools.lru_cache(maxsize=64)
def _compiled_template(text: str) -> jinja2.Template:
    from pagedhybrid.kernels.webgpu.package import EXPR_FUNCTIONS, _env

    return _env().from_string(text, globals=EXPR_FUNCTIONS)


def _render(text: str, context: Mapping[str, Any]) -> str:
    return finish_wgsl(_compiled_template(text).render(**context))


def pack_struct(fields: list[dict[str, Any]], scope: Mapping[str, Any]) -> np.ndarray:
    words = np.zeros(max(4, -(-len(fields) // 4) * 4), np.uint32)
    for i, f in enumerate(fields):
        value = evaluate(f["value"], scope) if "value" in f else scope["args"].get(
            f["name"], f.get("default", 0))
        words[i : i + 1] = np.array([value], _STRUCT_NP[f["type"]]).view(np.uint32)
    return words


def _check_limits(pkg: KernelPackage, pass_id: str, wg: tuple[int, int, int],
                  bufs: list[Any]) -> None:
    limits = runner.gpu().limits
    most = limits.get("max-compute-workgroups-per-dimension", FOLD)
    if max(wg) > most:
        raise UnsupportedConfiguration(
            f"{pkg.op_id}: pass {pass_id} needs {list(wg)} workgroups, above this device's "
            f"{most} per dimension; split the batch into smaller calls")
    biggest = limits.get("max-storage-buffer-binding-size", 1 << 27)
    for b in bufs:
        if b.size > biggest:
            raise UnsupportedConfiguration(
                f"{pkg.op_id}: pass {pass_id} binds a {b.size}-byte buffer, above this "
                f"device's max-storage-buffer-binding-size ({biggest}); use fewer KV blocks "
                "per cache tensor")


def plan(pkg: KernelPackage, scope: dict[str, Any], buffers: Mapping[str, Any],
         pool: runner.BufferPool, features: frozenset[str]) -> Plan:
    """Choose the variant and resolve every pass into a ready dispatch.

    ``buffers`` maps every present port (inputs and outputs, by bind key) to its device buffer.
    """
    manifest = pkg.manifest
    ports = {**manifest["inputs"], **manifest["outputs"]}
    variant = choose_variant(pkg, scope, features)
    evaluate_derive(variant.get("derive", {}), scope)
    scratch: dict[str, Any] = {}
    for inter in variant.get("intermediates", []):
        shape = [int(s) for s in evaluate(inter["shape"], scope)]
        nbytes = int(np.prod(shape)) * dtypes.itemsize(inter["dtype"])
        scratch[inter["id"]] = pool.buffer(f"scratch:{inter['id']}", nbytes)
    dispatches: list[runner.Dispatch] = []
    sources: dict[str, str] = {}
    for p in variant["passes"]:
        entries: list[dict[str, Any]] = []
        bufs: list[Any] = []
        for e in p["bindings"]:
            entry = dict(e)
            if "scratch" in e:
                entry["name"] = e["scratch"]
                bufs.append(scratch[e["scratch"]])
            elif e["buffer"] == "uniform":
                words = pack_struct(e["struct"], scope)
                buf = pool.buffer(f"uniform:{p['id']}", words.nbytes, uniform=True)
                runner.write_buffer(buf, words)
                bufs.append(buf)
            else:
                name = e["name"]
                if name not in buffers:
                    if name in ports and ports[name].get("optional"):
                        continue  # absent optional port: no binding
                    raise UnsupportedConfiguration(
                        f"{pkg.op_id}: pass {p['id']} binds {name!r}, which this call lacks")
                if "elementType" not in entry:
                    entry["elementType"] = WGSL_SCALAR[scope["logicalDtypes"][name]]
                bufs.append(buffers[name])
            entries.append(entry)
        context = {**scope, "env": {**scope.get("env", {}), "wgsl": {
            "resourceDeclarations": resource_declarations(entries)}}}
        source = _render(pkg.texts[p["shader"]], context)
        pipe, layout = runner.pipeline(source, entries)
        d = p["dispatch"]
        if "threads" in d:
            groups = -(-int(evaluate(d["threads"], scope)) // int(evaluate(d["workgroupSize"],
                                                                           scope)))
            wg = _fold(groups)
        elif "workgroups" in d:
            wg = _fold(int(evaluate(d["workgroups"], scope)))
        else:
            wg = (int(evaluate(d["x"], scope)), int(evaluate(d.get("y", 1), scope)),
                  int(evaluate(d.get("z", 1), scope)))
        _check_limits(pkg, p["id"], wg, bufs)
        dispatches.append(runner.Dispatch(p["id"], pipe, pool.bind_group(layout, bufs), wg))
        sources[p["id"]] = source
    return Plan(variant["id"], dispatches, sources)
