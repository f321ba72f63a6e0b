"""The generic contract machinery: attribute resolution and port checks raise typed errors."""

from __future__ import annotations

import pytest
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.ops.spec import Attribute, OpSpec, Port, TypeConstraint, check_cu_seqlens

SPEC = OpSpec(
    "test", "Toy", 1,
    inputs=(Port("x", "T", ranks=(2,)), Port("y", "T", optional=True, ranks=(2,)),
            Port("idx", "S", ranks=(1,)), Port("q", "T", optional=True, supported=False)),
    outputs=(Port("out", "T"),),
    attributes=(Attribute("n", "int"), Attribute("mode", "string", "a", choices=("a", "b"),
                                                 unsupported=("c",)),
                Attribute("eps", "float", 1e-6)),
    type_constraints=(TypeConstraint("T", ("float16",), extension=("float",),
                                     unsupported=("bfloat16",)),
                      TypeConstraint("S", ("int32",))),
)


def test_resolve_fills_defaults_and_coerces():
    assert SPEC.resolve_attributes({"n": 3, "eps": 1}) == {"n": 3, "mode": "a", "eps": 1.0}


@pytest.mark.parametrize("attrs,where", [
    ({}, "n"), ({"n": 1.5}, "n"), ({"n": 1, "mode": "z"}, "mode"), ({"n": 1, "eps": "x"}, "eps"),
    ({"n": 1, "bogus": 2}, "bogus"),
])
def test_bad_attributes_name_the_attribute(attrs, where):
    with pytest.raises(ContractViolation) as e:
        SPEC.resolve_attributes(attrs)
    assert e.value.where == where and "test.Toy" in str(e.value)


def test_unsupported_value_is_not_a_violation():
    with pytest.raises(UnsupportedConfiguration, match="mode='c'"):
        SPEC.resolve_attributes({"n": 1, "mode": "c"})


def test_port_checks():
    x, i = torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, dtype=torch.int32)
    assert SPEC.check_inputs([x, None, i, None]) == {"T": torch.float16, "S": torch.int32}
    bad = [
        ([None, None, i, None], "x"),
        ([x[0], None, i, None], "x"),
        ([x, x.float(), i, None], "y"),
        ([x, None, i.long(), None], "idx"),
        ([x.double(), None, i, None], "x"),
    ]
    for args, where in bad:
        with pytest.raises(ContractViolation) as e:
            SPEC.check_inputs(args)
        assert e.value.where == where
    with pytest.raises(UnsupportedConfiguration):
        SPEC.check_inputs([x.bfloat16(), None, i, None])
    with pytest.raises(UnsupportedConfiguration):
        SPEC.check_inputs([x, None, i, x])


@pytest.mark.parametrize("vals,total", [([1, 2], 2), ([0, 3, 2], 2), ([0, 2], 3), ([0], 0)])
def test_cu_seqlens_rules(vals, total):
    with pytest.raises(ContractViolation) as e:
        check_cu_seqlens(SPEC, "cu", torch.tensor(vals, dtype=torch.int32), total)
    assert e.value.where == "cu"
