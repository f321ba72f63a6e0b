"""The three operator contracts on the native kernels, with the contracts' own validation.

Each function is the ``native`` implementation registered with its op's ``SPEC.implement``, so it
takes the spec's one signature (positional = ONNX Runtime input order, attributes keyword-only)
and receives the ``BoundCall``. Each call is validated once by its contract's ``validate_call``
(a corrupted call raises ``ContractViolation`` naming the port), then runs natively when the
native kernel implements every feature the call uses; otherwise the validated call goes to the
``compute`` of the torch kernel in ``pagedhybrid.kernels.cpu`` -- a declared delegation
(``COVERAGE[op].delegated`` lists each feature and why), never a silent one.
``last_path()`` tells which path the latest call of an op took (for tests and reports).
"""

from __future__ import annotations

import importlib

import torch

from pagedhybrid.kernels.native import KV_SPLIT, library
from pagedhybrid.kernels.native.seam import MAX_NATIVE_QUERY
from pagedhybrid.kernels.registry import OpCoverage
from pagedhybrid.kvquant import is_quantized, quantize, query_scales, scatter_rows
from pagedhybrid.ops.spec import BoundCall

cpu_gdn = importlib.import_module("pagedhybrid.kernels.cpu.gated_delta_net")
cpu_pa = importlib.import_module("pagedhybrid.kernels.cpu.paged_attention")
cpu_conv = importlib.import_module("pagedhybrid.kernels.cpu.varlen_causal_conv")
ref_gdn = importlib.import_module("pagedhybrid.ops.gated_delta_net")
ref_pa = importlib.import_module("pagedhybrid.ops.paged_attention")
ref_conv = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANT_CACHES = (torch.int8, torch.float8_e4m3fn)  # pages the native attention reads in place
_LAST: dict[str, str] = {}

COVERAGE: dict[str, OpCoverage] = {
    "com.microsoft.PagedAttention": OpCoverage(
        op="com.microsoft.PagedAttention", dtypes=NATIVE_DTYPES,
        features=("decode", "short_query", "gqa", "packed_qkv", "attention_metadata",
                  "split_kv", "int8_cache", "fp8_e4m3_cache", "per_tensor_scales",
                  "per_channel_scales", "is_causal=0", "local_window_size"),
        delegated={"prefill": f"more than {MAX_NATIVE_QUERY} new tokens: the torch SDPA path "
                              "(GEMM-shaped, compute-bound)",
                   "softcap/head_sink": "not in the native tile",
                   "qk_norm/do_rotary/slot_mapping": "the model does these outside the op",
                   "head_size > 256": "the tile holds at most 256 dims",
                   "float64": "verification dtype only"},
        paths={"native": "pages read in place, online softmax, GQA group per kv head, fixed "
                         f"KV splits of {KV_SPLIT} tokens merged in split order; int8 / fp8 "
                         "pages converted in registers, scales folded into q and the output"}),
    "com.microsoft.GatedDeltaNet": OpCoverage(
        op="com.microsoft.GatedDeltaNet", dtypes=NATIVE_DTYPES,
        features=("decode", "update_rule:gated_delta", "gate:qwen", "beta:sigmoid", "gqa",
                  "in_place_state_pool", "state_update_capture"),
        delegated={"prefill": "sequences longer than one token: the torch chunked WY form",
                   "other rules/gates, per-key decay, packed/rank-4 layouts, qk_l2_norm=1":
                       "the model's form only"},
        paths={"native": "one pass over each state row: decay, S k, delta update, S q"}),
    "com.microsoft.VarlenCausalConvWithState": OpCoverage(
        op="com.microsoft.VarlenCausalConvWithState", dtypes=NATIVE_DTYPES,
        features=("decode", "activation:none", "activation:silu/swish", "bias",
                  "in_place_state_pool", "state_update_capture"),
        delegated={"prefill": "sequences longer than one token: the torch stream conv",
                   "dilation > 1": "not in the native kernel"},
        paths={"native": "one token per sequence, state shifted in place"}),
}


def last_path(op: str) -> str | None:
    return _LAST.get(op)


def _note(op: str, path: str) -> None:
    _LAST[op] = path


