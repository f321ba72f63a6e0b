"""``pagedhybrid kernels select | test | bench``: the kernel registry's choice for given needs
(``kernels.backend.select_main``); run a WebGPU kernel package's test.json / bench.json.

``register_subcommands(subparsers)`` adds the ``kernels`` command (``select``, ``test``, ``bench``)
to the top-level parser; each sets ``func(args) -> int``. ``kernels_test`` and ``kernels_bench``
are the plain-function entry points (exit codes: 0 ok, 1 failures, 2 no usable adapter).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedhybrid.errors import UnsupportedConfiguration


def _console() -> Any:
    from rich.console import Console

    return Console(width=max(Console().width, 150))


def _adapter_line() -> str:
    from pagedhybrid.kernels.webgpu.runner import gpu

    ctx = gpu()
    return (f"adapter: {ctx.info.get('device')} | {ctx.info.get('description')} | "
            f"{ctx.info.get('backend_type')} | {ctx.info.get('adapter_type')} | features: "
            f"{', '.join(sorted(ctx.features))}")


def kernels_test(package_dir: str | None) -> int:
    """Run test.json of the package (default: the repo's PagedAttention package)."""
    from rich.table import Table

    from pagedhybrid.kernels.webgpu.package import KernelPackage
    from pagedhybrid.kernels.webgpu.package import package_dir as default_dir
    from pagedhybrid.kernels.webgpu.testsuite import run_tests

    console = _console()
    pkg = KernelPackage(default_dir(explicit=package_dir))
    try:
        console.print(_adapter_line())
    except UnsupportedConfiguration as exc:
        console.print(f"[red]{exc}")
        return 2
    results = run_tests(pkg)
    table = Table(title=f"{pkg.op_id}: test.json on WebGPU vs pagedhybrid.ops.paged_attention")
    for col in ("case", "variant", "output err", "cache err", "ms", "result"):
        table.add_column(col)
    for r in results:
        out_err = f"{r.errors['outputT']:.1e}" if "outputT" in r.errors else ""
        cache = max((v for k, v in r.errors.items() if k != "outputT"), default=None)
        verdict = "[green]pass" if r.passed else f"[red]FAIL {r.detail}"[:200]
        if r.passed and r.kind == "rejection":
            verdict = f"[green]rejected[/] {r.detail.split(':')[0]}"
        table.add_row(r.name, r.variant or "", out_err,
                      "" if cache is None else f"{cache:.1e}", f"{r.seconds * 1e3:.0f}", verdict)
    console.print(table)
    failed = sum(not r.passed for r in results)
    console.print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed or not results else 0


def kernels_bench(package_dir: str | None, json_out: str | None, *, with_ort: bool = True,
                  tune: bool = False, only: list[str] | None = None) -> int:
    """Run bench.json: our kernel and ORT's WebGPU PagedAttention on the same adapter."""
    from rich.table import Table

    from pagedhybrid.kernels.webgpu.bench import run_bench
    from pagedhybrid.kernels.webgpu.package import KernelPackage
    from pagedhybrid.kernels.webgpu.package import package_dir as default_dir

    console = _console()
    pkg = KernelPackage(default_dir(explicit=package_dir))
    try:
        console.print(_adapter_line())
    except UnsupportedConfiguration as exc:
        console.print(f"[red]{exc}")
        return 2
    cases = json.loads(pkg.texts["bench.json"])["cases"]

    def progress(row: dict[str, Any]) -> None:
        console.print(f"  {row['name']}: ours {row['ours_ms']:.2f} ms"
                      + (f", ORT {row['ort_ms']:.2f} ms" if "ort_ms" in row else ""))

    report = run_bench(pkg, cases, with_ort=with_ort, tune=tune, only=only, progress=progress)
    table = Table(title=f"{pkg.op_id}: WebGPU package vs ONNX Runtime WebGPU (same adapter); "
                        "steady-state medians, first call apart")
    cols = ["case", "variant", "ours ms", "ours first ms"]
    if with_ort:
        cols += ["ORT ms", "ORT first ms", "ORT/ours", "ours err", "ORT err"]
    for col in cols:
        table.add_column(col)
    for r in report["cases"]:
        cells = [r["name"], r["variant"] or "", f"{r['ours_ms']:.2f}", f"{r['ours_first_ms']:.0f}"]
        if with_ort:
            cells += [f"{r['ort_ms']:.2f}", f"{r['ort_first_ms']:.0f}",
                      f"{r['ratio_ort_over_ours']:.2f}x", f"{r.get('ours_max_err', 0):.1e}",
                      f"{r.get('ort_max_err', 0):.1e}"]
        table.add_row(*cells)
    console.print(table)
    if report["tuning"]:
        tt = Table(title="tuning sweep (ours, steady median ms)")
        for col in ("case", "tunable", "value", "variant", "ms"):
            tt.add_column(col)
        for t in report["tuning"]:
            tt.add_row(t["case"], t["tunable"], str(t["value"]), t["variant"] or "",
                       f"{t['ours_ms']:.2f}")
        console.print(tt)
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")
    return 0


def register_subcommands(subparsers: Any) -> None:
    """Add ``kernels test`` and ``kernels bench`` under a ``kernels`` command."""
    k = subparsers.add_parser("kernels", help="the kernel registry's choice; WebGPU kernel "
                              "packages: test and benchmark")
    ksub = k.add_subparsers(dest="kernels_command", required=True)
    from pagedhybrid.kernels import backend

    sel = ksub.add_parser("select", help="which kernel bundle serves these needs, and why not "
                          "the others (the one kernel registry)")
    backend.add_select_arguments(sel)
    sel.set_defaults(func=backend.select_main)
    t = ksub.add_parser("test", help="run the package's test.json on the local WebGPU adapter")
    t.add_argument("--package", default=None,
                   help="package directory (default: kernels/webgpu/com.microsoft.PagedAttention)")
    t.set_defaults(func=lambda a: kernels_test(a.package))
    b = ksub.add_parser("bench", help="run bench.json beside ONNX Runtime's WebGPU kernel")
    b.add_argument("--package", default=None, help="package directory")
    b.add_argument("--json", dest="json_out", default=None, help="write the report here")
    b.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime's kernel")
    b.add_argument("--tune", action="store_true", help="also sweep each case's tuning values")
    b.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    b.set_defaults(func=lambda a: kernels_bench(a.package, a.json_out, with_ort=not a.no_ort,
                                                tune=a.tune, only=a.case))


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m pagedhybrid.kernels.webgpu.cli test|bench``."""
    p = argparse.ArgumentParser(prog="pagedhybrid")
    register_subcommands(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(["kernels", *(argv or [])] if argv is not None else None)
    return int(ns.func(ns))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
