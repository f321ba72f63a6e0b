"""Benchmark the WebGPU package against ONNX Runtime's own WebGPU PagedAttention, same adapter.

For every ``bench.json`` case, in one process: our kernel (caches as ``GpuTensor``, resident on
the device) and ORT's kernel (``onnxruntime-ep-webgpu``, caches as device OrtValues bound in and
out through IOBinding) each run one first call (shader compilation included, reported apart),
``warmup`` calls, then ``iters`` timed calls, alternating between the two call by call so that
a shared, noisy machine loads both alike. A timed call is what a serving step pays: upload
the small inputs (query/key/value, sequence metadata), run every pass, read ``output`` back.
Both outputs are also compared with the torch reference (max abs error) so a fast wrong answer
shows.
Ratios are ORT median / ours (> 1: ours faster).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedhybrid.kernels.webgpu.cases import make_case, to_onnx_names
from pagedhybrid.kernels.webgpu.ort_peer import OrtWebGpuPagedAttention
from pagedhybrid.kernels.webgpu.runner import GpuTensor, gpu


def _ours(kernel: Any, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any],
          tunables: Mapping[str, Any] | None) -> Any:
    bound: dict[str, Any] = dict(inputs)
    bound["keyCacheT"] = GpuTensor.from_numpy(inputs["keyCacheT"])
    bound["valueCacheT"] = GpuTensor.from_numpy(inputs["valueCacheT"])
    return lambda: kernel(bound, attrs, tunables=tunables)["outputT"]


def _interleaved(fns: list[Any], warmup: int, iters: int, max_seconds: float
                 ) -> tuple[list[float], list[list[float]]]:
    """First-call seconds and timed calls of each fn, alternating fns call by call so a shared,
    noisy machine loads them alike."""
    firsts = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        firsts.append(time.perf_counter() - t0)
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + max_seconds
    for _ in range(iters):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        if time.perf_counter() > deadline and len(times[0]) >= 3:
            break
    return firsts, times


def bench_case(kernel: Any, case: Mapping[str, Any], *, with_ort: bool = True,
               tunables: Mapping[str, Any] | None = None, max_seconds: float = 30.0,
               check: bool = True) -> dict[str, Any]:
    inputs, attrs = make_case(case["recipe"])
    tun = {**case.get("tunables", {}), **(tunables or {})}
    warmup, iters = int(case.get("warmup", 2)), int(case.get("iters", 10))
    row: dict[str, Any] = {"name": case["name"], "kind": case.get("kind", ""),
                           "tunables": tun}
    compiles0, compile_s0 = gpu().compiles, gpu().compile_seconds
    fns = [_ours(kernel, inputs, attrs, tun)]
    if with_ort:
        t0 = time.perf_counter()
        peer = OrtWebGpuPagedAttention(to_onnx_names(inputs), attrs)
        row["ort_session_ms"] = (time.perf_counter() - t0) * 1e3
        fns.append(peer)
    firsts, times = _interleaved(fns, warmup, iters, max_seconds)
    row.update(variant=kernel.last.get("variant"), ours_first_ms=firsts[0] * 1e3,
               ours_ms=statistics.median(times[0]) * 1e3, ours_min_ms=min(times[0]) * 1e3,
               iters=len(times[0]), pipelines_compiled=gpu().compiles - compiles0,
               pipeline_create_ms=(gpu().compile_seconds - compile_s0) * 1e3)
    expected = reference_output(inputs, attrs) if check else None
    if expected is not None:
        row["ours_max_err"] = _max_err(fns[0](), expected)
    if with_ort:
        row.update(ort_first_ms=firsts[1] * 1e3, ort_ms=statistics.median(times[1]) * 1e3,
                   ort_min_ms=min(times[1]) * 1e3)
        row["ratio_ort_over_ours"] = row["ort_ms"] / row["ours_ms"]
        if expected is not None:
            row["ort_max_err"] = _max_err(fns[1](), expected)
    return row


def _max_err(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float32) - expected).max(initial=0.0))


def reference_output(inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> np.ndarray:
    """``output`` of the torch reference (pagedhybrid.ops.paged_attention) for the case."""
    import torch

    from pagedhybrid.ops.paged_attention import SPEC, paged_attention

    named = to_onnx_names(inputs)
    args = [torch.from_numpy(named[p.name].copy()) if p.name in named else None
            for p in SPEC.inputs]
    return paged_attention(*args, **attrs)[0].float().numpy()


def run_bench(package: Any, cases: list[Mapping[str, Any]], *, with_ort: bool = True,
              tune: bool = False, only: list[str] | None = None,
              progress: Any = None) -> dict[str, Any]:
    """Every case (optionally its ``tuning`` sweep) -> a JSON-able report."""
    from pagedhybrid.kernels.webgpu.loader import WebGpuKernel

    kernel = WebGpuKernel(package)
    rows, tuning = [], []
    for case in cases:
        if only and case["name"] not in only:
            continue
        row = bench_case(kernel, case, with_ort=with_ort)
        rows.append(row)
        if progress:
            progress(row)
        if tune:
            for name, values in case.get("tuning", {}).items():
                for v in values:
                    t = bench_case(kernel, case, with_ort=False, tunables={name: v}, check=False)
                    tuning.append({"case": case["name"], "tunable": name, "value": v,
                                   "ours_ms": t["ours_ms"], "variant": t["variant"]})
    ctx = gpu()
    return {"adapter": {k: ctx.info.get(k) for k in ("device", "description", "backend_type",
                                                    "adapter_type")},
            "cases": rows, "tuning": tuning}