@ref_pa.SPEC.implement("native")
def paged_attention(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Native ``PagedAttention`` (attributes as ONNX Runtime's, keyword only)."""
    dims = ref_pa.validate_call(call)
    a = dims.attrs
    quant = is_quantized(dims.cache_dtype)
    native = ((dims.dtype == dims.cache_dtype or quant) and dims.dtype in NATIVE_DTYPES
              and dims.head_size <= 256
              and dims.max_query_len <= MAX_NATIVE_QUERY and a["softcap"] == 0
              and not a["do_rotary"]
              and not dims.has_slot_mapping and not dims.has_head_sink and not dims.has_qk_norm)
    if not native or dims.num_tokens == 0:
        _note("paged_attention", "torch")
        return cpu_pa.compute(call.inputs, dims)
    query, key, value, key_cache, value_cache, cu, past, table = call.inputs[:8]
    n, hq, hkv, d = dims.num_tokens, dims.num_heads, dims.kv_num_heads, dims.head_size
    if dims.packed_qkv:
        q, k, v = query.split([hq * d, hkv * d, hkv * d], dim=1)
    else:
        q, k, v = query, key, value
    slots = torch.tensor(dims.write_slots, dtype=torch.int64)
    k, v, qf = k.reshape(n, hkv, d), v.reshape(n, hkv, d), q.reshape(n, hq, d).float()
    k_scale, v_scale = call["k_scale"], call["v_scale"]
    if quant:
        assert k_scale is not None and v_scale is not None
        k, v = quantize(k, k_scale, key_cache.dtype), quantize(v, v_scale, key_cache.dtype)
        qs, vs = query_scales(k_scale, v_scale, hq, hkv, d)
        qf = qf * qs
    scatter_rows(key_cache, slots, k.to(key_cache.dtype))
    scatter_rows(value_cache, slots, v.to(value_cache.dtype))
    out = torch.empty(n, hq, d, dtype=torch.float32)
    seqs = torch.tensor([b for b in range(dims.batch) if dims.q_lens[b] > 0], dtype=torch.int32)
    library().paged_attention(  # type: ignore[attr-defined]
        qf.contiguous(), key_cache, value_cache,
        table.to(torch.int32).contiguous(), cu.to(torch.int32).contiguous(),
        past.to(torch.int32).contiguous(), seqs, out, dims.scale, KV_SPLIT,
        a["local_window_size"], bool(a["is_causal"]))
    if quant:
        out *= vs
    _note("paged_attention", "native")
    return out.reshape(n, hq * d).to(query.dtype), key_cache, value_cache


@ref_gdn.SPEC.implement("native")
def gated_delta_net(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Native ``GatedDeltaNet`` (decode in the model's form; the rest on the torch kernel; the
    contract's ``state_update`` appended when the call captures)."""
    d = ref_gdn.validate_call(call)
    query, key, value, _cu, decay, beta, initial_state, a_log, dt_bias = call.inputs[:9]
    a = d.attrs
    native = (d.dtype in NATIVE_DTYPES and a["update_rule"] == "gated_delta"
              and a["gate_activation"] == "qwen" and a["beta_activation"] == "sigmoid"
              and not d.per_key_decay and not d.packed_qkv and d.token_rank == 1
              and a["qk_l2_norm"] == 0 and d.batch > 0
              and all(d.cu_seqlens[i + 1] - d.cu_seqlens[i] == 1 for i in range(d.batch)))
    if not native:
        _note("gated_delta_net", "torch")
        return ref_gdn.with_capture(cpu_gdn.compute(call, d), call.inputs, d)
    b = d.batch
    pool = (initial_state.to(torch.float32, copy=True) if initial_state is not None else
            torch.empty(b, d.num_heads_v, d.head_size_v, d.head_size_qk))
    fresh = torch.full((b,), initial_state is None, dtype=torch.bool)
    out = torch.empty(b, d.num_heads_v, d.head_size_v, dtype=torch.float32)
    library().gated_delta_decode(  # type: ignore[attr-defined]
        query.float().contiguous(), key.float().contiguous(), value.float().contiguous(),
        decay.float().contiguous(), beta.float().contiguous(), a_log.float().contiguous(),
        dt_bias.float().contiguous(), pool, torch.arange(b), fresh, out, d.scale)
    _note("gated_delta_net", "native")
    return ref_gdn.with_capture((out.to(d.dtype), pool), call.inputs, d)


@ref_conv.SPEC.implement("native")
def varlen_causal_conv(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Native ``VarlenCausalConvWithState`` (decode; the rest on the torch kernel; the
    contract's ``state_update`` appended when the call captures)."""
    d = ref_conv.validate_call(call)
    x, weight, _cu, bias, initial_state = call.inputs[:5]
    native = (d.dtype in NATIVE_DTYPES and d.dilation == 1 and d.total_tokens == d.batch
              and d.batch > 0 and d.state_len > 0
              and d.attrs["activation"] in ("none", "silu", "swish"))
    if not native:
        _note("varlen_causal_conv", "torch")
        return ref_conv.with_capture(cpu_conv.compute(x, weight, bias, initial_state, d), x, d)
    b = d.batch
    pool = (initial_state.to(d.dtype, copy=True).contiguous() if initial_state is not None else
            torch.empty(b, d.channels, d.state_len, dtype=d.dtype))
    fresh = torch.full((b,), initial_state is None, dtype=torch.bool)
    y = torch.empty(b, d.channels, dtype=d.dtype)
    library().causal_conv_decode(  # type: ignore[attr-defined]
        x.contiguous(), weight.reshape(d.channels, -1).to(d.dtype).contiguous(),
        None if bias is None else bias.to(d.dtype).contiguous(), pool, torch.arange(b), fresh,
        y, d.attrs["activation"] != "none")
    _note("varlen_causal_conv", "native")
    return ref_conv.with_capture((y, pool), x, d)
