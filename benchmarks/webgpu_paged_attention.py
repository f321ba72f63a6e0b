"""WebGPU PagedAttention package vs ONNX Runtime's own WebGPU PagedAttention, same adapter.

Runs the package's ``bench.json`` (decode with long contexts, prefill, a mixed batch) through
``pagedhybrid.kernels.webgpu.cli.kernels_bench``: for each case our kernel (caches resident as
``GpuTensor``) and ``onnxruntime-ep-webgpu``'s kernel (caches resident as device OrtValues,
aliased in/out through IOBinding) run in one process on the same adapter, alternating call by
call. A timed call uploads the small inputs, runs every pass and reads ``output`` back. First
calls (shader compilation) are reported apart from steady-state medians; both outputs are
checked against the torch reference. Not a test: no assertions on timings.

    python benchmarks/webgpu_paged_attention.py                 # table + JSON
    python benchmarks/webgpu_paged_attention.py --tune --no-ort # our tunable sweep only
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    from pagedhybrid.kernels.webgpu.cli import kernels_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=None, help="package directory")
    ap.add_argument("--out", default="webgpu_paged_attention.json", help="JSON report path")
    ap.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime's kernel")
    ap.add_argument("--tune", action="store_true", help="sweep each case's tuning values")
    ap.add_argument("--case", action="append", default=None, help="only this case")
    ns = ap.parse_args(argv)
    return kernels_bench(ns.package, ns.out, with_ort=not ns.no_ort, tune=ns.tune, only=ns.case)


if __name__ == "__main__":
    sys.exit(main())
