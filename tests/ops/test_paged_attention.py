"""Reference semantics of com.microsoft.PagedAttention (SEPARATE K/V pages).

* hand-worked tiny cases with numbers computed by hand (exp/tanh of small integers);
* property tests against an independent formulation: per sequence, gather the history from the
  ORIGINAL pages, concatenate this step's K/V, repeat the kv heads, plain softmax attention with
  an explicit mask (head sink as an extra logit column); plus the expected cache after the write;
* RoPE and q/k RMSNorm checked against independent formulations (complex rotation,
  ``torch.nn.functional.rms_norm``) applied outside the op;
* dtype handling, in-place semantics, recipes and ``make_inputs``.
"""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

pa = importlib.import_module("pagedhybrid.ops.paged_attention")


# -- helpers -----------------------------------------------------------------------------------
def _clone(inputs):
    return [t.clone() if t is not None else None for t in inputs]


def _run(inputs, attrs):
    return pa.paged_attention(*inputs, **attrs)


def _ort_quant(x, scale, dtype):
    """ORT's CUDA write (numpy): float32 x * (1 / scale), rint + clamp [-128, 127] (int8) or
    clamp +-448 then round-to-nearest-even (float8e4m3fn); x [Hkv, D], scale [Hkv, D]."""
    inv = np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)
    y = x.astype(np.float32) * inv
    if dtype == torch.int8:
        return torch.from_numpy(np.clip(np.rint(y), -128, 127).astype(np.int8))
    return torch.from_numpy(np.clip(y, -448, 448)).to(torch.float8_e4m3fn)


