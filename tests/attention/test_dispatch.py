"""Contract-aware dispatch: declared capabilities only, every rejection named, no silent fallback,
JSON provenance, and the selected ops really computing the contract."""

from __future__ import annotations

import json
import math

import pytest
import torch
from contract_builders import (
    decode_contract,
    qwen3_contract,
    qwen3_rope,
    single_rank_sharding,
)

from pagedhybrid.attention.backends import (
    DETERMINISTIC_CP,
    TORCH_VARLEN,
    build_default_registry,
    torch_varlen_attention,
)
from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.attention.contract import (
    AttentionContract,
    ReductionSpec,
    RoPESpec,
)
from pagedhybrid.attention.registry import AttentionDispatchError, AttentionRegistry
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.ops.paged_attention import paged_attention
from pagedhybrid.parallel import context_parallel_attention


def _prefill(cp_world: int = 1, **over: object) -> AttentionContract:
    kw: dict[str, object] = dict(
        role="infer", mode="prefill", dtype="fp32", batch_size=2, query_sequence_length=24,
        head_dim=8, causal=True, causal_offsets=(0, 0),
        sharding=single_rank_sharding(24, packed=(0, 10, 24)),
        reduction=ReductionSpec(kv_block_size=4))
    kw.update(over)
    return AttentionContract(**kw)  # type: ignore[arg-type]


def test_default_registry_holds_the_real_backends_with_truthful_capabilities() -> None:
    reg = build_default_registry()
    ids = [b.backend_id for b in reg.backends]
    assert {"torch_varlen", "deterministic_cp", "paged_attention_reference"} <= set(ids)
    assert reg.get_op("paged_attention") is paged_attention
    ref = reg.backend("paged_attention_reference").capability
    assert ref is not None and not ref.exports_attention_lse  # ORT's op returns no LSE
    assert not TORCH_VARLEN.deterministic_cp_merge and TORCH_VARLEN.cp_world_sizes == (1,)
    assert DETERMINISTIC_CP.deterministic_cp_merge and DETERMINISTIC_CP.cp_world_sizes is None
    with pytest.raises(UnsupportedConfiguration, match="no op named 'nope'"):
        reg.get_op("nope")


def test_auto_prefill_selects_the_first_compatible_backend_without_fallback() -> None:
    res = build_default_registry().get_attention_op(_prefill())
    p = res.provenance
    assert p.actual_backend == res.provenance.capability["backend_id"]
    assert p.requested_backend == "auto"
    first = next(b for b in build_default_registry().backends
             if b.capability is not None and b.capability.supports(_prefill()))
    assert p.actual_backend == first.backend_id
    assert p.fallback is (p.prior_rejections != {})


def test_decode_falls_back_with_provenance_listing_every_prior_rejection() -> None:
    reg = build_default_registry()
    res = reg.get_attention_op(decode_contract())
    p = res.provenance
    assert p.actual_backend == "deterministic_cp" and p.fallback
    assert "torch_varlen" in p.prior_rejections
    assert "mode=decode is unsupported" in p.prior_rejections["torch_varlen"]
    assert "KV-cache identity materialization is unsupported" in p.prior_rejections[
        "torch_varlen"]
    assert p.fallback_reason is not None and "torch_varlen: mode=decode" in p.fallback_reason
    d = json.loads(p.to_json())
    assert AttentionContract.from_dict(d["contract"]) == decode_contract()
    assert AttentionBackendCapability.from_dict(d["capability"]) == DETERMINISTIC_CP
    assert set(d) >= {"requested_backend", "actual_backend", "platform", "fallback",
                      "fallback_reason", "prior_rejections", "contract", "capability"}


def test_undeclared_backend_is_rejected_never_dispatched() -> None:
    reg = AttentionRegistry()
    reg.register_attention_backend("legacy_sdpa", torch.nn.functional.scaled_dot_product_attention)
    with pytest.raises(AttentionDispatchError, match="no AttentionBackendCapability declared") as e:
        reg.get_attention_op(_prefill())
    assert "legacy_sdpa" in e.value.rejections
    with pytest.raises(AttentionDispatchError, match="legacy_sdpa: no AttentionBackendCapability"):
        reg.get_attention_op(_prefill(), requested_backend="legacy_sdpa")


def test_no_incompatible_fallback_for_an_explicit_backend() -> None:
    reg = build_default_registry()
    # a compatible backend exists (torch_varlen), but the caller named another one
    with pytest.raises(AttentionDispatchError) as e:
        reg.get_attention_op(_prefill(), requested_backend="paged_attention_reference")
    assert e.value.rejections["torch_varlen"] == ()  # every backend's reasons are listed
    assert "paged_attention_reference: attention-domain LSE export is unsupported" in str(e.value)
    assert "torch_varlen" not in str(e.value).split("Rejections:")[1]  # nothing else was tried


