"""Operator contracts as data: ports, attributes and type constraints of an ONNX Runtime op.

An ``OpSpec`` is written once per operator (in ONNX Runtime's exact input order, names and
attribute defaults) and drives everything else: argument validation of the references and fast
kernels, output-shape derivation, the JSON written for the WebGPU kernel manifest, and the
conformance cases. ``tests/ops/test_schemas.py`` checks every spec against the schema that the
installed onnxruntime registers, so the two cannot drift.

Validation helpers here raise ``ContractViolation(op, port_or_attr, rule, got)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, NamedTuple

import torch

from pagedhybrid import dtypes
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

REQUIRED = object()  # sentinel default of a required attribute


class Port(NamedTuple):
    """One input or output of an operator."""

    name: str
    type_param: str  # a TypeConstraint.param, e.g. "T"
    optional: bool = False
    ranks: tuple[int, ...] = ()  # allowed ranks; () = not checked here
    shape: str = ""  # symbolic shape, e.g. "[num_tokens, num_heads*head_size]"
    doc: str = ""
    supported: bool = True  # False: the port exists in ONNX Runtime but pagedhybrid rejects it


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
            if a.choices:
                self.check(value in a.choices, a.name, f"must be one of {list(a.choices)}", value)
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
                self.check(port.optional, port.name, "is a required input", "None")
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
