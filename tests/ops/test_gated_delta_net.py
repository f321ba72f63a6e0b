"""GatedDeltaNet reference: hand-worked cases, a chunked (WY/UT) formulation, layouts, HF oracle."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.ops.gated_delta_net import gated_delta_net

gdn_mod = importlib.import_module("pagedhybrid.ops.gated_delta_net")

RULES = ("linear", "gated", "delta", "gated_delta")


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def t(x: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


# -- hand-worked ---------------------------------------------------------------------------------
def test_hand_worked_gated_delta_scalar_two_tokens() -> None:
    # Dk = Dv = 1, one head, one sequence, scale 1.
    # token 1: S = 0.5*2 = 1; r = 1; delta = 0.5*(3-1) = 1; S = 2; o = 2*1 = 2
    # token 2: S = 1*2 = 2;  r = 2; delta = 0.25*(0-2) = -0.5; S = 1.5; o = 1.5*3 = 4.5
    q, k, v = t([[[1.0]], [[3.0]]]), t([[[1.0]], [[1.0]]]), t([[[3.0]], [[0.0]]])
    decay = t([[math.log(0.5)], [0.0]])  # log-space
    beta = t([[0.5], [0.25]])
    s0 = t([[[[2.0]]]])  # [B, Hv, Dv, Dk]
    out, final = gated_delta_net(q, k, v, cu_of([2]), decay, beta, s0, scale=1.0)
    torch.testing.assert_close(out.flatten(), t([2.0, 4.5]))
    torch.testing.assert_close(final.flatten(), t([1.5]))


def test_hand_worked_linear_rule_vmajor_state() -> None:
    # Dk = 2, Dv = 1: S = k1 v1^T + k2 v2^T = [[2], [3]]; o1 = [1,1].[2,0] = 2, o2 = [1,2].[2,3] = 8
    q = t([[[1.0, 1.0]], [[1.0, 2.0]]])
    k = t([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = t([[[2.0]], [[3.0]]])
    out, final = gated_delta_net(q, k, v, cu_of([2]), update_rule="linear", scale=1.0)
    torch.testing.assert_close(out.flatten(), t([2.0, 8.0]))
    assert final.shape == (1, 1, 1, 2)  # [B, Hv, Dv, Dk]
    torch.testing.assert_close(final.flatten(), t([2.0, 3.0]))


def test_hand_worked_per_key_decay() -> None:
    # S0 = [4, 4] (Dk=2, Dv=1); decay rows by [0.5, 0.25] -> [2, 1]; + k v^T = [3, 2]; o = 3
    q, k, v = t([[[1.0, 0.0]]]), t([[[1.0, 1.0]]]), t([[[1.0]]])
    decay = torch.log(t([[[0.5, 0.25]]]))  # [T, Hv, Dk]
    out, final = gated_delta_net(q, k, v, cu_of([1]), decay, None, t([[[[4.0, 4.0]]]]),
                                 update_rule="gated", scale=1.0)
    assert out.item() == pytest.approx(3.0)
    torch.testing.assert_close(final.flatten(), t([3.0, 2.0]))


def test_hand_worked_inverse_gqa_head_mapping() -> None:
    # Hk = 2, Hv = 4: value head h reads key/query head h // 2 (repeat_interleave, not tile).
    q = t([[[1.0, 0.0], [0.0, 2.0]]])
    k = t([[[1.0, 0.0], [0.0, 1.0]]])
    v = t([[[1.0], [2.0], [3.0], [4.0]]])
    out, _ = gated_delta_net(q, k, v, cu_of([1]), update_rule="linear", scale=1.0)
    # o_h = v_h * (q_hk . k_hk) = v_h * [1, 1, 2, 2]; the tile mapping would give [1, 4, 3, 8]
    torch.testing.assert_close(out.flatten(), t([1.0, 2.0, 6.0, 8.0]))


@pytest.mark.parametrize("gate", ["softplus", "qwen", "sigmoid", "kda"])
def test_hand_worked_fused_gates(gate: str) -> None:
    # a_log = 0, decay + dt_bias = 0: softplus -> g = -ln 2; sigmoid -> g = lb / 2 = -ln 2
    q, k, v = t([[[0.0]]]), t([[[0.0]]]), t([[[0.0]]])
    _, final = gated_delta_net(
        q, k, v, cu_of([1]), t([[0.5]]), None, t([[[[8.0]]]]), t([0.0]), t([-0.5]),
        update_rule="gated", gate_activation=gate, gate_lower_bound=-2 * math.log(2.0))
    assert final.item() == pytest.approx(4.0, rel=1e-6)  # 8 * exp(-ln 2)


def test_hand_worked_l2_norm_beta_sigmoid_and_default_scale() -> None:
    # q = [3, 4] -> [0.6, 0.8]; k = [0, 2] -> [0, 1]; beta = sigmoid(0) = 0.5, S0 = 0
    # S = k (0.5 * v)^T = [[0], [1]] (v = 2); o = (1/sqrt 2) * 0.8 * 1
    q, k, v = t([[[3.0, 4.0]]]), t([[[0.0, 2.0]]]), t([[[2.0]]])
    out, final = gated_delta_net(q, k, v, cu_of([1]), None, t([[0.0]]), update_rule="delta",
                                 beta_activation="sigmoid", qk_l2_norm=1)
    assert out.item() == pytest.approx(0.8 / math.sqrt(2.0), rel=1e-6)
    torch.testing.assert_close(final.flatten(), t([0.0, 1.0]))


def test_l2_norm_eps_is_1e_12_like_ort() -> None:
    # |q|^2 = 1e-12 = eps: q_hat = q * rsqrt(2e-12) has norm 1/sqrt(2) (HF's eps 1e-6 gives 1e-3)
    q, k, v = t([[[1e-6, 0.0]]]), t([[[1.0, 0.0]]]), t([[[1.0]]])
    out, _ = gated_delta_net(q, k, v, cu_of([1]), update_rule="linear", scale=1.0, qk_l2_norm=1)
    assert out.item() == pytest.approx(1 / math.sqrt(2.0), rel=1e-5)


# -- independent formulation: chunked WY / UT form -----------------------------------------------
def chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                     beta: torch.Tensor | None, s0: torch.Tensor, rule: str, scale: float,
                     chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk-parallel. q, k [n, H, Dk] (heads already expanded), v [n, H, Dv],
    g [n, H] or [n, H, Dk] (log-space) or None, beta [n, H] or None, s0 [H, Dv, Dk] (V-major).

    Within a chunk with cumulative decay A_t = exp(sum_{i<=t} g_i) (per key dim):
      S_t = diag(A_t) S0 + sum_{i<=t} diag(A_t / A_i) k_i d_i^T
      delta rules: (I + L) D = diag(beta) (V - (A*K) S0), L_ti = beta_t (A_t k_t).(k_i / A_i), i<t
        i.e. the UT transform T = (I + L)^-1 diag(beta), U = T V, W = T (A*K), D = U - W S0
      other rules: D = V
      O = scale * ((A*Q) S0 + tril((A*Q)(K/A)^T) D);  S_end = diag(A_n) S0 + (K * A_n/A)^T D
    """
    n, h, dk = k.shape
    s = s0.transpose(-1, -2)  # [H, Dk, Dv]
    outs = []
    for c0 in range(0, n, chunk):
        qc, kc, vc = (x[c0:c0 + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        c = kc.shape[1]
        if rule in ("gated", "gated_delta"):
            gc = g[c0:c0 + chunk].transpose(0, 1)  # [H, C(, Dk)]
            gc = gc[..., None].expand(h, c, dk) if gc.dim() == 2 else gc
            a = torch.exp(torch.cumsum(gc, dim=1))  # [H, C, Dk]
        else:
            a = torch.ones(h, c, dk, dtype=q.dtype)
        ka, kd, qa = kc * a, kc / a, qc * a  # [H, C, Dk]
        if rule in ("delta", "gated_delta"):
            bc = beta[c0:c0 + chunk].T  # [H, C]
            lower = torch.tril(bc[..., None] * (ka @ kd.transpose(-1, -2)), diagonal=-1)
            eye = torch.eye(c, dtype=q.dtype).expand(h, c, c)
            tmat = torch.linalg.solve_triangular(eye + lower, torch.diag_embed(bc), upper=False)
            u, w = tmat @ vc, tmat @ ka  # [H, C, Dv], [H, C, Dk]
            d = u - w @ s  # [H, C, Dv]
        else:
            d = vc
        causal = torch.tril(qa @ kd.transpose(-1, -2))  # [H, C, C]
        outs.append((scale * (qa @ s + causal @ d)).transpose(0, 1))  # [C, H, Dv]
        a_end = a[:, -1:, :]  # [H, 1, Dk]
        s = a_end.transpose(-1, -2) * s + (kd * a_end).transpose(-1, -2) @ d
    return torch.cat(outs), s.transpose(-1, -2)


def chunked_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                beta: torch.Tensor | None, s0: torch.Tensor, lens: list[int], rule: str,
                scale: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed wrapper: q, k [T, Hk, Dk] -> heads repeat_interleaved to Hv."""
    rep = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    outs, states, start = [], [], 0
    for b, n in enumerate(lens):
        sl = slice(start, start + n)
        if n == 0:
            states.append(s0[b])
        else:
            o, s = chunked_sequence(q[sl], k[sl], v[sl], None if g is None else g[sl],
                                    None if beta is None else beta[sl], s0[b], rule, scale, chunk)
            outs.append(o)
            states.append(s)
        start += n
    return torch.cat(outs), torch.stack(states)


def random_case(lens: list[int], hk: int, hv: int, dk: int, dv: int, rule: str, per_key: bool,
                seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    f64 = torch.float64
    k = torch.randn(n, hk, dk, generator=gen, dtype=f64)
    gshape = (n, hv, dk) if per_key else (n, hv)
    return {
        "q": torch.randn(n, hk, dk, generator=gen, dtype=f64),
        "k": k / k.norm(dim=-1, keepdim=True),
        "v": torch.randn(n, hv, dv, generator=gen, dtype=f64),
        "g": -(0.02 + 0.5 * torch.rand(*gshape, generator=gen, dtype=f64))
        if rule in ("gated", "gated_delta") else None,
        "beta": torch.rand(n, hv, generator=gen, dtype=f64) if "delta" in rule else None,
        "s0": torch.randn(len(lens), hv, dv, dk, generator=gen, dtype=f64),
    }


@pytest.mark.parametrize(("rule", "per_key"), [
    *[(r, False) for r in RULES], ("gated", True), ("gated_delta", True)])
def test_chunked_form_matches_recurrence_at_chunk_boundaries(rule: str, per_key: bool) -> None:
    lens = [63, 64, 65, 1]
    c = random_case(lens, 1, 2, 8, 4, rule, per_key, seed=7)
    want_o, want_s = chunked_gdn(c["q"], c["k"], c["v"], c["g"], c["beta"], c["s0"], lens, rule,
                                 0.3, chunk=64)
    o, s = gated_delta_net(c["q"], c["k"], c["v"], cu_of(lens), c["g"], c["beta"], c["s0"],
                           update_rule=rule, scale=0.3)
    torch.testing.assert_close(o, want_o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, want_s, rtol=1e-9, atol=1e-9)
    f32 = {key: None if x is None else x.float() for key, x in c.items()}
    o32, s32 = gated_delta_net(f32["q"], f32["k"], f32["v"], cu_of(lens), f32["g"], f32["beta"],
                               f32["s0"], update_rule=rule, scale=0.3)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert (o32.double() - want_o).abs().max() <= 1e-5
    assert (s32.double() - want_s).abs().max() <= 1e-5


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 20), min_size=1, max_size=4).filter(lambda x: sum(x) > 0),
       hk=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 2, 4]),
       rule=st.sampled_from(RULES), per_key=st.booleans(), chunk=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16))
def test_property_recurrence_equals_chunked(lens: list[int], hk: int, ratio: int, rule: str,
                                            per_key: bool, chunk: int, seed: int) -> None:
    per_key = per_key and rule in ("gated", "gated_delta")
    c = random_case(lens, hk, hk * ratio, 4, 3, rule, per_key, seed)
    want_o, want_s = chunked_gdn(c["q"], c["k"], c["v"], c["g"], c["beta"], c["s0"], lens, rule,
                                 0.5, chunk)
    o, s = gated_delta_net(c["q"], c["k"], c["v"], cu_of(lens), c["g"], c["beta"], c["s0"],
                           update_rule=rule)  # scale 0 -> 1/sqrt(4) = 0.5
    torch.testing.assert_close(o, want_o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, want_s, rtol=1e-9, atol=1e-9)


# -- layouts and state carry -----------------------------------------------------------------------
def recipe(name: str) -> dict:
    return next(r for r in gdn_mod.conformance_recipes() if r["name"] == name)


def test_packed_rank4_and_uniform_spellings_agree() -> None:
    ins, attrs = gdn_mod.make_inputs(recipe("packed_qkv_uniform_rank3"), torch.float32, 5)
    q, _, _, _, decay, beta, s0 = ins[:7]
    b, s, w = q.shape
    hv, dv, dk = s0.shape[1:]
    hk = (w - hv * dv) // (2 * dk)
    qq, kk, vv = q.split([hk * dk, hk * dk, hv * dv], dim=-1)
    qq, kk, vv = qq.reshape(b, s, hk, dk), kk.reshape(b, s, hk, dk), vv.reshape(b, s, hv, dv)
    o_packed, s_packed = gated_delta_net(*ins, **attrs)  # [B, S, W] packed, no cu_seqlens
    o_rank4, s_rank4 = gated_delta_net(qq, kk, vv, None, decay, beta, s0, **attrs)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (qq, kk, vv, decay, beta)]
    cu = cu_of([s] * b)
    o_cu, s_cu = gated_delta_net(flat[0], flat[1], flat[2], cu, flat[3], flat[4], s0, **attrs)
    o_nocu, _ = gated_delta_net(flat[0], flat[1], flat[2], None, flat[3], flat[4], s0, **attrs)
    o_p2, _ = gated_delta_net(q.reshape(b * s, w), None, None, cu, flat[3], flat[4], s0, **attrs)
    assert o_packed.shape == o_rank4.shape == (b, s, hv, dv)
    for o in (o_rank4.reshape(b * s, hv, dv), o_nocu, o_p2):
        torch.testing.assert_close(o, o_cu, rtol=0, atol=0)
    torch.testing.assert_close(o_packed.reshape(b * s, hv, dv), o_cu, rtol=0, atol=0)
    for st_ in (s_packed, s_rank4):
        torch.testing.assert_close(st_, s_cu, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(2, 10), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       data=st.data())
def test_split_calls_with_carried_state_equal_one_call(lens: list[int], seed: int,
                                                       data: st.DataObject) -> None:
    # zero-length pieces are allowed, but each call needs at least one token
    cuts = [data.draw(st.integers(1, n - 1) if i == 0 else st.integers(0, n))
            for i, n in enumerate(lens)]
    c = random_case(lens, 1, 2, 4, 4, "gated_delta", False, seed)
    kw = {"update_rule": "gated_delta"}
    full_o, full_s = gated_delta_net(c["q"], c["k"], c["v"], cu_of(lens), c["g"], c["beta"],
                                     c["s0"], **kw)
    starts = cu_of(lens)[:-1].tolist()

    def part(x: torch.Tensor, second: bool) -> torch.Tensor:
        return torch.cat([x[s + m:s + n] if second else x[s:s + m]
                          for s, m, n in zip(starts, cuts, lens, strict=True)])

    args1 = [part(c[key], False) for key in ("q", "k", "v", "g", "beta")]
    args2 = [part(c[key], True) for key in ("q", "k", "v", "g", "beta")]
    rest = [n - m for n, m in zip(lens, cuts, strict=True)]
    o1, s1 = gated_delta_net(*args1[:3], cu_of(cuts), *args1[3:], c["s0"], **kw)
    o2, s2 = gated_delta_net(*args2[:3], cu_of(rest), *args2[3:], s1, **kw)
    torch.testing.assert_close(s2, full_s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([part(full_o, False), part(full_o, True)]),
                               torch.cat([o1, o2]), rtol=1e-12, atol=1e-12)


def test_validate_output_shapes_and_recipes() -> None:
    recipes = gdn_mod.conformance_recipes()
    assert 10 <= len(recipes) <= 30 and len({r["name"] for r in recipes}) == len(recipes)
    for r in recipes:
        ins, attrs = gdn_mod.make_inputs(r, torch.float32, 0)
        assert len(ins) == len(gdn_mod.SPEC.inputs)
        outs = gated_delta_net(*ins, **attrs)
        assert len(outs) == (3 if "capture" in r["dims"] else 2)
        assert gdn_mod.output_shapes(*ins, **attrs) == tuple((tuple(o.shape), o.dtype)
                                                             for o in outs)
        assert outs[1].dtype == torch.float32
    ins, attrs = gdn_mod.make_inputs(recipe("packed_qkv_varlen"), torch.float16, 0)
    d = gdn_mod.validate(*ins, **attrs)
    assert (d.packed_qkv, d.batch, d.num_heads_qk, d.num_heads_v, d.head_size_qk,
            d.head_size_v, d.total_tokens) == (True, 3, 2, 4, 8, 8, 12)
    assert d.cu_seqlens == (0, 3, 11, 12) and d.output_shape == (12, 4, 8)
    assert d.scale == pytest.approx(8 ** -0.5) and d.state_dtype == torch.float32


def test_zero_length_sequence_passes_state_through() -> None:
    ins, attrs = gdn_mod.make_inputs(recipe("zero_length_sequences"), torch.float32, 0)
    _, final = gated_delta_net(*ins, **attrs)
    lens = recipe("zero_length_sequences")["dims"]["seq_lens"]
    for b, n in enumerate(lens):
        assert torch.equal(final[b], ins[6][b]) == (n == 0)


# -- second external oracle: HF transformers' torch recurrent gated delta rule -------------------
def test_qwen_config_matches_hf_torch_recurrent_gated_delta_rule() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(11)
    b, s, hk, hv, dk, dv = 2, 9, 2, 4, 16, 8
    q = torch.randn(b, s, hk, dk, generator=gen)
    k = torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, hv, dv, generator=gen)
    a = torch.randn(b, s, hv, generator=gen)  # raw gate projection
    braw = torch.randn(b, s, hv, generator=gen)
    a_log = torch.randn(hv, generator=gen) * 0.5
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    state_k_major = torch.randn(b, hv, dk, dv, generator=gen) * 0.5  # HF layout
    g = -torch.exp(a_log) * torch.nn.functional.softplus(a + dt_bias)  # activated, as HF expects
    want_o, want_s = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=torch.sigmoid(braw), initial_state=state_k_major,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s_vmajor = gated_delta_net(q, k, v, None, a, braw, state_k_major.transpose(-1, -2),
                                  a_log, dt_bias, gate_activation="qwen",
                                  beta_activation="sigmoid", qk_l2_norm=1)
    # HF's l2norm eps is 1e-6, ORT's 1e-12: a relative difference ~1e-6/|x|^2, far below tol
    assert (o - want_o).abs().max() <= 1e-5
    assert (s_vmajor.transpose(-1, -2) - want_s).abs().max() <= 1e-5