def independent_attention(inputs, attrs):
    """Expected (output, key_cache, value_cache) without rotary / qk-norm / slot_mapping."""
    (query, key, value, kc, vc, cu, past, table, *_rest) = inputs
    head_sink = inputs[11]
    quant = kc.dtype in (torch.int8, torch.float8_e4m3fn)
    hq, hkv = attrs["num_heads"], attrs["kv_num_heads"]
    n = query.shape[0]
    if key is None:
        d = query.shape[1] // (hq + 2 * hkv)
        q, k, v = query.double().split([hq * d, hkv * d, hkv * d], dim=1)
    else:
        d = query.shape[1] // hq
        q, k, v = query.double(), key.double(), value.double()
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    bs = kc.shape[1]
    scales = [np.broadcast_to(t.numpy().reshape(-1, d) if t.numel() > 1 else t.numpy()
                              .reshape(1, 1), (hkv, d)).astype(np.float32)
              for t in (inputs[14], inputs[15])] if quant else None

    def store(x, which):  # x [Hkv, D] float64 -> the cache's element type
        cache = kc if which == 0 else vc
        return _ort_quant(x.float().numpy(), scales[which], cache.dtype) if quant \
            else x.to(cache.dtype)

    def load(x, which):  # stored [L, Hkv, D] -> float64
        return x.double() * torch.from_numpy(scales[which]).double() if quant else x.double()
    scale = attrs.get("scale", 0.0) or 1.0 / math.sqrt(d)
    softcap = attrs.get("softcap", 0.0)
    window = attrs.get("local_window_size", -1)
    causal = attrs.get("is_causal", 1)
    exp_kc, exp_vc = kc.clone(), vc.clone()
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    cu_l, past_l = cu.tolist(), past.tolist()
    for b in range(len(past_l)):
        s, e, p0 = cu_l[b], cu_l[b + 1], past_l[b]
        for i in range(e - s):  # expected write
            pos = p0 + i
            pg = int(table[b, pos // bs])
            exp_kc[pg, pos % bs] = store(k[s + i], 0)
            exp_vc[pg, pos % bs] = store(v[s + i], 1)
        if e == s:
            continue
        hist = [int(table[b, j // bs]) for j in range(p0)]
        hk = torch.stack([kc[pg, j % bs] for j, pg in enumerate(hist)]) if p0 else \
            kc.new_zeros(0, hkv, d)
        hv = torch.stack([vc[pg, j % bs] for j, pg in enumerate(hist)]) if p0 else \
            vc.new_zeros(0, hkv, d)
        kk = load(torch.cat([hk, torch.stack([store(x, 0) for x in k[s:e]])]), 0)  # [L,Hkv,D]
        vv = load(torch.cat([hv, torch.stack([store(x, 1) for x in v[s:e]])]), 1)
        kk = kk.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
        vv = vv.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qq = q[s:e].transpose(0, 1)  # [Hq, Q, D]
        scores = qq @ kk.transpose(1, 2) * scale  # [Hq, Q, L]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        L = kk.shape[1]
        qpos = torch.arange(p0, p0 + e - s)[:, None]
        kpos = torch.arange(L)[None, :]
        allowed = (kpos <= qpos) if causal else torch.ones(e - s, L, dtype=torch.bool)
        if window > 0:
            allowed &= kpos >= qpos - window
        scores = scores.masked_fill(~allowed, -math.inf)
        if head_sink is not None:
            sink_col = head_sink.double()[:, None, None].expand(hq, e - s, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[s:e] = (probs @ vv).transpose(0, 1)
    return out.view(n, hq * d), exp_kc, exp_vc


# -- 1. hand-worked tiny cases -----------------------------------------------------------------
def _tiny(dtype=torch.float32):
    """1 head, D=8, block 16, 3 pages; one sequence with 1 cached token (position 0, page 2) and
    2 new tokens (positions 1, 2). q1=e0, q2=e1; k0=2e0 (cached), k1=3e1, k2=e0+e1; v_i = e_i."""
    e = torch.eye(8)
    q = torch.stack([e[0], e[1]])
    k = torch.stack([3 * e[1], e[0] + e[1]])
    v = torch.stack([e[1], e[2]])
    kc = torch.full((3, 16, 1, 8), 7.0)  # garbage
    vc = torch.full((3, 16, 1, 8), -5.0)
    kc[2, 0, 0] = 2 * e[0]
    vc[2, 0, 0] = e[0]
    table = torch.tensor([[2, 0, -1]], dtype=torch.int32)
    inputs = [q.to(dtype), k.to(dtype), v.to(dtype), kc.to(dtype), vc.to(dtype),
              torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
              table] + [None] * 9
    return inputs


E2, E3 = math.exp(2.0), math.exp(3.0)
_SM3 = [1 / (1 + E3 + math.e), E3 / (1 + E3 + math.e), math.e / (1 + E3 + math.e)]


@pytest.mark.parametrize(
    ("attrs", "extra", "row1", "row2"),
    [
        # token 1 (p=1) logits [q1.k0, q1.k1] = [2, 0]; token 2 (p=2) logits [0, 3, 1]
        ({}, {}, [E2 / (E2 + 1), 1 / (E2 + 1), 0], _SM3),
        # head sink s=1 joins only the denominator
        ({}, {11: torch.tensor([1.0])}, [E2 / (E2 + 1 + math.e), 1 / (E2 + 1 + math.e), 0],
         [1 / (1 + E3 + 2 * math.e), E3 / (1 + E3 + 2 * math.e), math.e / (1 + E3 + 2 * math.e)]),
        # softcap 1: logits become tanh(logit)
        ({"softcap": 1.0}, {},
         [math.exp(math.tanh(2)) / (math.exp(math.tanh(2)) + 1),
          1 / (math.exp(math.tanh(2)) + 1), 0],
         [1 / (1 + math.exp(math.tanh(3)) + math.exp(math.tanh(1))),
          math.exp(math.tanh(3)) / (1 + math.exp(math.tanh(3)) + math.exp(math.tanh(1))),
          math.exp(math.tanh(1)) / (1 + math.exp(math.tanh(3)) + math.exp(math.tanh(1)))]),
        # window 1: a query at p sees p-1 and p
        ({"local_window_size": 1}, {}, [E2 / (E2 + 1), 1 / (E2 + 1), 0],
         [0, E3 / (E3 + math.e), math.e / (E3 + math.e)]),
        # bidirectional: token 1 also sees k2 (logit q1.k2 = 1)
        ({"is_causal": 0}, {}, [E2 / (E2 + 1 + math.e), 1 / (E2 + 1 + math.e),
                                math.e / (E2 + 1 + math.e)], _SM3),
    ],
    ids=["plain", "head_sink", "softcap", "window1", "bidirectional"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_worked(attrs, extra, row1, row2, dtype):
    inputs = _tiny(dtype)
    for i, t in extra.items():
        inputs[i] = t.to(dtype)
    before_k, before_v = inputs[3].clone(), inputs[4].clone()
    out, kc, vc = _run(inputs, {"num_heads": 1, "kv_num_heads": 1, "scale": 1.0, **attrs})
    expected = torch.zeros(2, 8, dtype=torch.float64)
    expected[0, :3] = torch.tensor(row1, dtype=torch.float64)
    expected[1, :3] = torch.tensor(row2, dtype=torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    # the write: positions 1 and 2 of page 2, nothing else
    assert kc is inputs[3] and vc is inputs[4]
    exp_k, exp_v = before_k.clone(), before_v.clone()
    exp_k[2, 1, 0], exp_k[2, 2, 0] = inputs[1][0], inputs[1][1]
    exp_v[2, 1, 0], exp_v[2, 2, 0] = inputs[2][0], inputs[2][1]
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)


def test_hand_worked_default_scale_gqa():
    """Two query heads share one kv head; scale defaults to 1/sqrt(8)."""
    inputs = _tiny()
    q = inputs[0]
    inputs[0] = torch.cat([q, 2 * q], dim=1)  # head 1 = 2 x head 0
    out, _, _ = _run(inputs, {"num_heads": 2, "kv_num_heads": 1})
    s = 1 / math.sqrt(8)
    for head, mult in [(0, 1.0), (1, 2.0)]:
        a = math.exp(2 * s * mult)
        torch.testing.assert_close(out[0, head * 8: head * 8 + 2],
                                   torch.tensor([a / (a + 1), 1 / (a + 1)]))


def test_slot_mapping_skip_and_redirect():
    """-1 suppresses the write (the stale page content is attended); a slot elsewhere writes
    there, while reads still follow the block table."""
    inputs = _tiny()
    inputs[10] = torch.tensor([-1, 1 * 16 + 5], dtype=torch.int32)  # token 2 -> page 1, offset 5
    before_k, before_v = inputs[3].clone(), inputs[4].clone()
    out, kc, vc = _run(inputs, {"num_heads": 1, "kv_num_heads": 1, "scale": 1.0})
    exp_k, exp_v = before_k.clone(), before_v.clone()
    exp_k[1, 5, 0], exp_v[1, 5, 0] = inputs[1][1], inputs[2][1]
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)
    # token 1 reads positions 0 (k0=2e0) and 1 (stale garbage: all 7s, value all -5)
    a, b = math.exp(2.0), math.exp(7.0)
    expected = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]) * a / (a + b) - 5.0 * b / (a + b)
    torch.testing.assert_close(out[0], expected)


def test_slot_mapping_derived_equals_absent():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "slot_mapping_skips")
    recipe["dims"]["slot_mapping"] = "derived"
    inputs, attrs = pa.make_inputs(recipe, torch.float32, 3)
    without = _clone(inputs)
    without[10] = None
    a, b = _run(_clone(inputs), attrs), _run(without, attrs)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_token_count_zero_leaves_caches():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "token_count_zero")
    inputs, attrs = pa.make_inputs(recipe, torch.float16, 0)
    kc0, vc0 = inputs[3].clone(), inputs[4].clone()
    out, kc, vc = _run(inputs, attrs)
    assert out.shape == (0, attrs["num_heads"] * recipe["dims"]["head_size"])
    assert out.dtype == torch.float16
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


# -- 2. property tests against the independent formulation ------------------------------------
@st.composite
def paged_case(draw):
    hkv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    d = draw(st.sampled_from([8, 16, 32]))
    bs = draw(st.sampled_from([16, 32]))
    batch = draw(st.integers(1, 4))
    seqs = [(draw(st.sampled_from([0, 1, 5, 15, 16, 17, 31, 32, 33, 40])),
             draw(st.sampled_from([0, 1, 2, 3, 7, 16, 17]))) for _ in range(batch)]
    attrs = {"num_heads": hkv * ratio, "kv_num_heads": hkv,
             "is_causal": draw(st.sampled_from([1, 1, 0])),
             "local_window_size": draw(st.sampled_from([-1, -1, 1, 4, 20])),
             "softcap": draw(st.sampled_from([0.0, 0.0, 3.0])),
             "scale": draw(st.sampled_from([0.0, 0.3]))}
    recipe = {"name": "prop", "dims": {
        "seqs": [list(s) for s in seqs], "head_size": d, "block_size": bs,
        "spare_blocks": draw(st.integers(0, 3)), "packed_qkv": draw(st.booleans()),
        "rotary_dim": 0, "head_sink": draw(st.booleans()), "qk_norm": False,
        "slot_mapping": None, "attention_metadata": draw(st.sampled_from([None, "exact"]))},
        "attrs": attrs, "backends": ["reference"]}
    return recipe, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_case())
def test_matches_independent_formulation(case):
    recipe, seed = case
    inputs, attrs = pa.make_inputs(recipe, torch.float32, seed)
    exp_out, exp_kc, exp_vc = independent_attention(_clone(inputs), attrs)
    out, kc, vc = _run(inputs, attrs)
    torch.testing.assert_close(out.double(), exp_out, atol=2e-5, rtol=1e-5)
    assert torch.equal(kc, exp_kc) and torch.equal(vc, exp_vc)  # written slots + untouched ones


@pytest.mark.parametrize("recipe", [r for r in pa.conformance_recipes()
                                    if not r["dims"]["rotary_dim"] and not r["dims"]["qk_norm"]
                                    and not r["dims"]["slot_mapping"]],
                         ids=lambda r: r["name"])
def test_recipes_match_independent_formulation(recipe):
    inputs, attrs = pa.make_inputs(recipe, torch.float64, 11)
    exp_out, exp_kc, exp_vc = independent_attention(_clone(inputs), attrs)
    out, kc, vc = _run(inputs, attrs)
    torch.testing.assert_close(out, exp_out, atol=1e-10, rtol=1e-10)
    assert torch.equal(kc, exp_kc) and torch.equal(vc, exp_vc)


# -- RoPE and q/k norm against formulations applied outside the op -----------------------------
def _rope_complex(x, cos, sin, positions, offset, rotary_dim, interleaved):
    """RoPE as a complex rotation by angle theta = atan2(sin, cos) at each position."""
    x = x.clone()
    seg = x[..., offset: offset + rotary_dim]
    half = rotary_dim // 2
    if interleaved:
        pairs = torch.complex(seg[..., 0::2], seg[..., 1::2])
    else:
        pairs = torch.complex(seg[..., :half], seg[..., half:])
    rot = torch.complex(cos[positions], sin[positions])[:, None, :]  # [N, 1, R/2]
    r = pairs * rot
    if interleaved:
        seg = torch.stack([r.real, r.imag], dim=-1).flatten(-2)
    else:
        seg = torch.cat([r.real, r.imag], dim=-1)
    x[..., offset: offset + rotary_dim] = seg
    return x


@pytest.mark.parametrize("name", ["rotary_rotate_half_partial", "rotary_interleaved_full",
                                  "rotary_offset", "qk_norm", "qwen35_like_qknorm_rotary_sink"])
def test_rotary_and_qk_norm_equal_preprocessed_inputs(name):
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == name)
    inputs, attrs = pa.make_inputs(recipe, torch.float64, 5)
    hq, hkv, d = attrs["num_heads"], attrs["kv_num_heads"], recipe["dims"]["head_size"]
    n = inputs[0].shape[0]
    q, k = inputs[0].view(n, hq, d), inputs[1].view(n, hkv, d)
    if inputs[12] is not None:
        eps = attrs.get("qk_norm_epsilon", 1e-6)
        q = F.rms_norm(q, (d,), inputs[12], eps)
        k = F.rms_norm(k, (d,), inputs[13], eps)
    if attrs.get("do_rotary"):
        past, cu = inputs[6].tolist(), inputs[5].tolist()
        positions = torch.tensor([past[b] + i for b in range(len(past))
                                  for i in range(cu[b + 1] - cu[b])])
        args = (inputs[8], inputs[9], positions, attrs.get("rotary_offset", 0),
                2 * inputs[8].shape[1], bool(attrs.get("rotary_interleaved", 0)))
        q, k = _rope_complex(q, *args), _rope_complex(k, *args)
    plain = _clone(inputs)
    plain[0], plain[1] = q.reshape(n, hq * d), k.reshape(n, hkv * d)
    plain[8] = plain[9] = plain[12] = plain[13] = None
    plain_attrs = {a: v for a, v in attrs.items() if a not in ("do_rotary", "rotary_interleaved",
                                                                "rotary_offset")}
    got, want = _run(inputs, attrs), _run(plain, plain_attrs)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


# -- dtypes, in-place, unsupported ------------------------------------------------------------
def test_half_precision_computes_in_float32():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "head_sink")
    for dtype in (torch.float16, torch.bfloat16):
        inputs, attrs = pa.make_inputs(recipe, dtype, 2)
        up = [t.float() if t is not None and t.is_floating_point() else t for t in inputs]
        out, kc, vc = _run(_clone(inputs), attrs)
        out32, kc32, vc32 = _run(up, attrs)
        assert out.dtype == dtype and kc.dtype == dtype
        assert torch.equal(out, out32.to(dtype))
        assert torch.equal(kc.float(), kc32) and torch.equal(vc.float(), vc32)


