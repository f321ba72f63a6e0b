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


class LayerSpec(NamedTuple):
    name: str  # its namespace in layer_spec.h
    kind: int  # DecodeStack's ``kinds`` entry
    fields: tuple[Field, ...]

    def of(self, *kinds: str) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.kind in kinds)

    @property
    def tensors(self) -> tuple[Field, ...]:
        return self.of(*TENSOR_KINDS)


_MLP = (Field("post_norm", WEIGHT, "post_attention_layernorm.weight"),
        Field("gate_proj", PROJECTION, "mlp.gate_proj"),
        Field("up_proj", PROJECTION, "mlp.up_proj"),
        Field("down_proj", PROJECTION, "mlp.down_proj"))

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
))

SPECS = (GDN, ATTENTION)


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


def header() -> str:
    """``native/csrc/layer_spec.h``: per kind, the indices of a layer's tensors, ints and floats
    in ``DecodeStack``'s lists, of its projections in ``quant``, and their counts."""
    out = ["// Generated by `python -m pagedhybrid.kernels.layer_spec` from kernels/layer_spec.py "
           "(the fields", "// of the fused decoder layers): do not edit.", "#pragma once", "",
           "#include <cstddef>", "#include <cstdint>", "", "namespace pagedhybrid {"]
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
                f"}}  // namespace {spec.name}"]
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
