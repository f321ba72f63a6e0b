"""Conformance recipes of ``com.microsoft.PagedAttention`` and their deterministic inputs.

A recipe is JSON: ``{"name", "dims", "attrs", "backends"}``. ``dims``:

* ``seqs``: ``[[past, new], ...]`` per sequence (``new`` may be 0);
* ``head_size``, ``block_size``, ``spare_blocks`` (unused pages in the pool);
* ``packed_qkv`` (bool), ``rotary_dim`` (0 = no cos/sin caches), ``head_sink``, ``qk_norm``
  (bools), ``slot_mapping`` (``None`` | ``"derived"`` | ``"skip_every_3rd"``: the derived slots
  with every third token's write suppressed by ``-1``), ``attention_metadata``
  (``None`` | ``"exact"`` | ``"loose"`` | explicit list);
* ``cache_dtype``: ``None`` (the query's type) or a quantized cache type (``"int8"``,
  ``"float8e4m3fn"``); ``k_quant_type``/``v_quant_type`` in ``attrs`` then pick the scale layouts
  and ``make_inputs`` draws positive scales (per channel: each within 0.5-1.5x of the base) and
  fills the pages with quantized garbage.

``attrs`` are the node attributes (``num_heads``/``kv_num_heads`` included); ``backends`` names
the implementations a recipe is valid for: ``"reference"`` always, ``"onnxruntime"`` where ORT's
WebGPU PagedAttention (onnxruntime-ep-webgpu 0.4.0) implements the feature.

``make_inputs`` fills the caches with random garbage (pages are never zeroed in serving) and
hands each sequence a shuffled, non-contiguous set of pages. Queries and keys are N(0, 1), values
N(0, V_STD^2) so outputs stay small enough for a 2e-3 bound against fp16 kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedhybrid import dtypes
from pagedhybrid.kvquant import QMAX, quantize

_BOTH = ["reference", "onnxruntime"]
# Values (and value pages) are N(0, V_STD^2): outputs then stay mostly inside fp16's [1, 2) band,
# where ORT's fp16-accumulating WebGPU kernel lands within ~2 ulps (2e-3) of the reference.
V_STD = 0.5
_REF = ["reference"]


def _r(name: str, seqs: list[list[int]], hq: int, hkv: int, d: int, *, bs: int = 16,
       backends: list[str] | None = None, attrs: dict[str, Any] | None = None,
       **dims: Any) -> dict[str, Any]:
    return {
        "name": name,
        "dims": {"seqs": seqs, "head_size": d, "block_size": bs, "spare_blocks": 3,
                 "packed_qkv": False, "rotary_dim": 0, "head_sink": False, "qk_norm": False,
                 "slot_mapping": None, "attention_metadata": None, "cache_dtype": None,
                 **dims},
        "attrs": {"num_heads": hq, "kv_num_heads": hkv, **(attrs or {})},
        "backends": list(backends or _BOTH),
    }


def conformance_recipes() -> list[dict[str, Any]]:
    """Deterministic recipes covering the contract's features (see module docstring)."""
    return [
        _r("prefill_two_sequences", [[0, 5], [0, 17]], 4, 2, 64),
        _r("page_boundaries_15_16_17", [[15, 1], [16, 1], [17, 1], [0, 16], [31, 2]], 4, 2, 64),
        _r("decode_long_context_gqa8", [[300, 1], [45, 1], [129, 1]], 8, 1, 128, bs=32),
        _r("chunked_prefill_gqa1_small_head", [[3, 4], [20, 7]], 2, 2, 16),
        _r("mixed_gqa4_block64", [[40, 3], [7, 9], [70, 1]], 8, 2, 64, bs=64),
        _r("packed_qkv", [[10, 4], [0, 6]], 4, 2, 32, packed_qkv=True),
        _r("zero_length_queries", [[20, 0], [5, 3], [0, 0], [9, 1]], 4, 1, 32),
        _r("token_count_zero", [[10, 0], [4, 0]], 2, 1, 32),
        _r("slot_mapping_skips", [[16, 6], [3, 5]], 4, 2, 32, slot_mapping="skip_every_3rd",
           backends=_REF),
        _r("softcap", [[12, 3], [0, 6]], 4, 2, 32, attrs={"softcap": 2.0}, backends=_REF),
        _r("local_window", [[30, 4], [5, 10], [40, 1]], 4, 2, 32,
           attrs={"local_window_size": 8}, backends=_REF),
        _r("head_sink", [[12, 3], [0, 5], [33, 1]], 4, 2, 32, head_sink=True),
        _r("qk_norm", [[9, 4], [0, 3]], 4, 2, 64, qk_norm=True, backends=_REF),
        _r("rotary_rotate_half_partial", [[21, 3], [0, 5]], 4, 2, 64, rotary_dim=32,
           attrs={"do_rotary": 1}),
        _r("rotary_interleaved_full", [[6, 4], [17, 2]], 4, 2, 32, rotary_dim=32,
           attrs={"do_rotary": 1, "rotary_interleaved": 1}),
        _r("rotary_offset", [[6, 4], [17, 2]], 4, 2, 64, rotary_dim=32,
           attrs={"do_rotary": 1, "rotary_offset": 16}, backends=_REF),
        _r("bidirectional_block", [[12, 4], [3, 4]], 4, 2, 32, attrs={"is_causal": 0},
           backends=_REF),
        # a block drafter's shapes (DFlash2: a non-causal block over a long history, windowed)
        _r("bidirectional_window_long", [[300, 8], [40, 8], [0, 6]], 8, 2, 64, bs=32,
           attrs={"is_causal": 0, "local_window_size": 20}, backends=_REF),
        _r("local_window_decode_long", [[500, 1], [64, 1], [3, 1]], 4, 1, 128,
           attrs={"local_window_size": 64}, backends=_REF),
        _r("attention_metadata_loose_2", [[14, 2], [2, 7]], 4, 2, 32,
           attention_metadata="loose"),
        _r("rotary_sink_scale_metadata_gqa4", [[19, 3], [0, 8], [47, 1]], 8, 2, 64, bs=32,
           rotary_dim=16, head_sink=True, attention_metadata="exact",
           attrs={"do_rotary": 1, "scale": 0.1}),
        _r("qwen35_like_qknorm_rotary_sink", [[19, 3], [0, 8], [47, 1]], 8, 2, 64, bs=32,
           qk_norm=True, rotary_dim=16, head_sink=True, attention_metadata="exact",
           attrs={"do_rotary": 1}, backends=_REF),
        # quantized caches: ORT's WebGPU kernel refuses them (NOT_IMPLEMENTED, fp16 caches only)
        *(_r(f"{name}_{quant.lower()}", seqs, hq, hkv, d, bs=bs, cache_dtype=cache,
             attrs={"k_quant_type": quant, "v_quant_type": quant}, backends=_REF)
          for name, cache, seqs, hq, hkv, d, bs in (
              ("int8", "int8", [[300, 1], [45, 1], [20, 7], [0, 5]], 8, 2, 64, 16),
              ("fp8", "float8e4m3fn", [[129, 1], [16, 1], [3, 4], [0, 12]], 4, 1, 128, 32))
          for quant in ("PER_CHANNEL", "PER_TENSOR")),
        _r("int8_k_channel_v_tensor_slot_skips", [[16, 6], [3, 5], [40, 1]], 4, 2, 32,
           cache_dtype="int8", slot_mapping="skip_every_3rd",
           attrs={"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_TENSOR",
                  "k_cache_dtype": "int8"}, backends=_REF),
        _r("fp8_k_tensor_v_channel_qknorm_rotary", [[19, 3], [0, 8], [47, 1]], 8, 2, 64,
           bs=32, cache_dtype="float8e4m3fn", qk_norm=True, rotary_dim=16,
           attrs={"do_rotary": 1, "k_quant_type": "PER_TENSOR", "v_quant_type": "PER_CHANNEL",
                  "v_cache_dtype": "float8e4m3fn"}, backends=_REF),
    ]


