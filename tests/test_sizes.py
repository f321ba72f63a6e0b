"""The house's size limits, checked (issue 52): no source file of ``src/pagedhybrid`` over
``MAX_FILE_LINES`` lines (Python and C++ alike) and no Python function over ``MAX_FUNCTION_LINES``
lines (a nested function counts on its own and inside its parent).

A ratchet: ``FILES`` and ``FUNCTIONS`` list today's offenders with their sizes now. An offender
may shrink, never grow; one that is within the limit must leave the list (so the list only ever
gets shorter); anything else over a limit fails, naming it. Data files (JSON, the built-in model)
are not source and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "pagedhybrid"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SOURCE = (".py", ".cpp", ".h")

# today's offenders (path under src/pagedhybrid -> lines): shrink them, never add one
FILES: dict[str, int] = {}
FUNCTIONS: dict[str, int] = {}


def file_sizes() -> dict[str, int]:
    return {str(f.relative_to(PKG)): len(f.read_text(encoding="utf-8").splitlines())
            for f in sorted(PKG.rglob("*")) if f.suffix in SOURCE and "_build" not in f.parts}


def function_sizes() -> dict[str, int]:
    """Every function's lines, named ``path::Class.function.nested``."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                out[f"{where}::{name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                walk(child, where, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, where, prefix + child.name + ".")

    for f in sorted(PKG.rglob("*.py")):
        walk(ast.parse(f.read_text(encoding="utf-8")), str(f.relative_to(PKG)), "")
    return out


def ratchet(sizes: dict[str, int], known: dict[str, int], limit: int, what: str) -> list[str]:
    problems = []
    for name, n in sizes.items():
        if n > limit and name not in known:
            problems.append(f"{what} {name}: {n} lines > {limit} (split it by concept)")
        elif name in known and n > known[name]:
            problems.append(f"{what} {name}: {n} lines, grew past its recorded {known[name]} "
                            f"(it is over {limit}: shrink it)")
        elif name in known and n <= limit:
            problems.append(f"{what} {name}: {n} lines, within {limit} now: remove it from the "
                            "list of offenders")
    problems += [f"{what} {name}: listed as an offender but gone: remove it from the list"
                 for name in known if name not in sizes]
    return problems


def test_no_new_file_over_the_limit_and_none_grows() -> None:
    problems = ratchet(file_sizes(), FILES, MAX_FILE_LINES, "file")
    assert not problems, "\n".join(problems)


def test_no_new_function_over_the_limit_and_none_grows() -> None:
    problems = ratchet(function_sizes(), FUNCTIONS, MAX_FUNCTION_LINES, "function")
    assert not problems, "\n".join(problems)


def test_the_ratchet_catches_each_case() -> None:
    known = {"a.py": 700, "b.py": 650, "gone.py": 900}
    sizes = {"a.py": 701, "b.py": 600, "c.py": 601, "d.py": 600}
    problems = ratchet(sizes, known, 600, "file")
    assert len(problems) == 4
    assert any("a.py: 701 lines, grew" in p for p in problems)
    assert any("b.py: 600 lines, within" in p for p in problems)
    assert any("c.py: 601 lines > 600" in p for p in problems)
    assert any("gone.py" in p for p in problems)
    sizes = function_sizes()
    assert 1 <= sizes["ops/gated_delta_net.py::validate_call"] <= MAX_FUNCTION_LINES
    assert "attention/contract.py::ShardingSpec.__post_init__" in sizes  # Class.method names
    assert all(n >= 1 for n in sizes.values()) and len(sizes) > 1000
