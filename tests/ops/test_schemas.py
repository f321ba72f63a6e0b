"""Every OpSpec equals the schema that the installed onnxruntime registers."""

from __future__ import annotations

import json

import onnx
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as C

from pagedhybrid.ops import OP_MODULES, op_module

SCHEMAS = {f"{s.domain}.{s.name}": s for s in C.get_all_operator_schema()
           if s.domain == "com.microsoft"}


def _default(attr):
    proto = onnx.AttributeProto()
    proto.ParseFromString(attr._default_value)
    return onnx.helper.get_attribute_value(proto) if proto.name else None


@pytest.mark.parametrize("op", sorted(OP_MODULES))
def test_ports_match_onnxruntime(op):
    spec, schema = op_module(op).SPEC, SCHEMAS[op]
    assert spec.version == schema.since_version
    for ours, theirs in ((spec.inputs, schema.inputs), (spec.outputs, schema.outputs)):
        assert [p.name for p in ours] == [p.name for p in theirs]
        assert [p.type_param for p in ours] == [p.typeStr for p in theirs]
        single = C.schemadef.OpSchema.FormalParameterOption.Single
        assert [p.optional for p in ours] == [p.option != single for p in theirs]


@pytest.mark.parametrize("op", sorted(OP_MODULES))
def test_attributes_match_onnxruntime(op):
    spec, schema = op_module(op).SPEC, SCHEMAS[op]
    assert {a.name for a in spec.attributes} == set(schema.attributes)
    kinds = {"int": "INT", "float": "FLOAT", "string": "STRING"}
    for a in spec.attributes:
        theirs = schema.attributes[a.name]
        assert kinds[a.kind] == theirs.type.name, a.name
        assert a.required == theirs.required, a.name
        default = _default(theirs)
        if default is not None:  # the schema stores a default: ours must equal it
            if isinstance(default, bytes):
                default = default.decode()
            assert a.default == pytest.approx(default), a.name


@pytest.mark.parametrize("op", sorted(OP_MODULES))
def test_type_constraints_match_onnxruntime(op):
    spec, schema = op_module(op).SPEC, SCHEMAS[op]
    theirs = {t.type_param_str: sorted(s.removeprefix("tensor(").removesuffix(")")
                                       for s in t.allowed_type_strs)
              for t in schema.type_constraints}
    ours = {c.param: sorted(c.ort) for c in spec.type_constraints}
    assert ours == theirs


@pytest.mark.parametrize("op", sorted(OP_MODULES))
def test_spec_round_trips_through_json(op):
    spec = op_module(op).SPEC
    doc = json.loads(json.dumps(spec.to_json()))
    assert doc["name"] == spec.name and doc["domain"] == "com.microsoft"
    assert [p["name"] for p in doc["inputs"]] == [p.name for p in spec.inputs]
    assert {a["name"]: a["default"] for a in doc["attributes"]} == {
        a.name: None if a.required else a.default for a in spec.attributes}
