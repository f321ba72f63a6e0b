"""Run a package's ``test.json`` on the local WebGPU adapter against the torch reference.

Each recipe case builds its inputs (``cases.make_case``), runs the kernel with host caches
(so the in-place update is read back and checked too) and compares ``outputT``, ``keyCacheT`` and
``valueCacheT`` with ``pagedhybrid.ops.paged_attention`` within the file's tolerance; literal
cases compare with their stored expected outputs. Each rejection case must raise its typed error
before any GPU work. Used by ``pagedhybrid kernels test`` and by the pytest suite.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedhybrid import dtypes, errors
from pagedhybrid.kernels.webgpu.cases import make_case, to_onnx_names
from pagedhybrid.kernels.webgpu.loader import WebGpuKernel
from pagedhybrid.kernels.webgpu.package import KernelPackage


class CaseResult(NamedTuple):
    name: str
    kind: str  # "case" | "rejection"
    passed: bool
    variant: str | None
    errors: dict[str, float]  # port -> max abs error
    seconds: float
    detail: str


def reference(inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]
              ) -> dict[str, np.ndarray]:
    """``pagedhybrid.ops.paged_attention`` on copies of the inputs, keyed by bind key."""
    from pagedhybrid.ops.paged_attention import SPEC, paged_attention

    named = to_onnx_names(inputs)
    args = [torch.from_numpy(named[p.name].copy()) if p.name in named else None
            for p in SPEC.inputs]
    out, kc, vc = paged_attention(*args, **attrs)
    return {"outputT": out.numpy(), "keyCacheT": kc.numpy(), "valueCacheT": vc.numpy()}


def _decode(enc: Mapping[str, Any]) -> np.ndarray:
    return np.array(enc["data"], dtype=enc["dtype"]).reshape(enc["shape"])


def _within(got: np.ndarray, want: np.ndarray, tol: Mapping[str, float]) -> tuple[bool, float]:
    if got.shape != want.shape:
        return False, float("inf")
    g, w = got.astype(np.float64), want.astype(np.float64)
    err = float(np.abs(g - w).max(initial=0.0))
    ok = bool(np.all(np.abs(g - w) <= tol["atol"] + tol["rtol"] * np.abs(w)))
    return ok, err


def run_case(kernel: WebGpuKernel, case: Mapping[str, Any],
             tolerance: Mapping[str, Mapping[str, float]]) -> CaseResult:
    if "recipe" in case:
        inputs, attrs = make_case(case["recipe"])
        expected = reference(inputs, attrs)
    else:
        inputs = {k: _decode(v) for k, v in case["inputs"].items()}
        attrs = dict(case["attrs"])
        expected = {k: _decode(v) for k, v in case["expected"].items()}
    call = {k: v.copy() for k, v in inputs.items()}
    t0 = time.perf_counter()
    got = kernel(call, attrs, tunables=case.get("tunables"))
    seconds = time.perf_counter() - t0
    variant = kernel.last.get("variant")
    errs: dict[str, float] = {}
    notes: list[str] = []
    passed = True
    for key, want in expected.items():
        ok, errs[key] = _within(np.asarray(got[key]), want, tolerance[str(want.dtype)])
        if not ok:
            passed = False
            notes.append(f"{key} off by {errs[key]:.2e}")
    for key in ("keyCacheT", "valueCacheT"):
        if got[key] is not call[key]:
            passed = False
            notes.append(f"{key} is not the caller's (in-place) cache")
    want_variant = case.get("expectVariant")
    if want_variant and variant != want_variant:
        passed = False
        notes.append(f"ran variant {variant}, expected {want_variant}")
    return CaseResult(case["name"], "case", passed, variant, errs, seconds, "; ".join(notes))


def edited_call(rej: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inputs and attributes of a rejection case (recipe + edit)."""
    inputs, attrs = make_case(rej["recipe"])
    call: dict[str, Any] = {k: torch.from_numpy(v) for k, v in inputs.items()}
    edit = rej["edit"]
    attrs.update(edit.get("setAttrs", {}))
    for name in edit.get("dropAttrs", []):
        attrs.pop(name, None)
    for key in edit.get("drop", []):
        call.pop(key, None)
    for key, spec in edit.get("bind", {}).items():
        call[key] = torch.zeros(spec["shape"], dtype=dtypes.to_torch(spec["dtype"]))
    for key, dtype in edit.get("cast", {}).items():
        call[key] = call[key].to(dtypes.to_torch(dtype))
    return call, attrs


def run_rejection(kernel: WebGpuKernel, rej: Mapping[str, Any]) -> CaseResult:
    call, attrs = edited_call(rej)
    want = getattr(errors, rej["error"])
    t0 = time.perf_counter()
    try:
        kernel(call, attrs)
    except want as exc:
        return CaseResult(rej["name"], "rejection", True, None, {}, time.perf_counter() - t0,
                          f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a different error type is a failure
        return CaseResult(rej["name"], "rejection", False, None, {}, time.perf_counter() - t0,
                          f"expected {rej['error']}, got {type(exc).__name__}: {exc}")
    return CaseResult(rej["name"], "rejection", False, kernel.last.get("variant"), {},
                      time.perf_counter() - t0, f"expected {rej['error']}, the call succeeded")


def load_tests(package: KernelPackage) -> dict[str, Any]:
    return json.loads(package.texts["test.json"])


def run_tests(package: KernelPackage, progress: Any = None) -> list[CaseResult]:
    spec = load_tests(package)
    kernel = WebGpuKernel(package)
    results = []
    for case in spec["cases"]:
        results.append(run_case(kernel, case, spec["tolerance"]))
        if progress:
            progress(results[-1])
    for rej in spec.get("rejections", []):
        results.append(run_rejection(kernel, rej))
        if progress:
            progress(results[-1])
    return results