def _rand(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype,
          std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean).to(dtype)


def _scale(gen: torch.Generator, quant: str, hkv: int, d: int, base: float) -> torch.Tensor:
    if quant == "PER_TENSOR":
        return torch.tensor([base], dtype=torch.float32)
    return (base * (0.5 + torch.rand((hkv, 1, d), generator=gen, dtype=torch.float64))).float()


def _metadata(spec: Any, q_lens: list[int], totals: list[int]) -> torch.Tensor | None:
    max_q = max(q_lens, default=0)
    max_kv = max((t for t, q in zip(totals, q_lens, strict=True) if q > 0), default=0)
    if spec is None:
        return None
    if spec == "exact":
        vals = [max_q, max_kv, max_kv]
    elif spec == "loose":
        vals = [2 * max_q + 1, max_kv + 37]
    else:
        vals = list(spec)
    return torch.tensor(vals, dtype=torch.int32)


def make_inputs(recipe: dict[str, Any], dtype: torch.dtype,
                seed: int) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """The 17 positional inputs (None = absent) and the attributes of ``recipe``."""
    dims, attrs = recipe["dims"], dict(recipe["attrs"])
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = attrs["num_heads"], attrs["kv_num_heads"], dims["head_size"], \
        dims["block_size"]
    seqs = [(int(p), int(q)) for p, q in dims["seqs"]]
    q_lens = [q for _, q in seqs]
    totals = [p + q for p, q in seqs]
    n = sum(q_lens)

    # pages: each sequence gets ceil(total/bs) pages drawn from a shuffled pool
    need = [-(-t // bs) for t in totals]
    num_blocks = sum(need) + int(dims["spare_blocks"])
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    cols = max(need, default=0) + 1
    table = torch.full((len(seqs), cols), -1, dtype=torch.int32)
    k = 0
    for b, nb in enumerate(need):
        table[b, :nb] = torch.tensor(perm[k: k + nb], dtype=torch.int32)
        k += nb
    key_cache = _rand(gen, (num_blocks, bs, hkv, d), dtype)
    value_cache = _rand(gen, (num_blocks, bs, hkv, d), dtype, std=V_STD)
    k_scale = v_scale = None
    if dims.get("cache_dtype"):
        cache_dtype = dtypes.to_torch(dims["cache_dtype"])
        qmax = QMAX[cache_dtype]
        k_scale = _scale(gen, attrs["k_quant_type"], hkv, d, 4.0 / qmax)
        v_scale = _scale(gen, attrs["v_quant_type"], hkv, d, 4.0 * V_STD / qmax)
        key_cache = quantize(key_cache, k_scale, cache_dtype)
        value_cache = quantize(value_cache, v_scale, cache_dtype)

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    past = torch.tensor([p for p, _ in seqs], dtype=torch.int32)
    query = _rand(gen, (n, hq * d), dtype)
    key = _rand(gen, (n, hkv * d), dtype)
    value = _rand(gen, (n, hkv * d), dtype, std=V_STD)
    if dims["packed_qkv"]:
        query, key, value = torch.cat([query, key, value], dim=1), None, None

    cos = sin = None
    if dims["rotary_dim"]:
        half = dims["rotary_dim"] // 2
        max_pos = max(totals, default=0) + 8
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq  # [P, R/2]
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

    slot_mapping = None
    if dims["slot_mapping"] is not None:
        slots = []
        for b, (p, q) in enumerate(seqs):
            for i in range(q):
                pos = p + i
                slots.append(int(table[b, pos // bs]) * bs + pos % bs)
        if dims["slot_mapping"] == "skip_every_3rd":
            slots = [-1 if t % 3 == 0 else s for t, s in enumerate(slots)]
        slot_mapping = torch.tensor(slots, dtype=torch.int32)

    head_sink = _rand(gen, (hq,), dtype) if dims["head_sink"] else None
    q_norm = k_norm = None
    if dims["qk_norm"]:
        q_norm = _rand(gen, (d,), dtype, std=0.3, mean=1.0)
        k_norm = _rand(gen, (d,), dtype, std=0.3, mean=1.0)
    meta = _metadata(dims["attention_metadata"], q_lens, totals)
    inputs: list[torch.Tensor | None] = [
        query, key, value, key_cache, value_cache, cu, past, table, cos, sin, slot_mapping,
        head_sink, q_norm, k_norm, k_scale, v_scale, meta]
    return inputs, attrs