def test_cp_requires_an_explicitly_named_deterministic_backend() -> None:
    reg = build_default_registry()
    c = qwen3_contract()
    for policy in ("auto", "production", "reference"):
        with pytest.raises(AttentionDispatchError, match="CP=2 requires an explicitly named"):
            reg.get_attention_op(c, requested_backend=policy)
    with pytest.raises(AttentionDispatchError, match="'deterministic' is not a dispatch policy"):
        reg.get_attention_op(c, requested_backend="deterministic")
    with pytest.raises(AttentionDispatchError) as e:
        reg.get_attention_op(c, requested_backend="torch_varlen")
    assert "CP=2 is unsupported" in str(e.value)
    assert "deterministic CP (out, lse) merge is unsupported" in str(e.value)
    res = reg.get_attention_op(c, requested_backend="deterministic_cp")
    assert res.provenance.actual_backend == "deterministic_cp" and not res.provenance.fallback
    assert "all_to_all_single" in (res.provenance.communication_backend or "")
    with pytest.raises(UnsupportedConfiguration, match="unknown attention backend 'flash'"):
        reg.get_attention_op(c, requested_backend="flash")


def test_policy_skips_are_not_fallback_and_never_widen_the_choice() -> None:
    reg = build_default_registry()
    with pytest.raises(AttentionDispatchError, match="Skipped by policy") as e:
        reg.get_attention_op(decode_contract(), requested_backend="production")
    assert "deterministic_cp" not in e.value.args[0].split("Rejections:")[1].split("Skipped")[0]
    res = reg.get_attention_op(decode_contract(), requested_backend="reference")
    assert res.provenance.actual_backend == "deterministic_cp"
    assert "torch_varlen" in res.provenance.policy_skipped and not res.provenance.fallback


def test_every_incompatibility_is_listed() -> None:
    cap = AttentionBackendCapability(backend_id="narrow", roles=("infer",), modes=("prefill",),
                                     dtypes=("fp16",), head_dims=(64,), tp_world_sizes=(1,),
                                     supports_non_causal=False)
    rope = RoPESpec(q_state="pre_rope", k_state="pre_rope", rotary_dim=128,
                    fusion_boundary="fused_rope_attention")
    c = decode_contract(role="train", dtype="bf16", rope=rope, head_dim=128, causal=False,
                        causal_offsets=None)
    reasons = cap.incompatibilities(c)
    assert reasons == (
        "role=train is unsupported", "mode=decode is unsupported", "dtype=bf16 is unsupported",
        "head_dim=128 is unsupported", "attention-domain LSE export is unsupported",
        "KV-cache identity materialization is unsupported", "non-causal attention is unsupported",
        "RoPE/position metadata is unsupported", "fused RoPE+Attention boundary is unsupported")
    c2 = qwen3_contract()
    assert "TP=2 is unsupported" in cap.incompatibilities(c2)
    assert "CP=2 is unsupported" in cap.incompatibilities(c2)
    assert "packed varlen layout is unsupported" in cap.incompatibilities(_prefill())
    assert not cap.supports(c2)


def test_rope_metadata_gates_dispatch() -> None:
    reg = build_default_registry()
    fused = RoPESpec(q_state="pre_rope", k_state="pre_rope", rotary_dim=8,
                     fusion_boundary="fused_rope_attention")
    with pytest.raises(AttentionDispatchError) as e:
        reg.get_attention_op(_prefill(rope=fused))
    assert "torch_varlen: fused RoPE+Attention boundary is unsupported" in str(e.value)
    assert "deterministic_cp: fused RoPE+Attention boundary is unsupported" in str(e.value)
    unfused = qwen3_rope(rotary_dim=8, query_position_offsets=(0, 0), key_position_offsets=(0, 0),
                         output_dtype="fp32")
    assert reg.get_attention_op(_prefill(rope=unfused)).provenance.actual_backend in (
        "torch_varlen", "cpu_paged_attention", "webgpu_paged_attention")
    bare = AttentionRegistry()
    bare.register_attention_backend("plain", torch_varlen_attention, AttentionBackendCapability(
        **{**TORCH_VARLEN.__dict__, "backend_id": "plain", "supports_rope_metadata": False}))
    with pytest.raises(AttentionDispatchError, match="RoPE/position metadata is unsupported"):
        bare.get_attention_op(_prefill(rope=unfused))


def test_platform_filter_rejects_other_platforms_with_a_reason() -> None:
    with pytest.raises(AttentionDispatchError, match="platform=cpu, requested platform=metal"):
        build_default_registry().get_attention_op(_prefill(), platform="metal")


