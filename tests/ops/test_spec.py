"""The generic contract machinery: attribute resolution, port checks and argument binding raise
typed errors naming the field; every implementation of an op takes the spec's one signature."""

from __future__ import annotations

import importlib
import inspect
import pydoc
import types

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


# -- the one signature: OpSpec.signature / bind / implement -------------------------------------
def test_signature_follows_ports_then_attributes():
    params = list(SPEC.signature().parameters.values())
    assert [p.name for p in params] == ["x", "y", "idx", "q", "n", "mode", "eps"]
    kinds = [p.kind for p in params]
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 4 + \
        [inspect.Parameter.KEYWORD_ONLY] * 3
    # an optional port gets a default only when every later port may be absent too
    assert [p.default for p in params[:4]] == [inspect.Parameter.empty, inspect.Parameter.empty,
                                              inspect.Parameter.empty, None]
    assert [p.default for p in params[4:]] == [inspect.Parameter.empty, "a", 1e-6]
    assert params[1].annotation == "torch.Tensor | None" and params[4].annotation == "int"


def test_bind_by_position_and_keyword():
    x, i = torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, dtype=torch.int32)
    a = SPEC.bind(x, None, i, n=3, eps=1)
    b = SPEC.bind(x=x, y=None, idx=i, n=3, eps=1.0)
    for call in (a, b):
        assert call.inputs == (x, None, i, None)
        assert call.attrs == {"n": 3, "mode": "a", "eps": 1.0}
        assert call["x"] is x and call["idx"] is i and call["mode"] == "a"
        assert call.named_inputs == {"x": x, "y": None, "idx": i, "q": None}
    assert a.given == {"n", "eps"} and a.given_attrs == {"n": 3, "eps": 1.0}
    assert type(a.attrs["eps"]) is float  # coerced
    assert type(SPEC.bind(x, None, i, n=True).attrs["n"]) is int
    swapped = a.with_inputs(y=x)
    assert swapped.inputs == (x, x, i, None) and a.inputs[1] is None


@pytest.mark.parametrize("args,kwargs,where,rule", [
    ((), {"x": 1, "y": None, "idx": 1, "n": 1, "bogus": 2}, "bogus", "not an input or attribute"),
    ((1, None), {"n": 1}, "idx", "required input"),
    ((1,), {"idx": 1, "n": 1}, "y", "must be passed (None when absent)"),
    ((1, None, 1), {"x": 1, "n": 1}, "x", "given twice"),
    ((1, None, 1), {"n": 1.5}, "n", "must be an int"),
    ((1, None, 1), {"n": 1, "eps": "small"}, "eps", "must be a float"),
    ((1, None, 1), {"n": 1, "mode": 3}, "mode", "must be a string"),
    ((1, None, 1), {}, "n", "required attribute"),
    ((1, None, 1, None, 5), {"n": 1}, "inputs", "at most 4 positional inputs"),
])
def test_bind_errors_name_the_field(args, kwargs, where, rule):
    with pytest.raises(ContractViolation) as e:
        SPEC.bind(*args, **kwargs)
    assert e.value.where == where and rule in e.value.rule and e.value.op == "test.Toy"


def test_bind_leaves_tensors_to_validation():
    call = SPEC.bind("not a tensor", None, None, n=1)  # presence only; check_inputs judges
    with pytest.raises(ContractViolation) as e:
        SPEC.check_inputs(call.inputs)
    assert e.value.where == "x"


def test_implement_publishes_the_signature_and_registers():
    toy = SPEC._replace(name="ToyImpl")  # its own qualname, so the registry stays clean

    @toy.implement("probe")
    def toy_op(call) -> tuple[int, ...]:
        """Probe implementation."""
        return call.inputs[0], call.attrs["n"]

    assert isinstance(toy_op, types.FunctionType) and toy_op.__name__ == "toy_op"
    assert toy_op.__doc__ == "Probe implementation."
    sig = inspect.signature(toy_op)
    assert list(sig.parameters.values()) == list(toy.signature().parameters.values())
    assert sig.return_annotation == "tuple[int, ...]"
    assert toy_op(7, None, 1, n=2) == (7, 2)
    assert toy_op(x=7, y=None, idx=1, n=2) == (7, 2)
    assert toy.call(lambda c: c["n"], 7, None, 1, n=4) == 4
    impl = toy.implementations()["probe"]
    assert impl.entry is toy_op and impl.op == "test.ToyImpl" and impl.run(toy.bind(
        1, None, 1, n=5)) == (1, 5)
    assert "probe" not in SPEC.implementations()
    with pytest.raises(ContractViolation) as e:
        toy_op(7, None, 1, n=2, num_heads=3)
    assert e.value.where == "num_heads"


