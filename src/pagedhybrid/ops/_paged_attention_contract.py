"""Contract of ``com.microsoft.PagedAttention`` (SEPARATE K/V layout): OpSpec and validation.

The spec mirrors ONNX Runtime 1.32.0's schema (17 inputs, 3 outputs, 16 attributes) exactly;
``validate`` applies every shape/value rule of ORT's ``paged_attention_helper.h`` plus the rules
ORT leaves as undefined behaviour (block-table and slot ranges, repeated pages, under-estimated
``attention_metadata`` bounds), and returns the derived dimensions as a ``PagedAttentionDims`` so
the reference, fast kernels and loaders validate once. ``validate_call`` takes the
``BoundCall`` every implementation receives (``SPEC.bind``); ``validate(inputs, attrs)`` is the
same check for a call given as a list of inputs and a dict of attributes.

Cache layout: ``key_cache``/``value_cache`` are ``[num_blocks, block_size, kv_num_heads,
head_size]``; token ``i`` of sequence ``b`` lives at position ``p = past_seqlens[b] + i``, page
``block_table[b, p // block_size]``, offset ``p % block_size`` (flat slot
``page * block_size + offset``).

Quantized caches (ORT's schema): ``key_cache``/``value_cache`` of element type int8 or
float8e4m3fn need ``k_quant_type``/``v_quant_type`` PER_TENSOR or PER_CHANNEL (non-NONE exactly
when the cache is quantized) and float ``k_scale``/``v_scale`` of shape ``(1)`` / ``(kv_num_heads,
1, head_size)``, finite and >= 0; ``k_cache_dtype``/``v_cache_dtype`` may name the cache's own
type. The rule is ``pagedhybrid.kvquant``'s.

pagedhybrid extension: ``T``/``T_CACHE`` also accept float32 (and float64, for tests); ORT takes
float16/bfloat16 only. Sub-byte caches (uint8 element type, ``k_cache_dtype`` int4/float4e2m1:
their packing is not verifiable here without a CUDA run) and ``kv_cache_layout='LATENT'`` raise
``UnsupportedConfiguration``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from pagedhybrid.dtypes import describe
from pagedhybrid.ops.spec import (
    Attribute,
    BoundCall,
    OpSpec,
    Port,
    TypeConstraint,
    check_cu_seqlens,
    check_shape,
)

_QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
_SUB_BYTE = ("int4", "float4e2m1")
_CACHE_DTYPES = ("", "float16", "bfloat16", "int8", "float8e4m3fn", "float", "double")
_QUANTIZED = (torch.int8, torch.float8_e4m3fn)

SPEC = OpSpec(
    domain="com.microsoft",
    name="PagedAttention",
    version=1,
    doc="Packed varlen attention over a paged KV cache; writes this step's K/V into the pages.",
    inputs=(
        Port("query", "T", ranks=(2,), shape="[num_tokens, num_heads*head_size] or packed "
             "[num_tokens, (num_heads+2*kv_num_heads)*head_size]"),
        Port("key", "T", optional=True, ranks=(2,), shape="[num_tokens, kv_num_heads*head_size]"),
        Port("value", "T", optional=True, ranks=(2,),
             shape="[num_tokens, kv_num_heads*head_size]"),
        Port("key_cache", "T_CACHE", ranks=(4,),
             shape="[num_blocks, block_size, kv_num_heads, head_size]", doc="updated in place"),
        Port("value_cache", "T_CACHE", optional=True, ranks=(4,),
             shape="[num_blocks, block_size, kv_num_heads, head_size]",
             doc="updated in place; required for SEPARATE"),
        Port("cumulative_sequence_length", "S", ranks=(1,), shape="[batch+1]"),
        Port("past_seqlens", "S", ranks=(1,), shape="[batch]"),
        Port("block_table", "S", ranks=(2,), shape="[batch, max_blocks_per_seq]",
             doc="-1 = unmapped page"),
        Port("cos_cache", "T", optional=True, ranks=(2,), shape="[max_pos, rotary_dim/2]"),
        Port("sin_cache", "T", optional=True, ranks=(2,), shape="[max_pos, rotary_dim/2]"),
        Port("slot_mapping", "S", optional=True, ranks=(1,), shape="[num_tokens]",
             doc="flat write slot per token, -1 = skip the write"),
        Port("head_sink", "T", optional=True, ranks=(1,), shape="[num_heads]"),
        Port("q_norm_weight", "T", optional=True, ranks=(1,), shape="[head_size]"),
        Port("k_norm_weight", "T", optional=True, ranks=(1,), shape="[head_size]"),
        Port("k_scale", "T_KV_SCALE", optional=True, ranks=(1, 3),
             shape="[1] (PER_TENSOR) or [kv_num_heads, 1, head_size] (PER_CHANNEL)",
             doc="dequantization scale of key_cache; quantized caches only"),
        Port("v_scale", "T_KV_SCALE", optional=True, ranks=(1, 3),
             shape="[1] (PER_TENSOR) or [kv_num_heads, 1, head_size] (PER_CHANNEL)",
             doc="dequantization scale of value_cache; quantized caches only"),
        Port("attention_metadata", "S", optional=True, ranks=(1,), shape="[2] or [3]",
             doc="[max_query_len_bound, max_kv_len_bound, (max_kv_len_lower_bound)], 0 = unknown"),
    ),
    outputs=(
        Port("output", "T", shape="[num_tokens, num_heads*head_size]"),
        Port("key_cache_out", "T_CACHE", optional=True, doc="aliases key_cache"),
        Port("value_cache_out", "T_CACHE", optional=True, doc="aliases value_cache"),
    ),
    attributes=(
        Attribute("num_heads", "int"),
        Attribute("kv_num_heads", "int"),
        Attribute("scale", "float", 0.0, doc="0 = 1/sqrt(head_size)"),
        Attribute("softcap", "float", 0.0, doc="0 = off; else softcap*tanh(logit/softcap)"),
        Attribute("local_window_size", "int", -1,
                  doc="-1 = off; w > 0: a query at position p sees keys j >= p - w"),
        Attribute("is_causal", "int", 1, choices=(0, 1)),
        Attribute("do_rotary", "int", 0, choices=(0, 1)),
        Attribute("rotary_interleaved", "int", 0, choices=(0, 1)),
        Attribute("rotary_offset", "int", 0),
        Attribute("qk_norm_epsilon", "float", 1e-6),
        Attribute("kv_cache_layout", "string", "SEPARATE", choices=("SEPARATE",),
                  unsupported=("LATENT",)),
        Attribute("k_quant_type", "string", "NONE", choices=_QUANT_TYPES),
        Attribute("v_quant_type", "string", "NONE", choices=_QUANT_TYPES),
        Attribute("k_cache_dtype", "string", "", choices=_CACHE_DTYPES, unsupported=_SUB_BYTE),
        Attribute("v_cache_dtype", "string", "", choices=_CACHE_DTYPES, unsupported=_SUB_BYTE),
        Attribute("v_head_size", "int", 0, doc="0 = head_size; other values are LATENT-only"),
    ),
    type_constraints=(
        TypeConstraint("T", ("float16", "bfloat16"), extension=("float", "double")),
        TypeConstraint("T_CACHE", ("float16", "bfloat16", "int8", "float8e4m3fn", "uint8"),
                       extension=("float", "double"), unsupported=("uint8",)),
        TypeConstraint("T_KV_SCALE", ("float",)),
        TypeConstraint("S", ("int32",)),
    ),
)

INPUT_NAMES = tuple(p.name for p in SPEC.inputs)


class PagedAttentionDims(NamedTuple):
    """Everything derived from a valid call (python ints/lists, no tensors)."""

    num_tokens: int
    batch: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    packed_qkv: bool
    rotary_dim: int  # 2 * cos_cache.shape[1]; 0 without cos/sin
    cu_seqlens: list[int]  # [batch+1]
    q_lens: list[int]  # [batch] new tokens per sequence
    past_lens: list[int]  # [batch] tokens already in the cache
    total_lens: list[int]  # [batch] past + new
    write_slots: list[int]  # [num_tokens] flat cache slot written by each token, -1 = none
    max_query_len: int
    max_kv_len: int  # over sequences with at least one new token
    scale: float  # effective softmax scale
    dtype: torch.dtype  # element type of query (T)
    cache_dtype: torch.dtype  # element type of the caches (T_CACHE)
    has_slot_mapping: bool
    has_head_sink: bool
    has_qk_norm: bool
    has_metadata: bool
    attrs: dict[str, Any]  # resolved attributes (defaults filled in)


def _check_attributes(a: dict[str, Any]) -> dict[str, Any]:
    """The attribute rules beyond kind and allowed values (``a`` already resolved)."""
    chk = SPEC.check
    chk(a["num_heads"] > 0, "num_heads", "must be > 0", a["num_heads"])
    chk(a["kv_num_heads"] > 0, "kv_num_heads", "must be > 0", a["kv_num_heads"])
    chk(a["num_heads"] % a["kv_num_heads"] == 0, "kv_num_heads", "must divide num_heads",
        f"{a['num_heads']} % {a['kv_num_heads']}")
    chk(math.isfinite(a["scale"]), "scale", "must be finite (0 = 1/sqrt(head_size))", a["scale"])
    chk(math.isfinite(a["softcap"]) and a["softcap"] >= 0.0, "softcap",
        "must be finite and >= 0 (0 = off)", a["softcap"])
    w = a["local_window_size"]
    chk(w == -1 or w > 0, "local_window_size", "must be -1 (off) or > 0", w)
    r = a["rotary_offset"]
    chk(r >= 0 and r % 8 == 0, "rotary_offset", "must be >= 0 and a multiple of 8", r)
    chk(a["v_head_size"] >= 0, "v_head_size", "must be >= 0 (0 = head_size)", a["v_head_size"])
    return a


def _check_cache_dtype_attr(attr: str, value: str, cache: torch.Tensor) -> None:
    SPEC.check(value in ("", describe(cache.dtype)), attr,
               "must be '' or name the cache's own element type", f"{value!r} vs "
               f"{describe(cache.dtype)}")


def _check_quant(kv: str, quant: str, scale: torch.Tensor | None, quantized: bool, hkv: int,
                 d: int) -> None:
    cache, port, attr = f"{'key' if kv == 'k' else 'value'}_cache", f"{kv}_scale", \
        f"{kv}_quant_type"
    chk = SPEC.check
    chk((quant != "NONE") == quantized, attr, f"must be non-NONE exactly when '{cache}' has a "
        "quantized element type (int8, float8e4m3fn)", quant)
    if not quantized:
        chk(scale is None, port, "is given only with a quantized cache", "present")
        return
    chk(scale is not None, port, f"is required when {attr}={quant}", "None")
    assert scale is not None
    shape = [1] if quant == "PER_TENSOR" else [hkv, 1, d]
    layout = "(1)" if quant == "PER_TENSOR" else "(kv_num_heads, 1, head_size)"
    check_shape(SPEC, port, scale, shape, f"{layout} for {quant}")
    chk(bool(torch.isfinite(scale).all()) and bool((scale >= 0).all()), port,
        "must be finite and >= 0 (0 stores zeros)", float(scale.min()))


def validate(inputs: Sequence[torch.Tensor | None], attrs: Mapping[str, Any]) -> PagedAttentionDims:
    """``validate_call`` of the inputs in ORT order (trailing absent ones may be left out) and the
    attributes by name."""
    return validate_call(SPEC.bind(*inputs, **attrs))


def validate_call(call: BoundCall) -> PagedAttentionDims:
    """Check a bound call; return its dims.

    Raises ContractViolation naming the port/attribute and the rule, UnsupportedConfiguration for
    valid ORT configurations pagedhybrid does not implement (sub-byte caches, LATENT).
    """
    a = _check_attributes(call.attrs)
    SPEC.check_inputs(call.inputs)
    (query, key, value, key_cache, value_cache, cu, past, block_table, cos, sin, slot_mapping,
     head_sink, q_norm, k_norm, k_scale, v_scale, meta) = call.inputs
    hq, hkv = a["num_heads"], a["kv_num_heads"]
    assert query is not None and key_cache is not None  # required ports (checked above)
    assert cu is not None and past is not None and block_table is not None

    # -- Q/K/V --------------------------------------------------------------------------------
    n_tok, packed, d = _check_qkv(a, query, key, value, value_cache)
    assert value_cache is not None

    # -- caches -------------------------------------------------------------------------------
    nb, bs = _check_caches(a, query, key_cache, value_cache, k_scale, v_scale, d)

    # -- sequence metadata --------------------------------------------------------------------
    cu_vals, past_vals, max_blocks, q_lens, totals, derived = _check_sequences(
        cu, past, block_table, n_tok, nb, bs)
    batch = len(cu_vals) - 1
    max_q = max(q_lens, default=0)
    max_kv = max((t for t, q in zip(totals, q_lens, strict=True) if q > 0), default=0)

    # -- slot_mapping -------------------------------------------------------------------------
    slots = _check_slot_mapping(slot_mapping, derived, n_tok, nb, bs)

    # -- rotary -------------------------------------------------------------------------------
    rotary_dim = _check_rotary(a, cos, sin, d, max_kv)

    # -- optional per-head inputs -------------------------------------------------------------
    _check_per_head_inputs(a, head_sink, q_norm, k_norm, hq, d)

    # -- attention_metadata -------------------------------------------------------------------
    if meta is not None:
        _check_metadata(meta, max_q, max_kv)

    scale = a["scale"] if a["scale"] != 0.0 else 1.0 / math.sqrt(d)
    return PagedAttentionDims(
        num_tokens=n_tok, batch=batch, num_heads=hq, kv_num_heads=hkv, head_size=d,
        block_size=bs, num_blocks=nb, max_blocks_per_seq=max_blocks, packed_qkv=packed,
        rotary_dim=rotary_dim, cu_seqlens=cu_vals, q_lens=q_lens, past_lens=past_vals,
        total_lens=totals, write_slots=slots, max_query_len=max_q, max_kv_len=max_kv,
        scale=scale, dtype=query.dtype, cache_dtype=key_cache.dtype,
        has_slot_mapping=slot_mapping is not None, has_head_sink=head_sink is not None,
        has_qk_norm=q_norm is not None, has_metadata=meta is not None, attrs=a,
    )


def _check_qkv(a: dict[str, Any], query: torch.Tensor, key: torch.Tensor | None,
               value: torch.Tensor | None,
               value_cache: torch.Tensor | None) -> tuple[int, bool, int]:
    """Q/K/V: the value cache is given, key/value both or neither (packed QKV), the head size;
    returns ``(num_tokens, packed, head_size)``."""
    chk = SPEC.check
    hq, hkv = a["num_heads"], a["kv_num_heads"]
    chk(value_cache is not None, "value_cache", "is required when kv_cache_layout='SEPARATE'",
        "None")
    assert value_cache is not None
    chk((key is None) == (value is None), "key" if key is None else "value",
        "'key' and 'value' must be both present or both absent (packed QKV)",
        f"key={'absent' if key is None else 'present'}, "
        f"value={'absent' if value is None else 'present'}")
    n_tok, width = int(query.shape[0]), int(query.shape[1])
    packed = key is None
    heads_in_query = hq + 2 * hkv if packed else hq
    chk(width % heads_in_query == 0, "query",
        f"dim 1 must be a multiple of {'num_heads+2*kv_num_heads' if packed else 'num_heads'} "
        f"({heads_in_query})", width)
    d = width // heads_in_query
    chk(d > 0 and d % 8 == 0, "query", "head_size must be a positive multiple of 8", d)
    if not packed:
        assert key is not None and value is not None
        check_shape(SPEC, "key", key, [n_tok, hkv * d], "[num_tokens, kv_num_heads*head_size]")
        check_shape(SPEC, "value", value, [n_tok, hkv * d],
                    "[num_tokens, kv_num_heads*head_size]")
    chk(a["v_head_size"] in (0, d), "v_head_size",
        f"may differ from head_size ({d}) only when kv_cache_layout='LATENT'", a["v_head_size"])
    return n_tok, packed, d


def _check_caches(a: dict[str, Any], query: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, d: int) -> tuple[int, int]:
    """The paged caches: shape, block size, element type, quantization and its scales; returns
    ``(num_blocks, block_size)``."""
    chk = SPEC.check
    hkv = a["kv_num_heads"]
    nb, bs = int(key_cache.shape[0]), int(key_cache.shape[1])
    chk(bs >= 16 and bs & (bs - 1) == 0, "key_cache",
        "dim 1 (block_size) must be a power of two >= 16", bs)
    chk(int(key_cache.shape[2]) == hkv, "key_cache", f"dim 2 must be kv_num_heads ({hkv})",
        int(key_cache.shape[2]))
    chk(int(key_cache.shape[3]) == d, "key_cache", f"dim 3 must be head_size ({d})",
        int(key_cache.shape[3]))
    check_shape(SPEC, "value_cache", value_cache, list(key_cache.shape), "(same as key_cache)")
    quantized = key_cache.dtype in _QUANTIZED
    chk(quantized or key_cache.dtype == query.dtype, "key_cache",
        "must have the element type of 'query' or a quantized one (int8, float8e4m3fn)",
        f"{describe(key_cache.dtype)} vs {describe(query.dtype)}")
    _check_cache_dtype_attr("k_cache_dtype", a["k_cache_dtype"], key_cache)
    _check_cache_dtype_attr("v_cache_dtype", a["v_cache_dtype"], value_cache)
    for kv, scale_t in (("k", k_scale), ("v", v_scale)):
        _check_quant(kv, a[f"{kv}_quant_type"], scale_t, quantized, hkv, d)
    return nb, bs


def _check_sequences(cu: torch.Tensor, past: torch.Tensor, block_table: torch.Tensor, n_tok: int,
                     nb: int, bs: int
                     ) -> tuple[list[int], list[int], int, list[int], list[int], list[int]]:
    """Sequence metadata and the block table's needed pages; returns ``(cu_seqlens, past_lens,
    max_blocks_per_seq, q_lens, total_lens, derived write slots)``."""
    chk, fail = SPEC.check, SPEC.fail
    cu_vals = check_cu_seqlens(SPEC, "cumulative_sequence_length", cu, n_tok)
    batch = len(cu_vals) - 1
    check_shape(SPEC, "past_seqlens", past, [batch], "[batch]")
    past_vals = [int(v) for v in past.tolist()]
    chk(all(v >= 0 for v in past_vals), "past_seqlens", "must be >= 0", past_vals)
    chk(int(block_table.shape[0]) == batch, "block_table", f"dim 0 must be batch ({batch})",
        int(block_table.shape[0]))
    max_blocks = int(block_table.shape[1])
    capacity = max_blocks * bs
    table = block_table.tolist()
    q_lens = [cu_vals[b + 1] - cu_vals[b] for b in range(batch)]
    totals = [past_vals[b] + q_lens[b] for b in range(batch)]
    derived: list[int] = []
    for b in range(batch):
        if q_lens[b] == 0:
            chk(past_vals[b] <= capacity, "past_seqlens",
                f"sequence {b} exceeds the block table capacity ({capacity} tokens)",
                past_vals[b])
            continue
        chk(totals[b] <= capacity, "block_table",
            f"has too few pages for sequence {b}: past+new = {totals[b]} tokens needs "
            f"{-(-totals[b] // bs)} pages of {bs}", f"{max_blocks} columns")
        pages = table[b][: -(-totals[b] // bs)]
        for j, pg in enumerate(pages):
            if not 0 <= pg < nb:
                raise fail("block_table",
                           f"entry [{b}, {j}] is a needed page and must be in [0, num_blocks="
                           f"{nb}) (-1 = unmapped is legal only for pages not needed)", pg)
        chk(len(set(pages)) == len(pages), "block_table",
            f"row {b} repeats a page among its needed pages", pages)
        for i in range(q_lens[b]):
            p = past_vals[b] + i
            derived.append(pages[p // bs] * bs + p % bs)
    return cu_vals, past_vals, max_blocks, q_lens, totals, derived


def _check_slot_mapping(slot_mapping: torch.Tensor | None, derived: list[int], n_tok: int,
                        nb: int, bs: int) -> list[int]:
    """``slot_mapping`` (or, without it, the slots the block table derives): in range, no slot
    written twice; returns the write slots."""
    chk, fail = SPEC.check, SPEC.fail
    if slot_mapping is not None:
        check_shape(SPEC, "slot_mapping", slot_mapping, [n_tok], "[num_tokens]")
        slots = [int(v) for v in slot_mapping.tolist()]
        for t, s in enumerate(slots):
            if not (s == -1 or 0 <= s < nb * bs):
                raise fail("slot_mapping", f"entry {t} must be -1 (skip) or in [0, num_blocks*"
                           f"block_size={nb * bs})", s)
        written = [s for s in slots if s >= 0]
        chk(len(set(written)) == len(written), "slot_mapping",
            "must not write one slot twice (entries other than -1 must be distinct)", slots)
    else:
        slots = derived
        chk(len(set(slots)) == len(slots), "block_table",
            "sequences must not write the same cache slot (a page shared by two sequences is "
            "written by both)", slots)
    return slots


def _check_rotary(a: dict[str, Any], cos: torch.Tensor | None, sin: torch.Tensor | None, d: int,
                  max_kv: int) -> int:
    """``cos_cache``/``sin_cache`` against head size, ``rotary_offset`` and ``do_rotary``;
    returns ``rotary_dim`` (0 without rotary)."""
    chk = SPEC.check
    chk((cos is None) == (sin is None), "cos_cache" if cos is None else "sin_cache",
        "'cos_cache' and 'sin_cache' must be both present or both absent")
    rotary_dim = 0
    if cos is not None:
        assert sin is not None
        chk(d % 16 == 0, "cos_cache", "rotary needs head_size to be a multiple of 16", d)
        check_shape(SPEC, "sin_cache", sin, list(cos.shape), "(same as cos_cache)")
        half = int(cos.shape[1])
        chk(half > 0 and half % 8 == 0, "cos_cache",
            "dim 1 (rotary_dim/2) must be a positive multiple of 8", half)
        rotary_dim = 2 * half
        chk(a["rotary_offset"] + rotary_dim <= d, "rotary_offset",
            f"rotary_offset + rotary_dim ({rotary_dim}) must be <= head_size ({d})",
            a["rotary_offset"])
        if a["do_rotary"]:
            chk(int(cos.shape[0]) >= max_kv, "cos_cache",
                f"dim 0 must cover every position (>= max past+new length {max_kv})",
                int(cos.shape[0]))
    chk(not a["do_rotary"] or cos is not None, "cos_cache",
        "is required (with sin_cache) when do_rotary=1", "None")
    return rotary_dim


def _check_per_head_inputs(a: dict[str, Any], head_sink: torch.Tensor | None,
                           q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, hq: int,
                           d: int) -> None:
    """The optional per-head inputs: ``head_sink`` and the q/k norm weights."""
    chk = SPEC.check
    if head_sink is not None:
        check_shape(SPEC, "head_sink", head_sink, [hq], "[num_heads]")
    chk((q_norm is None) == (k_norm is None), "q_norm_weight" if q_norm is None
        else "k_norm_weight", "'q_norm_weight' and 'k_norm_weight' must be given together",
        "only one given")
    if q_norm is not None:
        assert k_norm is not None
        check_shape(SPEC, "q_norm_weight", q_norm, [d], "[head_size]")
        check_shape(SPEC, "k_norm_weight", k_norm, [d], "[head_size]")
        eps = a["qk_norm_epsilon"]
        chk(math.isfinite(eps) and eps > 0, "qk_norm_epsilon", "must be finite and > 0", eps)


def _check_metadata(meta: torch.Tensor, max_q: int, max_kv: int) -> None:
    """``attention_metadata``: its bounds must not underestimate the call's lengths."""
    chk = SPEC.check
    chk(int(meta.shape[0]) in (2, 3), "attention_metadata", "must have length 2 or 3",
        int(meta.shape[0]))
    mv = [int(v) for v in meta.tolist()]
    chk(all(v >= 0 for v in mv), "attention_metadata", "entries must be >= 0 (0 = unknown)",
        mv)
    chk(mv[0] == 0 or mv[0] >= max_q, "attention_metadata",
        f"[0] (max_query_len_bound) underestimates the largest query length ({max_q})", mv)
    chk(mv[1] == 0 or mv[1] >= max_kv, "attention_metadata",
        f"[1] (max_kv_len_bound) underestimates the largest past+new length ({max_kv})", mv)
    if len(mv) == 3 and mv[2] > 0:
        chk(mv[1] == 0 or mv[2] <= mv[1], "attention_metadata",
            "[2] (max_kv_len_lower_bound) must not exceed [1] (max_kv_len_bound)", mv)
        chk(mv[2] <= max_kv, "attention_metadata",
            f"[2] (max_kv_len_lower_bound) exceeds the largest past+new length ({max_kv})",
            mv)


def output_shapes(inputs: Sequence[torch.Tensor | None],
                  attrs: Mapping[str, Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of ``output``, ``key_cache_out``, ``value_cache_out`` for a valid call."""
    dims = validate(inputs, attrs)
    kc, vc = inputs[3], inputs[4]
    assert kc is not None and vc is not None
    return [((dims.num_tokens, dims.num_heads * dims.head_size), dims.dtype),
            (tuple(kc.shape), kc.dtype), (tuple(vc.shape), vc.dtype)]
