"""The fused decoder layers' fields, declared once: ``GDN`` (Gated DeltaNet, ``gdn_decode_layer``)
and ``ATTENTION`` (full attention, ``attention_decode_layer``).

A ``LayerSpec`` lists a layer's fields in the order of its op's arguments, each with its name
(the op's argument name), its kind and where it comes from on the model's decoder layer: an
attribute path (``linear_attn.in_proj_qkv``), maybe through a named derivation (``DERIVE``), or
none -- what the caller gives (the cache pools, the native bundle's KV split). Everything that
reads a layer's fields goes by this list:

* ``resolve`` gathers them from a decoder layer (``DecoderLayer.decode_weights``): a
  ``LayerWeights``, the layer's fields by name -- the ops take them as keyword arguments;
* ``LayerWeights.bound``: the layer's tensors, ints and floats in the spec's order, as
  ``DecodeStack`` binds them;
* ``header()``: ``native/csrc/layer_spec.h``, the indices of those lists and their counts per kind,
  which ``decode_stack.cpp`` and ``decode_layer.cpp`` read (``python -m
  pagedhybrid.kernels.layer_spec`` writes it; the native build does before it compiles;
  ``tests/kernels/test_layer_spec.py`` checks the checked-in one).

A projection (``PROJECTION``) is its weight, or, held in int8 / int4, its codes in the weight's
place and 3 tensors (codes, scales, zeros) in ``quant``, in the projections' order.

A layer's order of operations is declared here too, once: its ``program``, a list of ``Op``s
(an entry of ``OPS``, the registers it reads and writes, the fields it reads). Both paths run it:
the modules (``models/qwen35/decoder.py`` ``DecoderLayer.forward``: each op one module call) and
the fused layer (``decode_layer.cpp`` ``run_layer``: each op one native kernel call, the program
read from ``layer_spec.h``). Register ``h`` is the layer's input and output.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagedhybrid.kernels.step import quant_tensors

WEIGHT, PROJECTION, POOL, INT, FLOAT = "weight", "projection", "pool", "int", "float"
TENSOR_KINDS = (WEIGHT, PROJECTION, POOL)
HEADER = Path(__file__).resolve().parent / "native" / "csrc" / "layer_spec.h"

# the derivations a field may name: its attribute's value in, the op's argument out
DERIVE: dict[str, Callable[[Any], Any]] = {
    "inverse_sqrt": lambda head_size: head_size ** -0.5,  # the attention scale of a head size
    "rows": lambda t: t.view(t.shape[0], -1),  # a depthwise conv's weight [C, 1, K] as [C, K]
}


class Field(NamedTuple):
    name: str  # the op's argument
    kind: str  # WEIGHT, PROJECTION, POOL, INT or FLOAT
    source: str = ""  # an attribute path on the decoder layer; "": the caller gives it
    derive: str = ""  # a DERIVE entry applied to the attribute's value


class Op(NamedTuple):
    """One step of a layer's program: ``op`` (an ``OPS`` entry) reads registers ``ins`` and the
    layer's ``fields`` (in its signature's order) and writes registers ``outs``."""

    op: str
    outs: tuple[str, ...]
    ins: tuple[str, ...]
    fields: tuple[str, ...] = ()


class OpSignature(NamedTuple):
    code: int  # its ``OpCode`` in layer_spec.h
    ins: int
    fields: tuple[str, ...]  # the kinds of its fields; "*": any number of PROJECTIONs
    what: str


# The ops a program is made of. Each has one implementation per path: a module call
# (decoder.py ``LAYER_OPS``) and a native kernel call (decode_layer.cpp ``run_layer``).
OPS: dict[str, OpSignature] = {
    "norm": OpSignature(0, 1, (WEIGHT, FLOAT), "rms_norm(x) * (1 + weight), eps"),
    "project": OpSignature(1, 1, ("*",), "x @ W^T for each projection: one output each"),
    "gdn_mixer": OpSignature(
        2, 4, (WEIGHT, POOL, WEIGHT, WEIGHT, POOL, WEIGHT, INT, FLOAT, FLOAT, FLOAT),
        "the Gated DeltaNet mixer of (qkv, z, a, b): causal conv + SiLU, q / k L2 norms, the "
        "gated delta rule on the state pool, the gated RMS norm (gdn_decode_mixer)"),
    "attend": OpSignature(
        3, 3, (WEIGHT, WEIGHT, POOL, POOL, INT, INT, FLOAT, FLOAT, INT),
        "full attention of (q | gate, k, v): q / k norms, RoPE, k / v written to their pages, "
        "paged attention, times sigmoid(gate)"),
    "add": OpSignature(4, 2, (), "a + b (a residual)"),
    "mlp": OpSignature(5, 1, (PROJECTION, PROJECTION, PROJECTION),
                       "down(silu(gate(x)) * up(x)) (a mixture of experts on the modules' path)"),
}


class LayerSpec(NamedTuple):
    name: str  # its namespace in layer_spec.h
    kind: int  # DecodeStack's ``kinds`` entry
    fields: tuple[Field, ...]
    program: tuple[Op, ...]

    def of(self, *kinds: str) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.kind in kinds)

    @property
    def tensors(self) -> tuple[Field, ...]:
        return self.of(*TENSOR_KINDS)

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    @property
    def registers(self) -> tuple[str, ...]:
        """The program's registers, ``h`` first, then in the order they are first written."""
        names = ["h"]
        for op in self.program:
            names += [r for r in op.outs if r not in names]
        return tuple(names)


