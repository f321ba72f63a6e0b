"""Command line: ``pagedhybrid run | generate | serve | perplexity | export | verify |
conformance | kernels | dispatch``; ``pagedhybrid --version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _conformance(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from pagedhybrid import conformance as conf

    if args.write_cases:
        conf.write_cases(args.cases or conf.CASES_FILE)
        print(f"wrote {args.cases or conf.CASES_FILE}")
        return 0
    cases = conf.load_cases(args.cases) if args.cases else conf.load_cases()
    backends = conf.BACKENDS if args.backend == "all" else (args.backend,)
    console = Console(width=max(Console().width, 150))
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("conformance", total=len(cases))
        results = conf.run(cases, backends, progress=lambda: bar.advance(task))
    table = Table(title="pagedhybrid conformance: implementations vs the float64 reference")
    for col in ("case", "shapes", "backend", "max error", "tolerance", "result"):
        table.add_column(col)
    for r in results:
        verdict = "[green]pass" if r.passed else f"[red]FAIL {r.error}"[:200]
        table.add_row(r.case.id, r.shapes, r.backend, f"{r.max_error:.2e}",
                      f"{r.tolerance:.0e}", verdict)
    console.print(table)
    failed = sum(not r.passed for r in results)
    console.print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed or not results else 0


def version_text() -> str:
    """``pagedhybrid --version``: the package's version, torch's, and the native kernels: the
    form this CPU runs (or why none loads) and the forms built (in the package, or in
    ``src/`` by ``make native``)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from pagedhybrid.kernels import native

    try:
        ours = version("pagedhybrid")
    except PackageNotFoundError:
        ours = "(not installed)"
    st = native.status()
    built = [f for f in native.FORMS if native.library_path(f).is_file()]
    return (f"pagedhybrid {ours}\ntorch {torch.__version__}\n"
            f"native kernels: {native.cpu_form()}\n"
            f"native forms built: {', '.join(built) or 'none'} (in {native.BUILD_DIR})"
            + (f"\nloaded: {native.library_path(st.isa)}" if st.available else ""))


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version, torch's and "
                         "the native kernels' CPU form, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedhybrid", description=__doc__)
    p.add_argument("-V", "--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("conformance", help="run the operator conformance cases")
    c.add_argument("--backend", choices=("reference", "onnxruntime", "all"), default="all")
    c.add_argument("--cases", help="cases JSON file (default: the one shipped with the package)")
    c.add_argument("--write-cases", action="store_true",
                   help="regenerate the cases file from the OpSpecs and exit")
    c.set_defaults(func=_conformance)

    from pagedhybrid.serve import offline_cli as engine_cli

    r = sub.add_parser("run", help="the main job: the default model serving overlapping requests")
    engine_cli.add_run_arguments(r)
    r.set_defaults(func=engine_cli.run_main)
    g = sub.add_parser("generate", help="generate text for prompts with the engine")
    engine_cli.add_generate_arguments(g)
    g.set_defaults(func=engine_cli.generate_main)

    from pagedhybrid.attention.cli import register_subcommands as dispatch_commands

    dispatch_commands(sub)
    from pagedhybrid.kernels.webgpu.cli import register_subcommands as kernels_commands

    kernels_commands(sub)
    from pagedhybrid.export.cli import register_subcommands as export_commands

    export_commands(sub)
    from pagedhybrid.perplexity import register_subcommands as perplexity_commands

    perplexity_commands(sub)
    from pagedhybrid.serve.cli import register_subcommands as serve_commands

    serve_commands(sub)
    from pagedhybrid import calibrate_kv

    calibrate_kv.add_arguments(sub.add_parser(
        "calibrate-kv", help="static K/V scales for int8 / fp8 KV pages from a text"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