# -- every op: one signature for every implementation ---------------------------------------------
OPS = ("paged_attention", "varlen_causal_conv", "gated_delta_net")
IMPLEMENTATIONS = {  # backend -> module holding the entry point of each op (None: not that op)
    "reference": "pagedhybrid.ops.{op}",
    "torch": "pagedhybrid.kernels.cpu.{op}",
    "native": "pagedhybrid.kernels.native.contract",
    "onnxruntime": "pagedhybrid.kernels.onnxruntime.{op}",
    "webgpu": "pagedhybrid.kernels.webgpu.backend",
}


@pytest.mark.parametrize("op", OPS)
def test_every_implementation_takes_the_spec_signature(op):
    import pagedhybrid.ops as ops

    mod = importlib.import_module(f"pagedhybrid.ops.{op}")
    spec = mod.SPEC
    names = [p.name for p in spec.inputs] + [a.name for a in spec.attributes]
    public = getattr(ops, op)
    assert list(inspect.signature(public).parameters) == names
    assert inspect.signature(public).parameters == spec.signature().parameters
    assert f"{spec.inputs[0].name}: 'torch.Tensor'" in pydoc.render_doc(public)  # help()
    expected = {"reference", "torch", "native", "onnxruntime"} | (
        {"webgpu"} if op == "paged_attention" else set())
    for backend, where in IMPLEMENTATIONS.items():
        if backend in expected:
            entry = getattr(importlib.import_module(where.format(op=op)), op)
            assert inspect.signature(entry).parameters == spec.signature().parameters, backend
    registered = spec.implementations()
    assert set(registered) >= expected
    assert registered["reference"].entry is public
    for impl in registered.values():
        assert impl.op == spec.qualname


@pytest.mark.parametrize("op", OPS)
def test_public_ops_reject_bad_arguments_by_name(op):
    import pagedhybrid.ops as ops

    mod = importlib.import_module(f"pagedhybrid.ops.{op}")
    inputs, attrs = mod.make_inputs(mod.conformance_recipes()[0], torch.float32, 0)
    fn = getattr(ops, op)
    first = mod.SPEC.inputs[0].name
    attr = next(a for a in mod.SPEC.attributes if a.kind == "int")
    cases = [
        ((*inputs,), {**attrs, "bogus": 1}, "bogus"),
        ((*inputs,), {**attrs, first: inputs[0]}, first),
        ((), attrs, first),
        ((*inputs,), {**attrs, attr.name: "1"}, attr.name),
    ]
    for args, kwargs, where in cases:
        with pytest.raises(ContractViolation) as e:
            fn(*args, **kwargs)
        assert e.value.where == where and e.value.op == mod.SPEC.qualname, (op, where)


def test_paged_attention_optional_ports_before_required_ones_have_no_default():
    from pagedhybrid.ops.paged_attention import SPEC as PA

    params = PA.signature().parameters
    assert params["key"].default is inspect.Parameter.empty  # key_cache after it is required
    assert params["value_cache"].default is inspect.Parameter.empty
    assert params["cos_cache"].default is None and params["num_heads"].default is \
        inspect.Parameter.empty


def test_conv_initial_state_none_means_zeros():
    from pagedhybrid.ops.varlen_causal_conv import SPEC as CONV

    port = CONV.input("initial_state")
    assert not port.optional and port.none_means == "zeros"  # ORT requires it; Python: zeros
    assert CONV.signature().parameters["initial_state"].default is None