@pytest.mark.parametrize(
    ("change", "attrs"),
    [
        ({}, {"kv_cache_layout": "LATENT"}),
        ({}, {"k_cache_dtype": "int4"}),
        ({}, {"v_cache_dtype": "float4e2m1"}),
        ({3: "uint8"}, {}),
    ],
    ids=["latent", "k_int4", "v_fp4", "uint8_cache"],
)
def test_sub_byte_and_latent_are_unsupported(change, attrs):
    inputs = _tiny()
    if change:
        inputs[3], inputs[4] = inputs[3].to(torch.uint8), inputs[4].to(torch.uint8)
    with pytest.raises(UnsupportedConfiguration):
        _run(inputs, {"num_heads": 1, "kv_num_heads": 1, **attrs})


def _tiny_quant(cache=torch.int8, quant="PER_TENSOR"):
    inputs = _tiny()
    inputs[3], inputs[4] = inputs[3].to(cache), inputs[4].to(cache)
    shape = (1,) if quant == "PER_TENSOR" else (1, 1, 8)
    inputs[14], inputs[15] = torch.full(shape, 2.0**-4), torch.full(shape, 2.0**-5)
    return inputs, {"num_heads": 1, "kv_num_heads": 1, "k_quant_type": quant,
                    "v_quant_type": quant}