_MLP = (Field("post_norm", WEIGHT, "post_attention_layernorm.weight"),
        Field("gate_proj", PROJECTION, "mlp.gate_proj"),
        Field("up_proj", PROJECTION, "mlp.up_proj"),
        Field("down_proj", PROJECTION, "mlp.down_proj"))

# h + mixer(norm(h)) is each kind's own; then, for both: h + mlp(norm(h))
_FEED_FORWARD = (Op("norm", ("x",), ("h",), ("post_norm", "rms_eps")),
                 Op("mlp", ("m",), ("x",), ("gate_proj", "up_proj", "down_proj")),
                 Op("add", ("h",), ("h", "m")))

GDN = LayerSpec("gdn", 0, (
    Field("input_norm", WEIGHT, "input_layernorm.weight"),
    Field("in_proj_qkv", PROJECTION, "linear_attn.in_proj_qkv"),
    Field("in_proj_z", PROJECTION, "linear_attn.in_proj_z"),
    Field("in_proj_b", PROJECTION, "linear_attn.in_proj_b"),
    Field("in_proj_a", PROJECTION, "linear_attn.in_proj_a"),
    Field("conv_weight", WEIGHT, "linear_attn.conv1d.weight", "rows"),
    Field("conv_pool", POOL),
    Field("a_log", WEIGHT, "linear_attn.A_log"),  # float32, as dt_bias
    Field("dt_bias", WEIGHT, "linear_attn.dt_bias"),
    Field("pool", POOL),
    Field("gated_norm", WEIGHT, "linear_attn.norm.weight"),
    Field("out_proj", PROJECTION, "linear_attn.out_proj"),
    *_MLP,
    Field("key_heads", INT, "linear_attn.num_k_heads"),
    Field("scale", FLOAT, "linear_attn.head_k_dim", "inverse_sqrt"),
    Field("l2_eps", FLOAT, "l2_eps"),  # the decoder layer's: the model's constant
    Field("gated_eps", FLOAT, "linear_attn.norm.eps"),
    Field("rms_eps", FLOAT, "input_layernorm.eps"),
), (
    Op("norm", ("x",), ("h",), ("input_norm", "rms_eps")),
    Op("project", ("qkv", "z", "a", "b"), ("x",),
       ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")),
    Op("gdn_mixer", ("y",), ("qkv", "z", "a", "b"),
       ("conv_weight", "conv_pool", "a_log", "dt_bias", "pool", "gated_norm", "key_heads",
        "scale", "l2_eps", "gated_eps")),
    Op("project", ("o",), ("y",), ("out_proj",)),
    Op("add", ("h",), ("h", "o")),
    *_FEED_FORWARD,
))

ATTENTION = LayerSpec("attention", 1, (
    Field("input_norm", WEIGHT, "input_layernorm.weight"),
    Field("q_proj", PROJECTION, "self_attn.q_proj"),
    Field("k_proj", PROJECTION, "self_attn.k_proj"),
    Field("v_proj", PROJECTION, "self_attn.v_proj"),
    Field("q_norm", WEIGHT, "self_attn.q_norm.weight"),
    Field("k_norm", WEIGHT, "self_attn.k_norm.weight"),
    Field("key_cache", POOL),
    Field("value_cache", POOL),
    Field("o_proj", PROJECTION, "self_attn.o_proj"),
    *_MLP,
    Field("heads", INT, "self_attn.num_heads"),
    Field("kv_heads", INT, "self_attn.num_kv_heads"),
    Field("scale", FLOAT, "self_attn.head_dim", "inverse_sqrt"),
    Field("rms_eps", FLOAT, "input_layernorm.eps"),  # the layer's four norms'
    Field("split", INT),
), (
    Op("norm", ("x",), ("h",), ("input_norm", "rms_eps")),
    Op("project", ("q", "k", "v"), ("x",), ("q_proj", "k_proj", "v_proj")),
    Op("attend", ("a",), ("q", "k", "v"),
       ("q_norm", "k_norm", "key_cache", "value_cache", "heads", "kv_heads", "scale", "rms_eps",
        "split")),
    Op("project", ("o",), ("a",), ("o_proj",)),
    Op("add", ("h",), ("h", "o")),
    *_FEED_FORWARD,
))

SPECS = (GDN, ATTENTION)
MAX_OUTS, MAX_INS, MAX_FIELDS = 4, 4, 10  # layer_spec.h's Step


def check_program(spec: LayerSpec) -> None:
    """Raise ``ValueError`` naming the op where ``spec``'s program is not one both paths can
    run: an op not in ``OPS``, a register read before it is written, fields not of the op's
    signature, or more registers or fields than ``Step`` holds."""
    fields = {f.name: f for f in spec.fields}
    written = {"h"}
    for n, op in enumerate(spec.program):
        where = f"{spec.name} program op {n} ({op.op})"
        sig = OPS.get(op.op)
        if sig is None:
            raise ValueError(f"{where}: not one of {sorted(OPS)}")
        if len(op.ins) != sig.ins or not op.outs or len(op.outs) > MAX_OUTS \
                or len(op.fields) > MAX_FIELDS:
            raise ValueError(f"{where}: takes {sig.ins} registers and at most {MAX_FIELDS} "
                             f"fields, writes 1 to {MAX_OUTS} (got {op})")
        unwritten = [r for r in op.ins if r not in written]
        if unwritten:
            raise ValueError(f"{where}: reads {unwritten} before they are written")
        kinds = [fields[f].kind if f in fields else f"unknown field {f!r}" for f in op.fields]
        want = [PROJECTION] * len(op.fields) if sig.fields == ("*",) else list(sig.fields)
        if kinds != want or (sig.fields == ("*",) and len(op.outs) != len(op.fields)):
            raise ValueError(f"{where}: fields {op.fields} are {kinds}, the op takes {want}"
                             + (" with one output each" if sig.fields == ("*",) else ""))
        written.update(op.outs)
    if not spec.program or "h" not in spec.program[-1].outs:
        raise ValueError(f"{spec.name} program: its last op must write h, the layer's output")


for _spec in SPECS:
    check_program(_spec)


class LayerWeights(NamedTuple):
    """A decoder layer's fields for its fused op (``spec``): ``args``, by name, those from the
    layer (the module's parameters themselves, a projection's weight or codes, the scalars);
    ``quant``: its int8 / int4 projections' tensors (``quant_tensors``) and ``quant_bits``."""

    spec: LayerSpec
    args: dict[str, Any]
    quant: tuple[torch.Tensor, ...] = ()
    quant_bits: int = 0

    def bound(self, given: Mapping[str, Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """(tensors, ints, floats) in the spec's order, ``given`` the caller's fields by name:
        one layer's part of ``DecodeStack``'s lists."""
        values = {**self.args, **given}
        tensors, ints, floats = ([values[f.name] for f in self.spec.of(*kinds)]
                                 for kinds in (TENSOR_KINDS, (INT,), (FLOAT,)))
        return tensors, ints, floats


def resolve(spec: LayerSpec, layer: Any) -> LayerWeights:
    """``spec``'s fields of ``layer`` (a decoder layer module)."""
    args: dict[str, Any] = {}
    quants = []
    for f in spec.fields:
        if not f.source:
            continue
        value = attrgetter(f.source)(layer)
        if f.kind == PROJECTION:
            quants.append(value.quant)
            value = value.weight if value.quant is None else value.quant.codes
        args[f.name] = DERIVE[f.derive](value) if f.derive else value
    quant, bits = quant_tensors(quants) if quants[0] is not None else ((), 0)
    return LayerWeights(spec, args, quant, bits)


def _enum(name: str, fields: tuple[Field, ...]) -> list[str]:
    body = ", ".join(f"{f.name} = {i}" for i, f in enumerate(fields))
    return [f"enum {name} : size_t {{", *textwrap.wrap(body, 98, initial_indent="  ",
                                                       subsequent_indent="  "), "};"]


def _program(spec: LayerSpec) -> list[str]:
    """``spec``'s program as layer_spec.h's ``kProgram``: per op its code, its registers (their
    places in ``registers``) and its fields (their places in the list of their kind)."""
    regs = {r: i for i, r in enumerate(spec.registers)}
    place = {f.name: i for kinds in (TENSOR_KINDS, (INT,), (FLOAT,))
             for i, f in enumerate(spec.of(*kinds))}
    lines = [f"constexpr size_t kRegisters = {len(regs)};  // {', '.join(regs)}",
             "constexpr int8_t kProjectionOf[kTensors] = {"
             + ", ".join(str(spec.of(PROJECTION).index(f)) if f.kind == PROJECTION else "-1"
                         for f in spec.tensors) + "};", "constexpr Step kProgram[] = {"]
    for op in spec.program:
        nums = [len(op.outs), len(op.ins), len(op.fields)]
        body = ", ".join([f"OpCode::{op.op}", *map(str, nums)] + [
            "{" + ", ".join(str(m[x]) for x in xs) + "}"
            for xs, m in ((op.outs, regs), (op.ins, regs), (op.fields, place))])
        what = (f"{', '.join(op.outs)} = {op.op}({', '.join(op.ins)}"
                f"{'; ' if op.fields else ''}{', '.join(op.fields)})")
        lines += [*textwrap.wrap(what, 98, initial_indent="    // ",
                                 subsequent_indent="    //   "), f"    {{{body}}},"]
    return [*lines, "};", "constexpr size_t kSteps = sizeof(kProgram) / sizeof(Step);"]


def header() -> str:
    """``native/csrc/layer_spec.h``: per kind, the indices of a layer's tensors, ints and floats
    in ``DecodeStack``'s lists, of its projections in ``quant``, their counts, and its program
    (``run_layer`` runs it)."""
    codes = ", ".join(f"{name} = {sig.code}" for name, sig in OPS.items())
    out = ["// Generated by `python -m pagedhybrid.kernels.layer_spec` from kernels/layer_spec.py "
           "(the fields", "// and programs of the fused decoder layers): do not edit.",
           "#pragma once", "", "#include <cstddef>", "#include <cstdint>", "",
           "namespace pagedhybrid {", "", f"enum class OpCode : uint8_t {{ {codes} }};",
           "// one op of a program: its registers written and read, its fields (each an index "
           "in the", "// layer's list of its kind: tensors, ints or floats, as OPS declares)",
           f"constexpr size_t kMaxOuts = {MAX_OUTS}, kMaxIns = {MAX_INS}, "
           f"kMaxFields = {MAX_FIELDS};", "struct Step {", "  OpCode op;",
           "  uint8_t n_outs, n_ins, n_fields;",
           "  int8_t outs[kMaxOuts], ins[kMaxIns], fields[kMaxFields];", "};"]
    for spec in SPECS:
        tensors, ints, floats = spec.tensors, spec.of(INT), spec.of(FLOAT)
        projections = spec.of(PROJECTION)
        out += ["", f"namespace {spec.name} {{", f"constexpr int64_t kKind = {spec.kind};",
                *_enum("TensorIndex", tensors), *_enum("IntIndex", ints),
                *_enum("FloatIndex", floats),
                f"constexpr size_t kTensors = {len(tensors)}, kInts = {len(ints)}, "
                f"kFloats = {len(floats)}, kProjections = {len(projections)};",
                "namespace projection {  // a projection's place in `quant` (3 tensors each)",
                *_enum("ProjIndex", projections), "}  // namespace projection",
                *_program(spec), f"}}  // namespace {spec.name}"]
    return "\n".join([*out, "", "}  // namespace pagedhybrid", ""])


def write_header(path: Path = HEADER) -> bool:
    """Write ``header()`` to ``path`` unless it holds it already; whether it wrote."""
    text = header()
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.write_text(text, encoding="utf-8")
    return True


if __name__ == "__main__":
    print(f"{HEADER}: {'written' if write_header() else 'current'}")
