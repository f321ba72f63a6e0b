"""The one element-type table: every spelling round-trips, unknown ones raise typed errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from pagedhybrid import dtypes
from pagedhybrid.attention.fields import AttentionDType
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

ROWS = dtypes.ELEMENT_TYPES


@pytest.mark.parametrize("e", ROWS, ids=lambda e: e.logical)
def test_every_spelling_names_its_row(e: dtypes.ElementType) -> None:
    for spelling in (e.torch, *e.spellings(), e.onnx_code, ir.DataType(e.onnx_code)):
        assert dtypes.lookup(spelling) is e
        assert dtypes.to_torch(spelling) is e.torch
        assert dtypes.onnx_name(spelling) == e.onnx
        assert dtypes.logical_name(spelling) == e.logical
    assert dtypes.ir_dtype(e.torch) == ir.DataType(e.onnx_code)
    assert dtypes.itemsize(e.onnx) == e.torch.itemsize


@pytest.mark.parametrize("e", ROWS, ids=lambda e: e.logical)
def test_rows_agree_with_torch_onnx_and_numpy(e: dtypes.ElementType) -> None:
    assert str(e.torch) == f"torch.{e.logical}"
    assert getattr(onnx.TensorProto, e.onnx.upper()) == e.onnx_code
    assert ir.DataType(e.onnx_code).name.lower() == e.onnx
    if e.numpy:
        np_dt = dtypes.numpy_dtype(e.torch)
        assert np_dt.name == e.logical and np_dt.itemsize == e.itemsize
        assert dtypes.lookup(np_dt) is e and dtypes.lookup(np_dt.type) is e
    else:
        with pytest.raises(UnsupportedConfiguration, match=e.logical):
            dtypes.numpy_dtype(e.torch)


def test_spellings_are_unique_and_the_short_names_are_the_contract_names() -> None:
    names = [n for e in ROWS for n in e.spellings()]
    assert len(names) == len(set(names))
    assert {dtypes.cli_name(d) for d in (torch.float32, torch.float16, torch.bfloat16)} == \
        {d.value for d in AttentionDType}
    assert [dtypes.to_torch(d) for d in (AttentionDType.FP32, AttentionDType.BF16)] == \
        [torch.float32, torch.bfloat16]
    assert dtypes.spellings([torch.float32]) == ("F32", "float", "float32", "fp32")
    assert dtypes.to_torch("BF16") is torch.bfloat16  # the safetensors header spelling
    assert dtypes.spellings([torch.float16, "bf16"], kinds=("logical", "cli")) == \
        ("bf16", "bfloat16", "float16", "fp16")


@pytest.mark.parametrize("bad", ["fp64", "float 32", "torch.float32", "", "FLOAT", 999,
                                 torch.complex64, np.dtype(np.complex64)])
def test_unknown_spellings_raise_contract_violation_naming_them(bad: object) -> None:
    with pytest.raises(ContractViolation, match="is not a known element type") as info:
        dtypes.lookup(bad, op="Caller", where="dtype")  # type: ignore[arg-type]
    assert info.value.op == "Caller" and info.value.got == repr(bad)
    for fn in (dtypes.to_torch, dtypes.onnx_name, dtypes.numpy_dtype, dtypes.ir_dtype):
        with pytest.raises(ContractViolation):
            fn(bad)  # type: ignore[arg-type]
    assert dtypes.find(bad) is None
    assert dtypes.describe(bad) == str(bad)


def test_types_without_a_short_name_raise_unsupported_configuration() -> None:
    with pytest.raises(UnsupportedConfiguration, match="int8 has no short name"):
        dtypes.cli_name(torch.int8)
    assert dtypes.describe(torch.float32) == "float" and dtypes.describe(True) == "True"