def _drop(i):
    def f(inputs, attrs):
        inputs[i] = None
    return f


def _set(i, value):
    def f(inputs, attrs):
        inputs[i] = value
    return f


def _attr(**kw):
    def f(inputs, attrs):
        attrs.update(kw)
    return f


def _fp_cache(inputs, attrs):
    inputs[3], inputs[4] = inputs[3].float(), inputs[4].float()


@pytest.mark.parametrize(("corrupt", "where"), [
    (_attr(k_quant_type="NONE"), "k_quant_type"),  # int8 cache without a quant type
    (_attr(v_quant_type="NONE"), "v_quant_type"),
    (_drop(14), "k_scale"),  # quantized without its scale
    (_drop(15), "v_scale"),
    (_set(14, torch.full((1, 1, 8), 0.05)), "k_scale"),  # PER_CHANNEL layout for PER_TENSOR
    (_set(15, torch.full((2,), 0.02)), "v_scale"),
    (_set(14, torch.full((1,), 0.05, dtype=torch.float16)), "k_scale"),  # T_KV_SCALE = float
    (_set(14, torch.full((1,), -0.05)), "k_scale"),
    (_set(15, torch.full((1,), float("nan"))), "v_scale"),
    (_attr(k_cache_dtype="float8e4m3fn"), "k_cache_dtype"),  # names another type
    (_attr(k_quant_type="PER_BLOCK"), "k_quant_type"),
    (_fp_cache, "k_quant_type"),  # float cache with quant types and scales
], ids=["k_quant_none", "v_quant_none", "no_k_scale", "no_v_scale", "k_scale_layout",
        "v_scale_shape", "k_scale_fp16", "k_scale_negative", "v_scale_nan", "k_dtype_attr",
        "quant_type_value", "float_cache_quant"])
