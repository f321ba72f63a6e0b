"""Operator contracts as data: ports, attributes and type constraints of an ONNX Runtime op.

An ``OpSpec`` is written once per operator (in ONNX Runtime's exact input order, names and
attribute defaults) and drives everything else: the Python signature of every implementation,
argument binding, validation of the references and fast kernels, output-shape derivation, the
JSON written for the WebGPU kernel manifest, and the conformance cases.
``tests/ops/test_schemas.py`` checks every spec against the schema that the installed onnxruntime
registers, so the two cannot drift.

Calling convention (the one signature, derived here and nowhere else): inputs are positional or
keyword parameters in port order, attributes are keyword-only with the spec's defaults. An input
gets the default ``None`` when it and every later input may be absent (ORT-optional, or
``Port.none_means`` for a required ORT port the Python functions accept as ``None``).

* ``OpSpec.signature()`` -- that signature as an ``inspect.Signature``.
* ``OpSpec.bind(*args, **kwargs)`` -> ``BoundCall``: every input by port (``None`` = absent) and
  every attribute resolved (defaults filled, kinds coerced, allowed values checked). Unknown,
  missing and duplicate arguments raise ``ContractViolation`` naming the port or attribute; bind
  does not look at the tensors (each op's ``validate_call`` does).
* ``OpSpec.implement(backend)`` -- decorator for ``run(call: BoundCall)``: returns the public
  entry point (a plain function ``(*args, **kwargs) -> run(spec.bind(...))`` whose
  ``__signature__`` is the spec's, so ``help()`` and ``inspect`` show the real parameters) and
  records it in the op's implementations (``OpSpec.implementations()``: a list for tests and
  reports, not a dispatch seam -- kernel selection is ``pagedhybrid.kernels.backend``'s).
  ``OpSpec.define`` publishes an entry point without recording it (e.g. ``validate``).

Validation helpers here raise ``ContractViolation(op, port_or_attr, rule, got)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NamedTuple, TypeVar

import torch

from pagedhybrid import dtypes
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

REQUIRED = object()  # sentinel default of a required attribute
MAX_STATE_UPDATE_CAPACITY = 8  # ONNX Runtime's bound on state_update_capacity (linear ops)
_MISSING = object()  # an input the caller did not pass
R = TypeVar("R")


class Port(NamedTuple):
    """One input or output of an operator."""

    name: str
    type_param: str  # a TypeConstraint.param, e.g. "T"
    optional: bool = False
    ranks: tuple[int, ...] = ()  # allowed ranks; () = not checked here
    shape: str = ""  # symbolic shape, e.g. "[num_tokens, num_heads*head_size]"
    doc: str = ""
    supported: bool = True  # False: the port exists in ONNX Runtime but pagedhybrid rejects it
    none_means: str = ""  # for a port ORT requires: what None means in Python ("" = not allowed)

    @property
    def accepts_none(self) -> bool:
        return self.optional or bool(self.none_means)


class Attribute(NamedTuple):
    """One attribute: ONNX kind (int | float | string), default, allowed values."""

    name: str
    kind: str
    default: Any = REQUIRED
    choices: tuple[Any, ...] = ()  # allowed values the reference implements; () = any
    doc: str = ""
    unsupported: tuple[Any, ...] = ()  # values ONNX Runtime accepts that pagedhybrid rejects

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


class TypeConstraint(NamedTuple):
    """Allowed element types of a type parameter.

    ``ort`` is exactly what ONNX Runtime's schema allows; ``extension`` lists types the
    pagedhybrid implementations also accept (documented per op); ``unsupported`` lists ORT types
    that pagedhybrid rejects with UnsupportedConfiguration.
    """

    param: str
    ort: tuple[str, ...]
    extension: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()

    @property
    def accepted(self) -> tuple[str, ...]:
        return tuple(t for t in self.ort + self.extension if t not in self.unsupported)


class OpSpec(NamedTuple):
    """The contract of one operator."""

    domain: str
    name: str
    version: int
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attribute, ...]
    type_constraints: tuple[TypeConstraint, ...]
    doc: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.domain}.{self.name}"

    def input(self, name: str) -> Port:
        return next(p for p in self.inputs if p.name == name)

    def attribute(self, name: str) -> Attribute:
        return next(a for a in self.attributes if a.name == name)

    def constraint(self, param: str) -> TypeConstraint:
        return next(c for c in self.type_constraints if c.param == param)

    def fail(self, where: str, rule: str, got: object = None) -> ContractViolation:
        return ContractViolation(self.qualname, where, rule, got)

    def check(self, cond: bool, where: str, rule: str, got: object = None) -> None:
        if not cond:
            raise self.fail(where, rule, got)

    # -- the one signature -------------------------------------------------------------------
    def signature(self) -> inspect.Signature:
        """Inputs (positional or keyword, port order), then attributes (keyword-only)."""
        return _layout(self).signature

    def bind(self, *args: Any, **kwargs: Any) -> BoundCall:
        """Bind a call to the spec (see the module docstring); tensors are not inspected."""
        lay = _layout(self)
        n = len(self.inputs)
        if len(args) > n:
            raise self.fail("inputs", f"takes at most {n} positional inputs in ONNX Runtime "
                            "order (attributes are keyword-only)", len(args))
        values = [*args, *(_MISSING,) * (n - len(args))]
        attrs: dict[str, Any] = {}
        for name, value in kwargs.items():
            i = lay.index.get(name)
            if i is None:
                self.check(name in lay.attributes, name, "is not an input or attribute of this op")
                attrs[name] = value
                continue
            if i < len(args):
                raise self.fail(name, f"is given twice: as positional input {i} and by keyword")
            values[i] = value
        for i, port in enumerate(self.inputs):
            if values[i] is _MISSING:
                self.check(lay.defaults[i], port.name,
                           "is a required input" if not port.accepts_none else
                           "must be passed (None when absent): a later input is required",
                           "missing")
                values[i] = None
        return BoundCall(self, tuple(values), self.resolve_attributes(attrs), frozenset(attrs))

    def call(self, run: Callable[[BoundCall], R], *args: Any, **kwargs: Any) -> R:
        """``run`` on the bound call."""
        return run(self.bind(*args, **kwargs))

    def define(self, run: Callable[[BoundCall], R], name: str | None = None
               ) -> Callable[..., R]:
        """The entry point of ``run``: a function taking the spec's signature."""
        spec = self

        def entry(*args: Any, **kwargs: Any) -> R:
            return run(spec.bind(*args, **kwargs))

        entry.__name__ = entry.__qualname__ = name or run.__name__
        entry.__module__, entry.__doc__ = run.__module__, run.__doc__
        ret = inspect.signature(run).return_annotation
        entry.__signature__ = self.signature().replace(return_annotation=ret)  # type: ignore[attr-defined]
        return entry

    def implement(self, backend: str) -> Callable[[Callable[[BoundCall], R]], Callable[..., R]]:
        """Decorator: ``run(call)`` becomes the entry point, recorded as ``backend``'s."""

        def register(run: Callable[[BoundCall], R]) -> Callable[..., R]:
            entry = self.define(run)
            _IMPLEMENTATIONS.setdefault(self.qualname, {})[backend] = Implementation(
                self.qualname, backend, run, entry)
            return entry

        return register

    def implementations(self) -> dict[str, Implementation]:
        """The implementations registered so far (those whose modules are imported)."""
        return dict(_IMPLEMENTATIONS.get(self.qualname, {}))

    # -- attributes ---------------------------------------------------------------------------
    def resolve_attributes(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in, kinds and allowed values checked; unknown names rejected."""
        known = {a.name: a for a in self.attributes}
        for name in given:
            self.check(name in known, name, "is not an attribute of this op", sorted(given))
        out: dict[str, Any] = {}
        for a in self.attributes:
            value = given.get(a.name, a.default)
            self.check(value is not REQUIRED, a.name, "is a required attribute", "missing")
            value = _coerce(self, a, value)
            if value in a.unsupported:
                raise UnsupportedConfiguration(
                    f"{self.qualname}: {a.name}={value!r} is valid in ONNX Runtime but not "
                    f"implemented by pagedhybrid; supported: {a.choices or 'other values'}"
                )
            if a.choices and value not in a.choices:  # message built only on failure
                raise self.fail(a.name, f"must be one of {list(a.choices)}", value)
            out[a.name] = value
        return out

    # -- tensors ------------------------------------------------------------------------------
    def check_inputs(self, tensors: Sequence[torch.Tensor | None]) -> dict[str, torch.dtype]:
        """Presence, tensor-ness, rank and element type of every input.

        Returns the dtype bound to each type parameter. All ports sharing a type parameter must
        share one dtype (ONNX semantics).
        """
        self.check(len(tensors) == len(self.inputs), "inputs",
                   f"expects {len(self.inputs)} positional inputs", len(tensors))
        bound: dict[str, tuple[torch.dtype, str]] = {}
        for port, t in zip(self.inputs, tensors, strict=True):
            if t is None:
                self.check(port.accepts_none, port.name, "is a required input", "None")
                continue
            self.check(isinstance(t, torch.Tensor), port.name, "must be a torch.Tensor",
                       type(t).__name__)
            if not port.supported:
                raise UnsupportedConfiguration(
                    f"{self.qualname}: input '{port.name}' is not supported by pagedhybrid; "
                    "leave it empty")
            if port.ranks:
                self.check(t.dim() in port.ranks, port.name,
                           f"must have rank {' or '.join(map(str, port.ranks))} {port.shape}",
                           t.dim())
            tc = self.constraint(port.type_param)
            name = dtypes.describe(t.dtype)
            if name in tc.unsupported:
                raise UnsupportedConfiguration(
                    f"{self.qualname}: '{port.name}' of type {name} is valid in ONNX Runtime but "
                    f"not implemented by pagedhybrid; use one of {list(tc.accepted)}")
            self.check(name in tc.accepted, port.name,
                       f"must have element type in {list(tc.accepted)} ({tc.param})", name)
            prev = bound.setdefault(port.type_param, (t.dtype, port.name))
            self.check(prev[0] == t.dtype, port.name,
                       f"must have the same element type as '{prev[1]}' ({tc.param})",
                       f"{name} vs {dtypes.describe(prev[0])}")
        return {k: v[0] for k, v in bound.items()}

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def port(p: Port, i: int) -> dict[str, Any]:
            return {"index": i, "name": p.name, "type": p.type_param, "optional": p.optional,
                    "ranks": list(p.ranks), "shape": p.shape, "doc": p.doc,
                    "supported": p.supported}

        return {
            "domain": self.domain, "name": self.name, "since_version": self.version,
            "doc": self.doc,
            "inputs": [port(p, i) for i, p in enumerate(self.inputs)],
            "outputs": [port(p, i) for i, p in enumerate(self.outputs)],
            "attributes": [
                {"name": a.name, "kind": a.kind, "required": a.required,
                 "default": None if a.required else a.default, "choices": list(a.choices),
                 "unsupported": list(a.unsupported), "doc": a.doc}
                for a in self.attributes
            ],
            "type_constraints": [
                {"param": c.param, "ort": list(c.ort), "extension": list(c.extension),
                 "unsupported": list(c.unsupported)}
                for c in self.type_constraints
            ],
        }


@dataclass(frozen=True, eq=False, slots=True)
class BoundCall:
    """One call bound to its spec: what every implementation receives.

    ``inputs``: one entry per port in ONNX Runtime order (``None`` = absent); ``attrs``: every
    attribute resolved; ``given``: the attribute names the caller passed (ORT nodes carry only
    those). ``call["name"]`` reads an input or attribute by name.
    """

    spec: OpSpec
    inputs: tuple[Any, ...]  # torch.Tensor | None per port (tensors are checked by validate)
    attrs: dict[str, Any]
    given: frozenset[str]

    def __getitem__(self, name: str) -> Any:
        i = _layout(self.spec).index.get(name)
        return self.inputs[i] if i is not None else self.attrs[name]

    @property
    def named_inputs(self) -> dict[str, Any]:
        return {p.name: t for p, t in zip(self.spec.inputs, self.inputs, strict=True)}

    @property
    def given_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in self.attrs.items() if k in self.given}

    def with_inputs(self, **tensors: Any) -> BoundCall:
        """A copy with some inputs replaced (by port name)."""
        index, values = _layout(self.spec).index, list(self.inputs)
        for name, t in tensors.items():
            values[index[name]] = t
        return BoundCall(self.spec, tuple(values), self.attrs, self.given)


class Implementation(NamedTuple):
    """One registered implementation of an op: ``run(call)`` and its public ``entry``."""

    op: str
    backend: str
    run: Callable[[BoundCall], Any]
    entry: Callable[..., Any]


_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {}
_KINDS = {"int": "int", "float": "float", "string": "str"}


class _Layout(NamedTuple):
    index: dict[str, int]  # port name -> input position
    defaults: tuple[bool, ...]  # per port: the parameter defaults to None
    attributes: frozenset[str]
    signature: inspect.Signature


_LAYOUTS: dict[int, tuple[OpSpec, _Layout]] = {}  # id(spec) -> (spec kept alive, layout)


def _layout(spec: OpSpec) -> _Layout:
    hit = _LAYOUTS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    names = [p.name for p in spec.inputs]
    attr_names = [a.name for a in spec.attributes]
    assert len(set(names + attr_names)) == len(names) + len(attr_names), spec.qualname
    defaults = [False] * len(names)
    tail_ok = True  # every later port accepts None
    for i in range(len(names) - 1, -1, -1):
        tail_ok = tail_ok and spec.inputs[i].accepts_none
        defaults[i] = tail_ok
    P = inspect.Parameter
    params = [P(p.name, P.POSITIONAL_OR_KEYWORD, default=None if d else P.empty,
                annotation="torch.Tensor | None" if p.accepts_none else "torch.Tensor")
              for p, d in zip(spec.inputs, defaults, strict=True)]
    params += [P(a.name, P.KEYWORD_ONLY, default=P.empty if a.required else a.default,
                 annotation=_KINDS[a.kind]) for a in spec.attributes]
    lay = _Layout({n: i for i, n in enumerate(names)}, tuple(defaults), frozenset(attr_names),
                  inspect.Signature(params))
    _LAYOUTS[id(spec)] = (spec, lay)
    return lay


def _coerce(spec: OpSpec, a: Attribute, value: Any) -> Any:
    if a.kind == "int":
        spec.check(isinstance(value, (int, bool)) and not isinstance(value, float), a.name,
                   "must be an int", repr(value))
        return int(value)
    if a.kind == "float":
        spec.check(isinstance(value, (int, float)) and not isinstance(value, bool), a.name,
                   "must be a float", repr(value))
        return float(value)
    spec.check(isinstance(value, str), a.name, "must be a string", repr(value))
    return value


# -- shared shape rules -------------------------------------------------------------------------
def check_cu_seqlens(spec: OpSpec, port: str, cu: torch.Tensor, total_tokens: int,
                     *, allow_empty_sequences: bool = True) -> list[int]:
    """``cu`` is int32 [B+1], starts at 0, non-decreasing, ends at ``total_tokens``."""
    spec.check(cu.dim() == 1 and cu.numel() >= 2, port, "must be rank 1 with length >= 2 [B+1]",
               tuple(cu.shape))
    vals = [int(v) for v in cu.tolist()]
    spec.check(vals[0] == 0, port, "must start at 0", vals[0])
    for a, b in pairwise(vals):
        spec.check(b >= a, port, "must be non-decreasing", vals)
        if not allow_empty_sequences:
            spec.check(b > a, port, "must be strictly increasing (every sequence needs a token)",
                       vals)
    spec.check(vals[-1] == total_tokens, port,
               f"must end at the number of tokens ({total_tokens})", vals[-1])
    return vals


def check_shape(spec: OpSpec, port: str, t: torch.Tensor, expected: Sequence[int],
                what: str = "") -> None:
    spec.check(tuple(t.shape) == tuple(expected), port,
               f"must have shape {list(expected)}{' ' + what if what else ''}", list(t.shape))
