"""Conformance cases of the operator contracts, run against every available implementation.

Cases are derived from the OpSpecs: each op module's ``conformance_recipes()`` crossed with the
element types its ``SPEC`` accepts for the activation type ``T`` (float32, float16). A backend is
listed on a case when it takes that dtype and the recipe does not exclude it. The derived list is
kept under version control (``conformance_cases.json``); a test regenerates and compares it.

Truth and tolerances: every backend's outputs (including in-place caches and states) are compared
with the reference run on the same inputs upcast to float64 (a separate, higher-precision run of
the same contract). fp32 must agree to ``1e-5`` and fp16 to ``2e-3`` max abs error; bf16 to 2e-2.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagedhybrid import dtypes
from pagedhybrid.ops import OP_MODULES, op_module

CASES_FILE = Path(__file__).with_name("conformance_cases.json")
CASE_DTYPES = ("float", "float16")
TOLERANCE = {"float": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
BACKENDS = ("reference", "onnxruntime")


class Case(NamedTuple):
    op: str  # qualified op name, e.g. com.microsoft.GatedDeltaNet
    name: str
    dtype: str  # ONNX element type name of T
    seed: int
    recipe: dict[str, Any]
    backends: list[str]

    @property
    def id(self) -> str:
        return f"{self.op.split('.')[-1]}/{self.name}/{self.dtype}"


class Result(NamedTuple):
    case: Case
    backend: str
    shapes: str
    max_error: float
    tolerance: float
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and self.max_error <= self.tolerance


def _ort_module(op: str) -> Any:
    return importlib.import_module(OP_MODULES[op].replace(".ops.", ".kernels.onnxruntime."))


def derive_cases() -> list[Case]:
    """The conformance cases implied by the OpSpecs and the ops' recipes."""
    cases: list[Case] = []
    for op in OP_MODULES:
        mod, ort_mod = op_module(op), _ort_module(op)
        accepted = mod.SPEC.constraint("T").accepted
        ort_dtypes = set(ort_mod.DTYPES)
        for i, recipe in enumerate(mod.conformance_recipes()):
            for dtype in CASE_DTYPES:
                if dtype not in accepted:
                    continue
                allowed = recipe.get("backends", list(BACKENDS))
                backends = ["reference"]
                if "onnxruntime" in allowed and dtypes.to_torch(dtype) in ort_dtypes:
                    backends.append("onnxruntime")
                cases.append(Case(op, recipe["name"], dtype, 1000 + i, recipe, backends))
    return cases


def write_cases(path: Path = CASES_FILE) -> None:
    path.write_text(json.dumps([c._asdict() for c in derive_cases()], indent=1) + "\n")


def load_cases(path: Path = CASES_FILE) -> list[Case]:
    return [Case(**c) for c in json.loads(Path(path).read_text())]


def _clone(xs: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if x is None else x.clone() for x in xs]


_WIDE = (torch.float16, torch.bfloat16, torch.float32)


def _upcast(op: str, xs: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """float16/bfloat16/float32 inputs to float64 where the port's type takes double (quantized
    caches and float-only ports such as ``k_scale`` stay as they are)."""
    spec = op_module(op).SPEC
    ports = [spec.constraint(p.type_param).accepted for p in spec.inputs]
    return [x.double() if x is not None and x.dtype in _WIDE and "double" in acc else x
            for x, acc in zip(xs, ports, strict=True)]


def implementation(op: str, backend: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    mod = op_module(op) if backend == "reference" else _ort_module(op)
    return getattr(mod, OP_MODULES[op].rsplit(".", 1)[-1])


def run_case(case: Case, backend: str) -> Result:
    tol, shapes = TOLERANCE[case.dtype], "?"
    try:
        inputs, attrs = op_module(case.op).make_inputs(
            case.recipe, dtypes.to_torch(case.dtype), case.seed)
        shapes = " ".join("x".join(map(str, t.shape)) for t in inputs[:3] if t is not None)
        truth = implementation(case.op, "reference")(*_upcast(case.op, _clone(inputs)),
                                                        **attrs)
        got = implementation(case.op, backend)(*_clone(inputs), **attrs)
        err = 0.0
        for g, t in zip(got, truth, strict=True):
            if g.numel():
                err = max(err, (g.double() - t.double()).abs().max().item())
        return Result(case, backend, shapes, err, tol)
    except Exception as exc:  # reported as a failing row, never swallowed silently
        return Result(case, backend, shapes, float("nan"), tol, f"{type(exc).__name__}: {exc}")


def run(cases: list[Case], backends: Iterable[str], progress: Callable[[], None] | None = None
        ) -> list[Result]:
    results = []
    for case in cases:
        for backend in backends:
            if backend in case.backends:
                results.append(run_case(case, backend))
        if progress:
            progress()
    return results