def test_quantized_cache_violations_name_the_port(corrupt, where):
    inputs, attrs = _tiny_quant()
    _run(list(inputs), dict(attrs))  # the uncorrupted call is valid
    corrupt(inputs, attrs)
    with pytest.raises(ContractViolation) as info:
        _run(inputs, attrs)
    assert info.value.where == where


def test_scale_without_a_quantized_cache_is_a_violation():
    inputs = _tiny()
    inputs[14] = torch.ones(1)
    with pytest.raises(ContractViolation) as info:
        _run(inputs, {"num_heads": 1, "kv_num_heads": 1})
    assert info.value.where == "k_scale"


@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_hand_worked_quantized(cache, quant):
    """K/V are exact multiples of the scales, so the quantized op equals the float one, and the
    pages hold x / scale."""
    inputs, attrs = _tiny_quant(cache, quant)
    fp = _tiny()
    # the cached token (position 0, page 2): k0 = 2e0 -> 2 * 16 = 32, v0 = e0 -> 32
    inputs[3][2, 0, 0] = 0
    inputs[4][2, 0, 0] = 0
    inputs[3][2, 0, 0, 0], inputs[4][2, 0, 0, 0] = 32, 32
    out, kc, vc = _run(inputs, attrs)
    want, _, _ = _run(fp, {"num_heads": 1, "kv_num_heads": 1})
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert kc[2, 1, 0].float().tolist() == [0, 48, 0, 0, 0, 0, 0, 0]  # k1 = 3e1 * 16
    assert vc[2, 2, 0].float().tolist() == [0, 0, 32, 0, 0, 0, 0, 0]  # v2 = e2 * 32