def test_dispatched_ops_compute_the_contract() -> None:
    """The selected prefill backend and the CP backend agree with a float64 dense oracle."""
    c = _prefill()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 4, 8, generator=g), torch.randn(24, 2, 8, generator=g),
               torch.randn(24, 2, 8, generator=g))
    reg = build_default_registry()
    out_a, lse_a = reg.get_attention_op(c, requested_backend="torch_varlen").op(
        q, k, v, contract=c)
    out_b, lse_b = reg.get_attention_op(c, requested_backend="deterministic_cp").op(
        q, k, v, contract=c)
    ref_out, ref_lse = torch.zeros(24, 4, 8, dtype=torch.float64), torch.zeros(24, 4,
                                                                             dtype=torch.float64)
    for s, e in ((0, 10), (10, 24)):
        kk = k[s:e].double().repeat_interleave(2, 1)
        vv = v[s:e].double().repeat_interleave(2, 1)
        sc = torch.einsum("ihd,jhd->hij", q[s:e].double(), kk) / math.sqrt(8)
        sc = sc.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        ref_lse[s:e] = torch.logsumexp(sc, -1).T
        ref_out[s:e] = torch.einsum("hij,jhd->ihd", torch.softmax(sc, -1), vv)
    for out, lse in ((out_a, lse_a), (out_b, lse_b)):
        assert (out.double() - ref_out).abs().max() < 1e-6
        assert (lse.double() - ref_lse).abs().max() < 1e-6
    assert not torch.equal(out_a, out_b) or torch.equal(lse_a, lse_b)  # both ran


def test_torch_varlen_backend_trains_and_rejects_what_it_cannot_do() -> None:
    c = _prefill(role="train", causal_offsets=(0, 2))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(24, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(24, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(24, 2, 8, generator=g, dtype=torch.float64)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out, lse = torch_varlen_attention(q32, k32, v32, contract=c)
    (out.square().sum() + lse.sum()).backward()
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ro, rl = [], []
    for s, e, off in ((0, 10, 0), (10, 24, 2)):
        kk, vv = k64[s:e].repeat_interleave(2, 1), v64[s:e].repeat_interleave(2, 1)
        sc = torch.einsum("ihd,jhd->hij", q64[s:e], kk) / math.sqrt(8)
        n = e - s
        sc = sc.masked_fill(torch.arange(n)[None] > torch.arange(n)[:, None] + off, float("-inf"))
        rl.append(torch.logsumexp(sc, -1).T)
        ro.append(torch.einsum("hij,jhd->ihd", torch.softmax(sc, -1), vv))
    (torch.cat(ro).square().sum() + torch.cat(rl).sum()).backward()
    assert (out.double() - torch.cat(ro)).abs().max() < 1e-5
    for a, b in ((q32, q64), (k32, k64), (v32, v64)):
        assert a.grad is not None and b.grad is not None
        assert (a.grad.double() - b.grad).abs().max() < 1e-4
    with pytest.raises(UnsupportedConfiguration, match="CP=2 is unsupported"):
        torch_varlen_attention(q32, k32, v32, contract=qwen3_contract())
    with pytest.raises(UnsupportedConfiguration, match="mode=decode is unsupported"):
        torch_varlen_attention(q32, k32, v32, contract=decode_contract())


def test_cp_backend_is_forward_only_and_says_so() -> None:
    with pytest.raises(UnsupportedConfiguration, match="forward-only"):
        context_parallel_attention(torch.zeros(24, 4, 8), torch.zeros(24, 2, 8),
                                   torch.zeros(24, 2, 8), contract=_prefill(role="train"))
    assert DETERMINISTIC_CP.incompatibilities(_prefill(role="train")) == (
        "role=train is unsupported",)
    assert DETERMINISTIC_CP.incompatibilities(_prefill(mode="chunked_prefill")) == (
        "mode=chunked_prefill without a KV cache is unsupported",)


def test_a_batch_invariant_contract_is_refused_by_every_backend_without_the_property() -> None:
    """The contract carries the property; each backend's capability declares it or not; a
    backend that does not is rejected with that reason (never a silent fallback). The one
    bundle that declares it returns no attention-domain LSE, which these contracts export, so
    here nothing serves -- and the refusal says exactly that."""
    reg = build_default_registry()
    strict = _prefill(reduction=ReductionSpec(kv_block_size=4, batch_invariant=True))
    ex = reg.explain(strict)
    assert ex.selected is None
    for b in reg.backends:
        reasons = " ".join(ex.rejections[b.backend_id])
        if b.capability is None:
            continue
        assert ("batch-invariant reduction is unsupported" in reasons) == \
            (not b.capability.batch_invariant), b.backend_id
    assert ex.rejections["native_batch_invariant"] == (
        "attention-domain LSE export is unsupported",)
    with pytest.raises(AttentionDispatchError, match="torch_varlen: batch-invariant reduction"):
        reg.get_attention_op(strict)
    assert reg.explain(_prefill()).selected == "torch_varlen"  # the plain contract is served
