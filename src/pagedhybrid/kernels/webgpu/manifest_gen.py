"""Generate the PagedAttention package's ``manifest.json`` from the op contract.

Ports, their order, dtypes (type variables), ranks, presence and the attributes with their
defaults come from ``pagedhybrid.ops.paged_attention.SPEC`` (ONNX Runtime's schema), filtered to
what this package implements; ``tests/kernels/webgpu/test_package.py`` regenerates the manifest
and compares it with the file, so the two cannot drift. What is package-specific (bind keys,
descriptions from the kernel card, tunables, derive expressions, variants and passes) is written
here.

Bind keys are the camelCase ONNX names plus ``T`` (``key_cache`` -> ``keyCacheT``); an output
``X_out`` that aliases input ``X`` takes ``X``'s bind key, which makes it an inout port (the
cache updated in place). ``T_CACHE`` folds into ``T``: this package stores caches in the query's
element type (float16).
"""

from __future__ import annotations

from typing import Any

from pagedhybrid.ops.spec import OpSpec

SUPPORTED_INPUTS = ("query", "key", "value", "key_cache", "value_cache",
                    "cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping")
REQUIRED_HERE = ("value_cache",)  # optional in ORT (LATENT layout), required for SEPARATE
SUPPORTED_ATTRIBUTES = ("is_causal", "kv_num_heads", "local_window_size", "num_heads", "scale")
SUPPORTED_VALUES: dict[str, list[Any]] = {"is_causal": [0, 1]}
DTYPES = {"T": ("float16",), "T_CACHE": ("float16",), "S": ("int32",)}
TYPE_VAR = {"T_CACHE": "T"}  # caches share the query's element type here
STORAGE = {"S": "int32"}

DESCRIPTIONS = {
    "query": "Packed queries of shape `(num_tokens, num_heads * head_size)`, or `(num_tokens, "
             "(num_heads + 2 * kv_num_heads) * head_size)` when `key` and `value` are absent "
             "and Q, K and V share one row.",
    "key": "Keys of shape `(num_tokens, kv_num_heads * head_size)`. Absent means `query` "
           "carries packed `[Q|K|V]`.",
    "value": "Values of shape `(num_tokens, kv_num_heads * head_size)`. Present exactly when "
             "`key` is.",
    "key_cache": "Block-based key cache of shape `(num_blocks, block_size, kv_num_heads, "
                 "head_size)`, updated in place.",
    "value_cache": "Block-based value cache with the same shape as `key_cache`, updated in "
                   "place.",
    "cumulative_sequence_length": "Exclusive prefix sums of the per-sequence token counts, "
                                  "shape `(batch_size + 1)`; sequence `b` owns packed tokens "
                                  "`[cum[b], cum[b+1])`.",
    "past_seqlens": "Cached history length per sequence, shape `(batch_size)`.",
    "block_table": "Physical block index per sequence and logical block, shape `(batch_size, "
                   "max_blocks_per_sequence)`.",
    "slot_mapping": "Flat destination slot, `block_id * block_size + offset`, for each token; "
                    "`-1` suppresses that token's cache write. When omitted, the slot is "
                    "derived from `past_seqlens`. `block_table` remains required because it "
                    "defines the read path.",
    "output": "Attention output of shape `(num_tokens, num_heads * head_size)`.",
    "key_cache_out": "Optional return alias for the updated in-place key cache. The runtime "
                     "updates both caches together even when only this alias is requested.",
    "value_cache_out": "Optional return alias for the updated in-place value cache. The "
                       "runtime updates both caches together even when only this alias is "
                       "requested.",
    "is_causal": "1: a query at position `p` sees keys `[0, p]`; 0: it sees every key of its "
                 "sequence (a block drafter's bidirectional block over its history). Older ORT "
                 "schema revisions omit this attribute and are always causal.",
    "local_window_size": "`w > 0`: a query at position `p` sees only keys `>= p - w` (`w + 1` "
                         "keys with itself when causal; the left side only otherwise); -1: "
                         "no window.",
    "kv_num_heads": "Number of key/value heads.",
    "num_heads": "Number of query heads.",
    "scale": "Scale applied to query-key products; zero or omission selects "
             "`1 / sqrt(head_size)`.",
}
OP_DESCRIPTION = (
    "Attention over a block-based (paged) KV cache: `cumulative_sequence_length` marks the "
    "sequence boundaries and `block_table` maps a sequence's history onto scattered blocks. This "
    "step's K/V are scattered into the cache, then attended with that history. Grouped-query "
    "heads, `scale`, `is_causal` 0 / 1, `local_window_size`, packed `[Q|K|V]`, `slot_mapping`, "
    "and float16 cache storage are supported; the cache outputs alias the input caches and are "
    "updated in place. Rotary embeddings, softcap, LATENT layout, narrower value heads, "
    "quantized KV, head sinks, q/k normalization, scales, and attention metadata are not "
    "implemented.")