def test_quantize_rounds_half_to_even_and_saturates():
    from pagedhybrid.kvquant import quantize

    s = torch.ones(1)
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 200.0, -300.0, float("nan")]])
    assert quantize(x[None], s, torch.int8)[0, 0].tolist() == [0, 2, 2, 0, -2, 126, 127, -128, 0]
    y = torch.tensor([[17.0, 19.0, 1e6, -1e6, float("nan"), 2.0**-9, 2.0**-10]])
    got = quantize(y[None], s, torch.float8_e4m3fn)[0, 0].float().tolist()
    # 17 is halfway between 16 and 18 -> 16 (even mantissa); 19 between 18 and 20 -> 20
    assert got == [16.0, 20.0, 448.0, -448.0, 448.0, 2.0**-9, 0.0]
    # a zero scale stores zeros (ORT: inv_scale = 0)
    assert quantize(x[None], torch.zeros(1), torch.int8).abs().sum() == 0


def test_validate_dims_and_output_shapes():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "zero_length_queries")
    inputs, attrs = pa.make_inputs(recipe, torch.float16, 0)
    dims = pa.validate(inputs, attrs)
    assert (dims.num_tokens, dims.batch, dims.num_heads, dims.kv_num_heads) == (4, 4, 4, 1)
    assert (dims.head_size, dims.block_size, dims.packed_qkv, dims.rotary_dim) == (32, 16, False,
                                                                                   0)
    assert dims.q_lens == [0, 3, 0, 1] and dims.past_lens == [20, 5, 0, 9]
    assert dims.max_query_len == 3 and dims.max_kv_len == 10
    assert dims.scale == pytest.approx(1 / math.sqrt(32))
    shapes = pa.output_shapes(inputs, attrs)
    assert shapes[0] == ((4, 128), torch.float16)
    assert shapes[1] == (tuple(inputs[3].shape), torch.float16) == shapes[2]


def test_metadata_overestimate_does_not_change_result():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "attention_metadata_loose_2")
    inputs, attrs = pa.make_inputs(recipe, torch.float32, 4)
    plain = _clone(inputs)
    plain[16] = None
    for x, y in zip(_run(_clone(inputs), attrs), _run(plain, attrs), strict=True):
        assert torch.equal(x, y)


# -- recipes -----------------------------------------------------------------------------------
def test_recipes_are_json_and_cover_features():
    recipes = pa.conformance_recipes()
    assert 10 <= len(recipes) <= 30
    assert json.loads(json.dumps(recipes)) == recipes
    assert len({r["name"] for r in recipes}) == len(recipes)
    assert all("reference" in r["backends"] for r in recipes)
    seen = {k for r in recipes for k, v in r["attrs"].items() if v}
    assert {"softcap", "local_window_size", "do_rotary", "rotary_interleaved", "scale"} <= seen
    assert any(r["attrs"].get("is_causal") == 0 for r in recipes)
    ratios = {r["attrs"]["num_heads"] // r["attrs"]["kv_num_heads"] for r in recipes}
    assert {1, 2, 4, 8} <= ratios
    assert {64, 128} <= {r["dims"]["head_size"] for r in recipes}
    quant = {(r["dims"]["cache_dtype"], r["attrs"][f"{kv}_quant_type"]) for r in recipes
             if r["dims"]["cache_dtype"] for kv in "kv"}
    assert quant == {(c, q) for c in ("int8", "float8e4m3fn")
                     for q in ("PER_TENSOR", "PER_CHANNEL")}


def test_make_inputs_deterministic_garbage_and_shuffled():
    recipe = next(r for r in pa.conformance_recipes() if r["name"] == "page_boundaries_15_16_17")
    a, attrs = pa.make_inputs(recipe, torch.float16, 9)
    b, _ = pa.make_inputs(recipe, torch.float16, 9)
    c, _ = pa.make_inputs(recipe, torch.float16, 10)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[3], c[3])
    assert len(a) == len(pa.SPEC.inputs)
    table = a[7]
    used = table[table >= 0].tolist()
    assert len(used) == len(set(used)) and used != sorted(used)  # distinct, shuffled
    assert (a[3] != 0).float().mean() > 0.99  # pages hold garbage, not zeros
    pa.validate(a, attrs)
