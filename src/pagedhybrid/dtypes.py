"""The one table of tensor element types and every spelling pagedhybrid reads or writes.

Each ``ElementType`` row gives one element type under all its names:

* ``torch`` -- the torch dtype;
* ``onnx`` -- the ONNX element type name as ONNX Runtime's schemas spell it (``"float"``,
  ``"float16"``, ``"double"``; the names of ``OpSpec`` type constraints and of the export ABI);
* ``logical`` -- the numpy / logical spelling (``"float32"``, ``"float64"``, ``"bfloat16"``):
  numpy's ``dtype.name``, torch's attribute name and the WebGPU package's ``dtype``;
* ``cli`` -- the short command-line / ``AttentionContract`` spelling (``"fp32"``, ``"fp16"``,
  ``"bf16"``) where one exists;
* ``onnx_code`` -- the ``onnx.TensorProto`` / ``onnx_ir.DataType`` enum value;
* ``numpy`` -- whether numpy has the type (it has no bfloat16 and no float8);
* ``safetensors`` -- the safetensors header spelling (``"F32"``, ``"BF16"``).

No spelling names two types, so ``lookup`` takes a torch dtype, a numpy dtype, an ONNX enum
value or any of the spellings. An unknown type or spelling raises ``ContractViolation`` naming
it; a known type without the requested form (a numpy dtype of bfloat16, a CLI name of int8)
raises ``UnsupportedConfiguration``. Lists of the dtypes an implementation *supports* are
capabilities and stay with that implementation; this module only names types.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

if TYPE_CHECKING:
    import onnx_ir

OP = "pagedhybrid.dtypes"
SPELLINGS = ("onnx", "logical", "cli", "safetensors")  # the string fields of ElementType


class ElementType(NamedTuple):
    """One element type under every spelling (see the module docstring)."""

    torch: torch.dtype
    onnx: str
    logical: str
    cli: str | None
    onnx_code: int
    numpy: bool = True
    safetensors: str | None = None  # the safetensors header's "dtype"

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize

    def spellings(self, kinds: Iterable[str] = SPELLINGS) -> tuple[str, ...]:
        """This type's names of the given kinds (``"onnx"``, ``"logical"``, ``"cli"``)."""
        names = (getattr(self, k) for k in kinds)
        return tuple(dict.fromkeys(n for n in names if n is not None))


ELEMENT_TYPES: tuple[ElementType, ...] = (
    ElementType(torch.float32, "float", "float32", "fp32", 1, safetensors="F32"),
    ElementType(torch.float16, "float16", "float16", "fp16", 10, safetensors="F16"),
    ElementType(torch.bfloat16, "bfloat16", "bfloat16", "bf16", 16, numpy=False,
                safetensors="BF16"),
    ElementType(torch.float64, "double", "float64", None, 11, safetensors="F64"),
    ElementType(torch.int64, "int64", "int64", None, 7, safetensors="I64"),
    ElementType(torch.int32, "int32", "int32", None, 6, safetensors="I32"),
    ElementType(torch.int16, "int16", "int16", None, 5, safetensors="I16"),
    ElementType(torch.int8, "int8", "int8", None, 3, safetensors="I8"),
    ElementType(torch.uint8, "uint8", "uint8", None, 2, safetensors="U8"),
    ElementType(torch.uint32, "uint32", "uint32", None, 12, safetensors="U32"),
    ElementType(torch.bool, "bool", "bool", None, 9, safetensors="BOOL"),
    ElementType(torch.float8_e4m3fn, "float8e4m3fn", "float8_e4m3fn", None, 17, numpy=False,
                safetensors="F8_E4M3"),
)

DTypeLike = torch.dtype | str | int | np.dtype[Any] | type[np.generic]


def _index() -> tuple[dict[str, ElementType], dict[torch.dtype, ElementType],
                      dict[int, ElementType]]:
    by_name: dict[str, ElementType] = {}
    for e in ELEMENT_TYPES:
        for name in e.spellings():
            assert by_name.setdefault(name, e) is e, f"spelling {name!r} names two types"
    by_torch = {e.torch: e for e in ELEMENT_TYPES}
    by_code = {e.onnx_code: e for e in ELEMENT_TYPES}
    assert len(by_torch) == len(by_code) == len(ELEMENT_TYPES)
    return by_name, by_torch, by_code


_BY_NAME, _BY_TORCH, _BY_CODE = _index()


def find(x: object) -> ElementType | None:
    """The row of ``x`` (torch dtype, spelling, ONNX enum value, numpy dtype), or None."""
    if isinstance(x, torch.dtype):
        return _BY_TORCH.get(x)
    if isinstance(x, str):  # also StrEnum members such as AttentionDType.BF16
        return _BY_NAME.get(str(x))
    if isinstance(x, int) and not isinstance(x, bool):  # onnx.TensorProto.* / onnx_ir.DataType
        return _BY_CODE.get(int(x))
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return _BY_NAME.get(np.dtype(x).name)
    return None


def lookup(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> ElementType:
    """The row of ``x``; ``ContractViolation(op, where, ...)`` naming ``x`` when unknown."""
    e = find(x)
    if e is None:
        raise ContractViolation(op, where, f"is not a known element type; use one of "
                                f"{list(spellings())}", repr(x))
    return e


def spellings(types: Iterable[DTypeLike] | None = None, kinds: Iterable[str] = SPELLINGS
              ) -> tuple[str, ...]:
    """Sorted names of the given kinds for ``types`` (all types when None)."""
    rows = ELEMENT_TYPES if types is None else tuple(lookup(t) for t in types)
    kinds = tuple(kinds)
    return tuple(sorted({n for e in rows for n in e.spellings(kinds)}))


def to_torch(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> torch.dtype:
    return lookup(x, op=op, where=where).torch


def onnx_name(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> str:
    """ONNX Runtime's schema spelling: ``"float"``, ``"float16"``, ``"double"``, ..."""
    return lookup(x, op=op, where=where).onnx


def logical_name(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> str:
    """The numpy / logical spelling: ``"float32"``, ``"float16"``, ``"float64"``, ..."""
    return lookup(x, op=op, where=where).logical


def cli_name(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> str:
    """The short spelling ``"fp32"`` / ``"fp16"`` / ``"bf16"``; other types have none."""
    e = lookup(x, op=op, where=where)
    if e.cli is None:
        raise UnsupportedConfiguration(f"{op}: element type {e.logical} has no short name; "
                                       f"short names: {list(spellings(kinds=('cli',)))}")
    return e.cli


def describe(x: object) -> str:
    """``x``'s ONNX spelling when known, else ``str(x)``: for messages about arbitrary tensors."""
    e = find(x)
    return str(x) if e is None else e.onnx


def itemsize(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> int:
    return lookup(x, op=op, where=where).itemsize


def onnx_code(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> int:
    """The ``onnx.TensorProto`` element type value (``FLOAT`` = 1, ``FLOAT16`` = 10, ...)."""
    return lookup(x, op=op, where=where).onnx_code


def numpy_dtype(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> np.dtype[Any]:
    e = lookup(x, op=op, where=where)
    if not e.numpy:
        raise UnsupportedConfiguration(f"{op}: element type {e.logical} has no numpy dtype; "
                                       "use torch tensors for it")
    return np.dtype(e.logical)


def ir_dtype(x: DTypeLike, *, op: str = OP, where: str = "dtype") -> onnx_ir.DataType:
    import onnx_ir

    return onnx_ir.DataType(lookup(x, op=op, where=where).onnx_code)
