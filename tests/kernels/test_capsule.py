"""Verify-step kernels (``kernels/capsule.py``): capture leaves the state rows alone and records
ONNX Runtime's compact state update per token; replay of any accepted prefix equals running that
prefix in place -- bit for bit on the native kernels, whose per-token arithmetic is one function.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.capsule import (
    Capsule,
    capsule_bytes,
    conv_replay_index,
    full_state_bytes,
    replay_conv,
    segments,
    torch_capture,
    torch_replay,
)
from pagedhybrid.kernels.native import library, status
from pagedhybrid.kernels.native.seam import CAPTURE
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.synthetic import tiny_byte_config
from pagedhybrid.ops.gated_delta_net import gated_delta_net

HV, HK, DK, DV, SLOTS, CAP = 4, 2, 32, 16, 5, 6
LENS, SLOT_OF = (4, 1 + 1, 6), (3, 0, 4)  # three verify chunks on slots 3, 0, 4


@pytest.fixture(autouse=True)
def _native_kernels_built() -> None:
    assert status().available, status().reason


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)

    def rn(*s: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*s, generator=g) * scale

    k = rn(t, HK, DK)
    q = rn(t, HK, DK)
    return dict(q=q / q.norm(dim=-1, keepdim=True), k=k / k.norm(dim=-1, keepdim=True),
                v=rn(t, HV, DV), a=rn(t, HV), b=rn(t, HV), a_log=rn(HV, scale=0.5),
                dt_bias=rn(HV, scale=0.5), pool=rn(SLOTS, HV, DV, DK, scale=0.3))


def meta(lens: tuple[int, ...] = LENS, slots: tuple[int, ...] = SLOT_OF) -> StepMetadata:
    return StepMetadata.build(lens, [7] * len(lens), None, slots, block_size=1, num_pages=0,
                              num_slots=SLOTS)


def capsule() -> Capsule:
    cfg = dataclasses.replace(tiny_byte_config(), linear_num_value_heads=HV,
                              linear_num_key_heads=HK, linear_key_head_dim=DK,
                              linear_value_head_dim=DV)
    return Capsule.allocate(cfg, SLOTS, CAP, torch.float32)


def in_place(x: dict[str, torch.Tensor], m: StepMetadata, pool: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x["v"].shape)
    library().gated_delta_varlen(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"],
                                 x["dt_bias"], pool, m.state_slots, m.fresh_t, m.cu_seqlens_t,
                                 out, DK ** -0.5)
    return out


def test_native_capture_equals_the_in_place_kernel_and_replay_any_prefix() -> None:
    x, m, caps = inputs(), meta(), capsule()
    pool = x["pool"].clone()
    out = CAPTURE.gated_delta(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"],
                              pool, m, DK ** -0.5, caps)
    assert torch.equal(pool, x["pool"])  # the rows are only read
    ran = x["pool"].clone()
    assert torch.equal(out, in_place(x, m, ran))
    cu = m.cu_seqlens
    for cut in range(max(LENS) + 1):  # every accepted prefix, each chunk as long as it goes
        n = [min(cut, length) for length in LENS]
        got = x["pool"].clone()
        CAPTURE.replay(got, m.state_slots, caps, torch.zeros(3, dtype=torch.int32),
                       torch.tensor(n, dtype=torch.int32))
        want = x["pool"].clone()
        rows = torch.cat([torch.arange(cu[b], cu[b] + n[b]) for b in range(3)])
        sub = meta(tuple(n), SLOT_OF) if all(n) else None
        if sub is not None:
            in_place({k: (v[rows] if v.shape[0] == sum(LENS) else v) for k, v in x.items()},
                     sub, want)
            assert torch.equal(got, want), cut
        else:
            assert torch.equal(got[[0, 3, 4]] if cut else got, x["pool"][[0, 3, 4]] if cut
                               else x["pool"])
    # the capsule is ONNX Runtime's: decay exp(g), the key as given, delta beta (v - r)
    g = -x["a_log"].exp() * torch.nn.functional.softplus(x["a"] + x["dt_bias"])
    for b, slot in enumerate(SLOT_OF):
        lo, hi = cu[b], cu[b + 1]
        torch.testing.assert_close(caps.decay[slot, :hi - lo], g[lo:hi].exp())
        assert torch.equal(caps.key[slot, :hi - lo], x["k"][lo:hi])


def test_capsule_matches_onnx_runtime_semantics() -> None:
    """The native capsule of one chunk against the op contract's ``state_update`` (ORT 1.32's
    layout and fields: decay | key | delta, capacity-strided), within float rounding (ORT's
    dot products are sequential sums, ours fused multiply-adds)."""
    x, m, caps = inputs(1), meta((4,), (2,)), capsule()
    t = 4
    CAPTURE.gated_delta(*(x[k][:t] for k in "qkvab"), x["a_log"], x["dt_bias"], x["pool"], m,
                        DK ** -0.5, caps)
    cu = torch.tensor([0, t], dtype=torch.int32)
    _, _, su = gated_delta_net(
        query=x["q"][:t], key=x["k"][:t], value=x["v"][:t], cu_seqlens=cu, decay=x["a"][:t],
        beta=x["b"][:t], initial_state=x["pool"][2:3], a_log=x["a_log"],
        dt_bias=x["dt_bias"], capture_count=torch.tensor([t], dtype=torch.int32),
        update_rule="gated_delta", gate_activation="qwen", beta_activation="sigmoid",
        scale=DK ** -0.5, state_update_capacity=CAP)
    row = su[0]
    decay = row[:CAP * HV].view(CAP, HV)
    key = row[CAP * HV:CAP * (HV + HK * DK)].view(CAP, HK, DK)
    delta = row[CAP * (HV + HK * DK):].view(CAP, HV, DV)
    torch.testing.assert_close(caps.decay[2, :t], decay[:t], rtol=1e-6, atol=1e-7)
    assert torch.equal(caps.key[2, :t], key[:t])
    torch.testing.assert_close(caps.delta[2, :t], delta[:t], rtol=1e-5, atol=1e-6)


def test_torch_capture_and_replay() -> None:
    """The torch bundle's forms: outputs close to the native kernel's, the rows untouched, and
    replay of the whole chunk equal to its own recurrence (its rounding)."""
    x, m = inputs(2), meta()
    caps_t, caps_n = capsule(), capsule()
    pool = x["pool"].clone()
    args = (x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"])
    out_t = torch_capture(*args, pool, m, DK ** -0.5, caps_t)
    out_n = CAPTURE.gated_delta(*args, pool, m, DK ** -0.5, caps_n)
    assert torch.equal(pool, x["pool"])
    torch.testing.assert_close(out_t, out_n, rtol=1e-5, atol=1e-5)
    lo, hi = torch.zeros(3, dtype=torch.int32), torch.tensor(LENS, dtype=torch.int32)
    a, b = x["pool"].clone(), x["pool"].clone()
    torch_replay(a, m.state_slots, caps_t, lo, hi)
    CAPTURE.replay(b, m.state_slots, caps_n, lo, hi)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_conv_replay_and_segments() -> None:
    caps = capsule()
    c = caps.conv.shape[-1]
    pool = torch.randn(SLOTS, c, 3)
    caps.conv.copy_(torch.randn(caps.conv.shape))
    slots = torch.tensor([1, 4])
    got = pool.clone()
    # two rounds (a checkpoint cut after 2 tokens of the first chunk) == one round
    replay_conv(got, caps, slots, conv_replay_index(3, torch.tensor([0, 0], dtype=torch.int32),
                                                    torch.tensor([2, 5], dtype=torch.int32)))
    replay_conv(got, caps, slots[:1], conv_replay_index(3, torch.tensor([2], dtype=torch.int32),
                                                        torch.tensor([4], dtype=torch.int32)))
    for s, n in ((1, 4), (4, 5)):
        ext = torch.cat([pool[s], caps.conv[s, :n].t()], 1)
        assert torch.equal(got[s], ext[:, -3:])
    assert segments([4, 3], [[(2, 9)], []]) == [([0, 0], [2, 3], [(0, 9)]),
                                                ([2, 3], [4, 3], [])]


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
def test_one_call_commit_equals_the_per_layer_replays(conv_dtype: torch.dtype) -> None:
    """The native bundle's ``commit`` (``commit_replay``: every layer in one call) leaves each
    layer's conv and recurrent rows bit for bit where the per-layer replays leave them, over
    two rounds (a checkpoint cut) and a sequence with nothing accepted; other rows untouched."""
    g = torch.Generator().manual_seed(5)
    layers = 3
    caps = [capsule() for _ in range(layers)]
    for c in caps:
        for t in c:
            t.copy_(torch.randn(t.shape, generator=g))
    caps = [c._replace(conv=c.conv.to(conv_dtype)) for c in caps]
    convs = [torch.randn(SLOTS, caps[0].conv.shape[-1], 3, generator=g).to(conv_dtype)
             for _ in range(layers)]
    pools = [torch.randn(SLOTS, HV, DV, DK, generator=g) * 0.3 for _ in range(layers)]
    slots = torch.tensor([3, 0, 4])
    rounds = [((0, 0, 0), (2, 0, 5)), ((2, 0, 5), (4, 0, 6))]
    want_c, want_p = [c.clone() for c in convs], [p.clone() for p in pools]
    got_c, got_p = [c.clone() for c in convs], [p.clone() for p in pools]
    per_layer = CAPTURE._replace(replay_layers=None)
    for lo, hi in rounds:
        b0, b1 = (torch.tensor(v, dtype=torch.int32) for v in (lo, hi))
        per_layer.commit(want_c, want_p, caps, slots, b0, b1)
        CAPTURE.commit(got_c, got_p, caps, slots, b0, b1)
    for i in range(layers):
        assert torch.equal(got_c[i], want_c[i]) and torch.equal(got_p[i], want_p[i])
        assert not torch.equal(got_c[i][3], convs[i][3])  # it moved
        assert torch.equal(got_c[i][0], convs[i][0]) and torch.equal(got_p[i][0], pools[i][0])
        assert torch.equal(got_p[i][1], pools[i][1])  # not a slot of the commit
    bad = [p.clone() for p in pools]
    with pytest.raises(ValueError, match="begin/end"):
        CAPTURE.commit(got_c, bad, caps, slots, torch.tensor([0, 0, 5], dtype=torch.int32),
                       torch.tensor([2, 0, CAP + 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="conv_capsules"):
        CAPTURE.commit(got_c, bad, [c._replace(conv=c.conv[:, :2]) for c in caps], slots,
                       torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="pools"):
        library().commit_replay(got_c[:2], [c.conv for c in caps], bad,
                                [c.decay for c in caps], [c.key for c in caps],
                                [c.delta for c in caps], slots,
                                torch.zeros(3, dtype=torch.int32),
                                torch.ones(3, dtype=torch.int32))
    assert all(torch.equal(b, p) for b, p in zip(bad, pools, strict=True))  # refused: unchanged


def test_bad_calls_are_refused_by_name() -> None:
    x, caps = inputs(), capsule()
    long_ = meta((CAP + 1, 2), (0, 1))
    t = CAP + 3
    with pytest.raises(ValueError, match="capacity"):
        CAPTURE.gated_delta(*(x[k][:t] for k in "qkvab"), x["a_log"], x["dt_bias"],
                            x["pool"], long_, DK ** -0.5, caps)
    with pytest.raises(ValueError, match="begin/end"):
        CAPTURE.replay(x["pool"], torch.tensor([0]), caps, torch.tensor([3], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        CAPTURE.replay(x["pool"], torch.tensor([1, 1]), caps,
                       torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    from pagedhybrid.errors import ContractViolation
    for lens, past in (((1, 3), (4, 4)), ((3, 3), (0, 4))):  # a one-token or a fresh sequence
        with pytest.raises(ContractViolation, match="verify"):
            StepMetadata.build(lens, past, None, (0, 1), block_size=1, num_pages=0,
                               num_slots=SLOTS, verify=(0,))


def test_capsules_cost_a_fraction_of_full_state_copies() -> None:
    """Qwen3.5-0.8B's linear layers, bf16, k = 3 drafts (4 tokens a chunk): the capsules of a
    slot against per-token copies of its recurrent states."""
    cfg = Qwen35Config.from_dict({
        "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24,
        "linear_num_value_heads": 16,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "full_attention_interval": 4, "vocab_size": 1000, "intermediate_size": 3584,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256})
    ours, theirs = capsule_bytes(cfg, 4, torch.bfloat16), full_state_bytes(cfg, 4)
    assert ours == 18 * 4 * (6144 * 2 + 4 * (16 + 16 * 128 + 16 * 128))
    assert theirs == 18 * 4 * 16 * 128 * 128 * 4
    assert theirs / ours > 35
    _ = backend("native").capture  # the bundle declares its capture kernels
    assert backend("native").capability.state_capture