TUNABLES = {
    "useSubgroups": (1, "1: use the subgroup-lanes attention body where the device has "
                        "subgroups of at least 8 invocations and head_size % 32 == 0; 0: always "
                        "the portable body."),
    "subgroupRows": (8, "Query rows (token x query head) per 8-lane workgroup of the subgroup "
                        "body."),
    "attnRows": (8, "Query rows (token x query head of one kv head) per workgroup of the "
                    "portable body; lavapipe's f32 SIMD width is 8."),
    "keyChunk": (16, "Keys scored per online-softmax step (divides block_size)."),
    "splitKMinContext": (512, "Decode steps (max query length 1) whose longest context reaches "
                              "this many keys use the split-K (flash-decode) variant."),
    "splitKMinChunk": (256, "Fewest keys per split-K partition."),
    "maxSplits": (16, "Most split-K partitions per sequence."),
    "scatterWorkgroupSize": (64, "Invocations per workgroup of the K/V scatter pass."),
    "mergeWorkgroupSize": (64, "Invocations per workgroup of the split-K merge pass."),
}

DERIVE = {
    "headSize": "{{ shapes.keyCacheT[3] }}",
    "headVec": "{{ floor(shapes.keyCacheT[3] / 4) }}",
    "blockSize": "{{ shapes.keyCacheT[1] }}",
    "numSlots": "{{ shapes.keyCacheT[0] * shapes.keyCacheT[1] }}",
    "group": "{{ floor(attrs.num_heads / attrs.kv_num_heads) }}",
    "numTokens": "{{ shapes.queryT[0] }}",
    "batchSize": "{{ shapes.cumulativeSequenceLengthT[0] - 1 }}",
    "maxBlocks": "{{ shapes.blockTableT[1] }}",
    "qStrideVec": "{{ floor(shapes.queryT[1] / 4) }}",
    "kvStrideVec": "{{ attrs.kv_num_heads * derive.headVec }}",
    "kOffsetVec": "{{ attrs.num_heads * derive.headVec }}",
    "vOffsetVec": "{{ (attrs.num_heads + attrs.kv_num_heads) * derive.headVec }}",
    "scale": "{{ attrs.scale if attrs.scale else 1.0 / pow(derive.headSize, 0.5) }}",
    "keyChunk": "{{ min(tunables.keyChunk, derive.blockSize) }}",
    "lanesPerVec": "{{ floor(derive.headVec / 8) }}",
    "subgroupLanes": "{{ tunables.useSubgroups == 1 and 'subgroups' in device.features and "
                     "(device.adapterInfo.subgroupMinSize or 0) >= 8 and "
                     "derive.headVec % 8 == 0 }}",
    "rowsPerWorkgroup": "{{ tunables.subgroupRows if derive.subgroupLanes "
                        "else tunables.attnRows }}",
}

ARGS = {
    "maxQueryLen": {"kind": "u32", "required": False,
                    "description": "Upper bound of the new tokens of any sequence (ORT's "
                                   "attention_metadata[0]); derived from "
                                   "cumulative_sequence_length when omitted."},
    "maxKvLen": {"kind": "u32", "required": False,
                 "description": "Upper bound of past + new tokens of any sequence with new "
                                "tokens (ORT's attention_metadata[1]); derived when omitted."},
}


def bind_key(onnx_name: str) -> str:
    base = onnx_name[: -len("_out")] if onnx_name.endswith("_out") else onnx_name
    head, *rest = base.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest) + "T"


def _u32(name: str, expr: str) -> dict[str, Any]:
    return {"name": name, "type": "u32", "value": expr}


