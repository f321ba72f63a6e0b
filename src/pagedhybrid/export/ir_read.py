"""Reading an exported graph (``onnx_ir``) for the package checks (``verify.py``, ``moe.py``,
``nbits.py``): a node's attributes and operands, values' names, dims and dtypes, the constant
ints behind a ``Reshape``, and the HF-style l2 normalisation of q and k (``l2_normalized``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir

from pagedhybrid import dtypes

L2_NORM_CHAIN = ("Mul", "Reciprocal", "Sqrt", "Add", "ReduceSumSquare")


def dims(v: ir.Value) -> tuple[int | str | None, ...]:
    """``v``'s dims (a symbolic dim by its name, ``"?"`` when unnamed; ``()`` when unknown)."""
    if v.shape is None:
        return ()
    return tuple(d if isinstance(d, int) else (d.value if d.value is not None else "?")
                 for d in v.shape)


def dtype(v: ir.Value) -> str:
    return dtypes.describe(v.dtype) if v.dtype is not None else "?"


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def operand(node: ir.Node, k: int) -> ir.Value | None:
    """``node``'s input ``k`` (None when it has fewer inputs or the input is omitted)."""
    return node.inputs[k] if k < len(node.inputs) else None


def name(v: ir.Value | None) -> str:
    return v.name or "" if v is not None else ""


def producers(graph: ir.Graph) -> dict[str, ir.Node]:
    return {v.name: n for n in graph for v in n.outputs if v.name}


def by_op(graph: ir.Graph, op: str) -> list[ir.Node]:
    return [n for n in graph if n.op_type == op]


def matching(nodes: Sequence[ir.Node], pred: Callable[[ir.Node], bool]) -> list[ir.Node]:
    return [n for n in nodes if pred(n)]


def const_ints(v: ir.Value | None) -> list[int] | None:
    """The int64 values of an initializer feeding a Reshape (None when not constant)."""
    if v is None or v.const_value is None:
        return None
    return [int(x) for x in v.const_value.numpy().reshape(-1)]


def reshape_dims(v: ir.Value | None) -> list[int] | None:
    """The target shape of the ``Reshape`` producing ``v`` (None: not a constant Reshape)."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type != "Reshape" or len(node.inputs) < 2:
        return None
    return const_ints(node.inputs[1])


def skip(v: ir.Value | None, op_type: str) -> ir.Value | None:
    """The data input of ``v``'s producer when that is an ``op_type`` node, else ``v``."""
    node = v.producer() if v is not None else None
    return node.inputs[0] if node is not None and node.op_type == op_type else v


def skip_cast(v: ir.Value | None) -> ir.Value | None:
    return skip(v, "Cast")


def is_float(v: ir.Value) -> bool:
    """float32 by its type, or as the output of a ``Cast`` to float (intermediates are untyped)."""
    node = v.producer()
    if node is not None and node.op_type == "Cast":
        return attr(node, "to") == ir.DataType.FLOAT
    return v.dtype == ir.DataType.FLOAT


def l2_normalized(v: ir.Value | None) -> tuple[ir.Value | None, float | None]:
    """If ``v`` is ``[Cast] Mul(x, Reciprocal(Sqrt(Add(ReduceSumSquare(x, [-1]), eps))))``
    over float32 ``x``, return (the value before normalisation, eps); else (None, None)."""
    inner = skip_cast(v)
    mul = inner.producer() if inner is not None else None
    if mul is None or mul.op_type != "Mul" or len(mul.inputs) != 2:
        return None, None
    x, node = mul.inputs[0], mul.inputs[1].producer() if mul.inputs[1] is not None else None
    eps = None
    for op in L2_NORM_CHAIN[1:]:
        if node is None or node.op_type != op:
            return None, None
        if op == "Add":
            const = node.inputs[1].const_value if node.inputs[1] is not None else None
            eps = float(const.numpy().reshape(-1)[0]) if const is not None else None
        if op == "ReduceSumSquare":
            axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
            ok = node.inputs[0] is x and axes == [-1] and attr(node, "keepdims", 1) == 1
            return (skip_cast(x), eps) if ok and x is not None and is_float(x) else (None, None)
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return None, None
