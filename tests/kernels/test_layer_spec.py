"""The fused decoder layers' declaration (``kernels/layer_spec.py``) against what the native side
was built from: the checked-in ``csrc/layer_spec.h`` is what the spec generates, and every field
is an argument of the layer's ops, in the op's order."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedhybrid.kernels import layer_spec
from pagedhybrid.kernels.layer_spec import ATTENTION, GDN, LayerSpec
from pagedhybrid.kernels.native import library


def test_the_checked_in_header_is_what_the_spec_generates(tmp_path: Path) -> None:
    """``decode_stack.cpp`` / ``decode_layer.cpp`` index by ``layer_spec.h``: a spec changed
    without the header written again (``python -m pagedhybrid.kernels.layer_spec``, or the
    native build) fails here. The build writes it only where it differs."""
    assert layer_spec.HEADER.read_text(encoding="utf-8") == layer_spec.header()
    header = tmp_path / "layer_spec.h"
    assert layer_spec.write_header(header) and not layer_spec.write_header(header)
    assert header.read_text(encoding="utf-8") == layer_spec.header()


def test_the_header_names_each_field_at_its_place() -> None:
    text = layer_spec.header()
    for spec in layer_spec.SPECS:
        section = text.split(f"namespace {spec.name} {{")[1].split(f"// namespace {spec.name}")[0]
        for kinds in (layer_spec.TENSOR_KINDS, (layer_spec.INT,), (layer_spec.FLOAT,)):
            for i, f in enumerate(spec.of(*kinds)):
                assert f"{f.name} = {i}" in section, (spec.name, f.name)
        assert f"kTensors = {len(spec.tensors)}," in section
        assert f"kProjections = {len(spec.of(layer_spec.PROJECTION))};" in section
        assert f"kKind = {spec.kind};" in section


@pytest.mark.parametrize(("spec", "op"), [(GDN, "gdn_decode_layer"),
                                          (ATTENTION, "attention_decode_layer"),
                                          (ATTENTION, "mtp_chain"), (ATTENTION, "mtp_draft")])
def test_every_field_is_an_argument_of_the_op_in_its_order(spec: LayerSpec, op: str) -> None:
    """The ops take a layer's fields by name (``LayerWeights.args``): each field is one of the
    op's arguments, and the spec lists them in the op's order."""
    names = {f.name for f in spec.fields}
    schema = getattr(library(), op).default._schema
    assert [a.name for a in schema.arguments if a.name in names] == [f.name for f in spec.fields]


def test_fields_are_unique_and_sourced_where_the_layer_has_them() -> None:
    for spec in layer_spec.SPECS:
        names = [f.name for f in spec.fields]
        assert len(set(names)) == len(names)
        for f in spec.fields:
            assert f.kind in (*layer_spec.TENSOR_KINDS, layer_spec.INT, layer_spec.FLOAT)
            assert (f.kind == layer_spec.POOL) <= (not f.source), f  # pools: the caller's
            assert not f.derive or f.derive in layer_spec.DERIVE, f
    assert {s.kind for s in layer_spec.SPECS} == {0, 1}


def test_each_field_is_read_by_an_op_of_its_program() -> None:
    """A layer's order of operations is its program: every field has an op that reads it, and
    the programs end in ``h``."""
    for spec in layer_spec.SPECS:
        read = {f for op in spec.program for f in op.fields}
        assert read == {f.name for f in spec.fields}, spec.name
        assert spec.registers[0] == "h" and "h" in spec.program[-1].outs


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: (layer_spec.Op("nrom", ("x",), ("h",), ("input_norm", "rms_eps")), *p[1:]),
     "not one of"),
    (lambda p: p[1:], "reads ['x'] before they are written"),
    (lambda p: (p[0]._replace(fields=("rms_eps", "input_norm")), *p[1:]), "the op takes"),
    (lambda p: (*p[:1], p[1]._replace(outs=p[1].outs[:2]), *p[2:]), "one output each"),
    (lambda p: p[:-1], "must write h"),
])
def test_a_program_both_paths_cannot_run_is_refused(change, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layer_spec.check_program(GDN._replace(program=change(GDN.program)))