def _uniform(fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {"buffer": "uniform", "name": "params", "structName": "Params", "struct": fields}


def _ro(name: str, elem: str) -> dict[str, Any]:
    return {"buffer": "read-only-storage", "name": name, "elementType": elem}


def _rw(name: str, elem: str) -> dict[str, Any]:
    return {"buffer": "storage", "name": name, "elementType": elem}


def _scratch(name: str, elem: str) -> dict[str, Any]:
    return {"buffer": "storage", "scratch": name, "elementType": elem}


_META = [_ro("cumulativeSequenceLengthT", "i32"), _ro("pastSeqlensT", "i32"),
         _ro("blockTableT", "i32")]


def _scatter_pass(packed: bool) -> dict[str, Any]:
    sources = [_ro("queryT", "vec4<f16>")] if packed else [_ro("keyT", "vec4<f16>"),
                                                           _ro("valueT", "vec4<f16>")]
    fields = [_u32("num_tokens", "{{ derive.numTokens }}"),
              _u32("batch_size", "{{ derive.batchSize }}"),
              _u32("max_blocks", "{{ derive.maxBlocks }}"),
              _u32("num_slots", "{{ derive.numSlots }}"),
              _u32("q_stride", "{{ derive.qStrideVec }}"),
              _u32("k_stride", "{{ derive.kvStrideVec }}"),
              _u32("v_stride", "{{ derive.kvStrideVec }}"),
              _u32("k_offset", "{{ derive.kOffsetVec }}"),
              _u32("v_offset", "{{ derive.vOffsetVec }}")]
    return {
        "id": "scatter-kv", "name": "Scatter this step's K/V into the pages",
        "shader": "paged-scatter-kv.wgsl.jinja",
        "bindings": [_uniform(fields), *sources, _rw("keyCacheT", "vec4<f16>"),
                     _rw("valueCacheT", "vec4<f16>"), *_META, _ro("slotMappingT", "i32")],
        "dispatch": {"threads": "{{ derive.numTokens * attrs.kv_num_heads * derive.headVec }}",
                     "workgroupSize": "{{ tunables.scatterWorkgroupSize }}"},
    }


def _attention_pass(splitk: bool) -> dict[str, Any]:
    fields = [_u32("num_tokens", "{{ derive.numTokens }}"),
              _u32("max_blocks", "{{ derive.maxBlocks }}"),
              _u32("q_stride", "{{ derive.qStrideVec }}"),
              _u32("num_splits", "{{ derive.numSplits }}"),
              _u32("split_chunk", "{{ derive.splitChunk }}"),
              {"name": "scale", "type": "f32", "value": "{{ derive.scale }}"}]
    outputs = ([_scratch("partialOut", "vec4<f32>"), _scratch("partialLse", "f32")] if splitk
               else [_rw("outputT", "vec4<f16>")])
    return {
        "id": "paged-attention-splitk" if splitk else "paged-attention",
        "name": "Split-K partials (out, lse)" if splitk else "Tiled paged attention",
        "shader": "paged-attention.wgsl.jinja",
        "bindings": [_uniform(fields), _ro("queryT", "vec4<f16>"),
                     _ro("keyCacheT", "vec4<f16>"), _ro("valueCacheT", "vec4<f16>"), *_META,
                     *outputs],
        "dispatch": {"x": "{{ ceilDiv(args.maxQueryLen, derive.tileQ) * derive.numSplits }}",
                     "y": "{{ derive.batchSize }}", "z": "{{ attrs.kv_num_heads }}"},
    }


_MERGE_PASS = {
    "id": "splitk-merge", "name": "Merge split-K partials",
    "shader": "attn-flash-decode-splitk-merge.wgsl.jinja",
    "bindings": [_uniform([_u32("num_tokens", "{{ derive.numTokens }}"),
                           _u32("num_splits", "{{ derive.numSplits }}")]),
                 {"buffer": "read-only-storage", "scratch": "partialOut",
                  "elementType": "vec4<f32>"},
                 {"buffer": "read-only-storage", "scratch": "partialLse", "elementType": "f32"},
                 _rw("outputT", "vec4<f16>")],
    "dispatch": {"threads": "{{ derive.numTokens * attrs.num_heads * derive.headVec }}",
                 "workgroupSize": "{{ tunables.mergeWorkgroupSize }}"},
}


def _variant(splitk: bool, packed: bool) -> dict[str, Any]:
    layout = "{{ not present.keyT }}" if packed else "{{ present.keyT }}"
    vid = ("flash-decode-splitk" if splitk else "tiled") + ("-packed-qkv" if packed else "")
    fits = ["{{ derive.group <= 256 }}", "{{ derive.blockSize % derive.keyChunk == 0 }}"]
    if splitk:
        when = [layout, *fits, "{{ args.maxQueryLen == 1 }}",
                "{{ args.maxKvLen >= tunables.splitKMinContext }}"]
        derive = {
            "tileQ": 1, "splitK": True,
            "splitTarget": "{{ max(1, min(tunables.maxSplits, "
                           "floor(args.maxKvLen / tunables.splitKMinChunk))) }}",
            "splitChunk": "{{ ceilDiv(ceilDiv(args.maxKvLen, derive.splitTarget), "
                          "derive.keyChunk) * derive.keyChunk }}",
            "numSplits": "{{ ceilDiv(args.maxKvLen, derive.splitChunk) }}",
        }
        passes = [_scatter_pass(packed), _attention_pass(True), _MERGE_PASS]
        intermediates = [
            {"id": "partialOut", "dtype": "float32",
             "shape": ["{{ derive.numSplits }}", "{{ derive.numTokens }}",
                       "{{ attrs.num_heads }}", "{{ derive.headSize }}"]},
            {"id": "partialLse", "dtype": "float32",
             "shape": ["{{ derive.numSplits }}", "{{ derive.numTokens }}",
                       "{{ attrs.num_heads }}"]},
        ]
        desc = ("Decode over long contexts: the scatter pass, split-K (flash-decode) partials "
                "of (out, lse) over key ranges, and the merge pass.")
    else:
        when = [layout, *fits]
        derive = {
            "tileQ": "{{ max(1, min(floor(derive.rowsPerWorkgroup / derive.group), "
                     "pow2ceil(args.maxQueryLen))) }}",
            "splitK": False, "numSplits": 1, "splitChunk": 0,
        }
        passes = [_scatter_pass(packed), _attention_pass(False)]
        intermediates = []
        desc = "Prefill, mixed and short decode steps: the scatter pass and one tiled pass."
    if packed:
        desc += " Q, K and V share the query rows."
    desc += (" Takes is_causal 0 and 1 and local_window_size (constants of the rendered "
             "attention shader).")
    return {"id": vid, "description": desc, "priority": 20 if splitk else 10, "when": when,
            "requires": {"features": ["shader-f16"]}, "derive": derive,
            "intermediates": intermediates, "passes": passes}


def _port(spec_port: Any, *, output: bool = False) -> dict[str, Any]:
    tvar = TYPE_VAR.get(spec_port.type_param, spec_port.type_param)
    port: dict[str, Any] = {"description": DESCRIPTIONS[spec_port.name], "onnx": spec_port.name,
                            "dtype": tvar}
    if tvar in STORAGE:
        port["storage"] = STORAGE[tvar]
    if spec_port.ranks:
        port["rank"] = spec_port.ranks[0]
    if output and spec_port.name == "output":
        port["rank"] = 2
        port["shape"] = ["{{ shapes.queryT[0] }}",
                         "{{ attrs.num_heads * shapes.keyCacheT[3] }}"]
    if output and spec_port.name.endswith("_out"):
        port["rank"] = 4
    optional = spec_port.optional and spec_port.name not in REQUIRED_HERE
    if optional:
        port["optional"] = True
    return port


def generate_manifest(spec: OpSpec) -> dict[str, Any]:
    """The manifest.json of this package, generated from ``spec`` (the PagedAttention OpSpec)."""
    inputs = {bind_key(p.name): _port(p) for p in spec.inputs if p.name in SUPPORTED_INPUTS}
    outputs = {bind_key(p.name): _port(p, output=True) for p in spec.outputs}
    attributes: dict[str, Any] = {}
    constraints: dict[str, Any] = {}
    for a in sorted(spec.attributes, key=lambda a: a.name):
        if a.name not in SUPPORTED_ATTRIBUTES:
            continue
        entry: dict[str, Any] = {"description": DESCRIPTIONS[a.name]}
        if not a.required:
            entry["default"] = a.default
        attributes[a.name] = entry
        rule: dict[str, Any] = {}
        if a.required:
            rule["required"] = True
        if a.name in SUPPORTED_VALUES:
            allowed = list(a.choices) or SUPPORTED_VALUES[a.name]
            rule["values"] = [v for v in allowed if v in SUPPORTED_VALUES[a.name]]
        if rule:
            constraints[a.name] = rule
    type_constraints: dict[str, list[str]] = {}
    for c in spec.type_constraints:
        var = TYPE_VAR.get(c.param, c.param)
        if c.param in DTYPES and var not in type_constraints:
            type_constraints[var] = [t for t in c.ort if t in DTYPES[c.param]]
    unsupported_attrs = {a.name: (None if a.required else a.default)
                         for a in spec.attributes if a.name not in SUPPORTED_ATTRIBUTES}
    return {
        "domain": spec.domain,
        "name": spec.name,
        "description": OP_DESCRIPTION,
        "sinceVersion": spec.version,
        "inputs": inputs,
        "outputs": outputs,
        "args": ARGS,
        "attributes": attributes,
        "attributeConstraints": constraints,
        "typeConstraints": type_constraints,
        "tunables": {k: {"default": v, "description": d} for k, (v, d) in TUNABLES.items()},
        "derive": DERIVE,
        "requires": {"features": ["shader-f16"]},
        "variants": [_variant(True, False), _variant(True, True), _variant(False, False),
                     _variant(False, True)],
        "onnx": {
            "domain": spec.domain, "opType": spec.name, "sinceVersion": spec.version,
            "inputs": [p.name for p in spec.inputs],
            "outputs": [p.name for p in spec.outputs],
            "unsupportedInputs": [p.name for p in spec.inputs
                                  if p.name not in SUPPORTED_INPUTS],
            "unsupportedAttributes": unsupported_attrs,
            "inputTypes": {p.name: p.type_param for p in spec.inputs},
            "typeConstraints": {c.param: list(c.ort) for c in spec.type_constraints},
        },
    }


