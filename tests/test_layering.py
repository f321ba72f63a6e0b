"""The layers of DESIGN.md, checked: imports only point down, no module-level import cycles, and
each layer package imports alone without loading a later layer.

Layer order (DESIGN.md): errors -> ops -> kernels -> attention -> models -> engine -> serve ->
export -> cli. Modules DESIGN.md does not name are placed here explicitly: ``dtypes`` and
``kvquant`` (element-type tables and the KV quantization rule, on ``errors`` only) sit with
``errors``, and so do ``weightquant`` (the weights' int8 / int4 formats, on ``errors``) and
``openmp`` (OpenMP's spin, set before torch loads: imports nothing of the package);
``parallel`` (context and tensor parallelism over torch.distributed, as DESIGN.md
puts it) with ``attention``; the root package ``pagedhybrid`` re-exports the engine and ``LLM``
(``serve``);
the command-line tools ``conformance``, ``calibrate_kv``, ``perplexity`` and ``__main__`` with
``cli``.

Rules, from a static scan (``ast``) of ``src/pagedhybrid``:

* every import -- at module level, inside a function (lazy) or under ``TYPE_CHECKING`` --
  names a module of the same or an earlier layer: lazy imports are allowed (for optional
  dependencies and start-up time) but never upward, so no cycle can run through a later layer;
* inside ``engine``, the sub-packages are layers too (vLLM v1's concepts, issue 52), in the order
  ``ENGINE_LAYERS``: ``sample`` (sampling parameters, the sampler, grammars) -> ``core``
  (requests, scheduler, pages and slots, configs, memory plan, outputs) -> ``spec_decode``
  (proposers, draft budget, verification) -> ``worker`` (the runner, the step's sampling,
  tensor-parallel ranks) -> the package itself (``engine.py``: the loop, ``loader.py``);
* the imports executed at module import (module level, outside ``TYPE_CHECKING``) form no cycle
  between modules.

And at run time, each layer's modules are imported in a fresh interpreter (``python -c``) with
nothing else, and no module of a later layer may have been loaded. Below ``engine`` the root
package is replaced by a bare namespace for this, because ``pagedhybrid/__init__.py`` imports
the engine (every ``import pagedhybrid.x`` runs it); from ``engine`` on, the real one is used.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pagedhybrid"
LAYERS = ("errors", "ops", "kernels", "attention", "models", "engine", "serve", "export", "cli")
EXACT = {
    "pagedhybrid": "serve",
    "pagedhybrid.__main__": "cli",
}
PREFIX = {
    "pagedhybrid.errors": "errors", "pagedhybrid.dtypes": "errors",
    "pagedhybrid.kvquant": "errors", "pagedhybrid.weightquant": "errors",
    "pagedhybrid.openmp": "errors",
    "pagedhybrid.ops": "ops", "pagedhybrid.kernels": "kernels",
    "pagedhybrid.attention": "attention", "pagedhybrid.parallel": "attention",
    "pagedhybrid.models": "models", "pagedhybrid.engine": "engine", "pagedhybrid.serve": "serve",
    "pagedhybrid.export": "export", "pagedhybrid.cli": "cli", "pagedhybrid.conformance": "cli",
    "pagedhybrid.calibrate_kv": "cli", "pagedhybrid.perplexity": "cli",
}
PACKAGES = {"errors": "pagedhybrid.errors", "ops": "pagedhybrid.ops",
            "kernels": "pagedhybrid.kernels", "attention": "pagedhybrid.attention",
            "models": "pagedhybrid.models", "engine": "pagedhybrid.engine",
            "serve": "pagedhybrid.serve", "export": "pagedhybrid.export", "cli": "pagedhybrid.cli"}


def layer_of(module: str) -> str:
    if module in EXACT:
        return EXACT[module]
    best = max((p for p in PREFIX if module == p or module.startswith(p + ".")), key=len,
               default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: place it in tests/test_layering.py")
    return PREFIX[best]


def rank(module: str) -> int:
    return LAYERS.index(layer_of(module))


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    where: str  # "module" (runs at import) | "function" (lazy) | "type_checking"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def scan(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import of ``pagedhybrid`` modules in ``module``, with where it runs."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            return [t for n in names if n.split(".")[0] == "pagedhybrid"
                    and (t := _resolve(n, known))]
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if mod.split(".")[0] != "pagedhybrid":
            return []
        out = []
        for a in node.names:
            sub = f"{mod}.{a.name}"
            t = sub if sub in known else _resolve(mod, known)
            if t:
                out.append(t)
        return out

    def visit(nodes: list[ast.stmt], where: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.extend(Import(module, t, node.lineno, where) for t in targets(node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "function" if where == "module" else where)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "type_checking")
                visit(node.orelse, where)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], where)
                    elif isinstance(child, ast.excepthandler):
                        visit(child.body, where)
                    elif isinstance(child, ast.Lambda | ast.expr):
                        continue

    visit(ast.parse(path.read_text(), str(path)).body, "module")
    return [i for i in found if i.target != module]


def all_imports() -> list[Import]:
    known = modules()
    return [i for m, p in known.items() for i in scan(m, p, known)]


ENGINE_LAYERS = ("sample", "core", "spec_decode", "worker", "")


def engine_rank(module: str) -> int:
    """Where an ``engine`` module sits among ``ENGINE_LAYERS`` ("": the package's own modules)."""
    parts = module.removeprefix("pagedhybrid.engine").lstrip(".").split(".")
    if parts[0] in ENGINE_LAYERS:
        return ENGINE_LAYERS.index(parts[0])
    if len(parts) == 1:
        return ENGINE_LAYERS.index("")
    raise AssertionError(f"{module}: in no engine sub-package of {ENGINE_LAYERS}")


def test_every_module_has_a_layer() -> None:
    for m in modules():
        layer_of(m)


def test_imports_only_point_to_the_same_or_an_earlier_layer() -> None:
    known = modules()
    bad = [f"{known[i.source].relative_to(SRC)}:{i.line} ({layer_of(i.source)}) imports "
           f"{i.target} ({layer_of(i.target)}) [{i.where}]"
           for i in all_imports() if rank(i.target) > rank(i.source)]
    assert not bad, "imports of a later layer:\n" + "\n".join(bad)


def test_engine_sub_packages_import_only_downward() -> None:
    known = modules()
    engine = [m for m in known if layer_of(m) == "engine" and m != "pagedhybrid"]
    bad = [f"{known[i.source].relative_to(SRC)}:{i.line} imports {i.target} [{i.where}]"
           for i in all_imports() if i.source in engine and i.target in engine
           and engine_rank(i.target) > engine_rank(i.source)]
    assert not bad, "imports of a later engine sub-package:\n" + "\n".join(bad)
    assert engine_rank("pagedhybrid.engine.core.scheduler") < engine_rank(
        "pagedhybrid.engine.worker.runner") < engine_rank("pagedhybrid.engine.engine")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_at_module_level() -> None:
    edges: dict[str, set[str]] = {m: set() for m in modules()}
    for i in all_imports():
        if i.where == "module":
            edges[i.source].add(i.target)
    assert _cycles(edges) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


_PROBE = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
names = json.loads(sys.argv[2])
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(n for n in sys.modules if n.split(".")[0] == "pagedhybrid")))
"""


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_alone_without_a_later_layer(layer: str) -> None:
    names = [m for m in modules() if layer_of(m) == layer and m != "pagedhybrid"]
    assert PACKAGES[layer] in names
    done = subprocess.run([sys.executable, "-c", _PROBE, str(SRC), json.dumps(names)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    later = [m for m in loaded if m != "pagedhybrid" and rank(m) > LAYERS.index(layer)]
    assert not later, f"importing the {layer} layer alone loaded later layers: {later}"


def test_the_root_package_loads_the_engine_only_when_asked() -> None:
    probe = ("import sys, pagedhybrid; a = sorted(m for m in sys.modules if m.startswith("
             "'pagedhybrid.')); e = pagedhybrid.Engine; print(a, e.__module__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=600, check=True)
    loaded, where = done.stdout.strip().rsplit(" ", 1)
    assert loaded == "['pagedhybrid.errors', 'pagedhybrid.openmp']", done.stdout
    assert where == "pagedhybrid.engine.engine", done.stdout
