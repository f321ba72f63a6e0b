"""The GatedDeltaNet / VarlenCausalConvWithState references against ONNX Runtime 1.32's CPU kernels.

Every conformance recipe runs through the real ORT kernel (one-node model, CPU EP) in each dtype
the kernel takes, and must agree with the torch reference on ``output``, ``final_state`` and
(capturing recipes) ``state_update``: max abs error <= 1e-5 in float32 and <= 2e-3 in float16;
GatedDeltaNet's reference follows ORT's float32 arithmetic, so it agrees bit for bit. Compact
state updates are replayed for every accepted prefix and must equal the state of a call on that
prefix alone, bit for bit.
"""

from __future__ import annotations

import importlib
from typing import Any

import onnxruntime
import pytest
import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.onnxruntime import gated_delta_net as ort_gdn
from pagedhybrid.kernels.onnxruntime import varlen_causal_conv as ort_conv
from pagedhybrid.kernels.onnxruntime.session import run_single_node

gdn_mod = importlib.import_module("pagedhybrid.ops.gated_delta_net")
conv_mod = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def test_onnxruntime_version() -> None:
    assert onnxruntime.__version__.startswith("1.32"), onnxruntime.__version__
    assert ort_gdn.EP == ort_conv.EP == "cpu"


def compare(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...],
            dtype: torch.dtype) -> list[float]:
    errors = []
    names = ("output", "final_state", "state_update")[:len(theirs)]
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert err <= TOL[dtype], (name, err)
        errors.append(err)
    return errors


def cases(mod: Any, dtypes: tuple[torch.dtype, ...]) -> list[Any]:
    return [pytest.param(r, dt, id=f"{r['name']}-{str(dt).removeprefix('torch.')}")
            for r in mod.conformance_recipes() for dt in dtypes]


@pytest.mark.parametrize(("recipe", "dtype"), cases(gdn_mod, ort_gdn.DTYPES))
def test_gated_delta_net_matches_ort_cpu(recipe: dict, dtype: torch.dtype) -> None:
    ins, attrs = gdn_mod.make_inputs(recipe, dtype, seed=1)
    ours = gdn_mod.gated_delta_net(*ins, **attrs)
    theirs = ort_gdn.gated_delta_net(*ins, **attrs)
    compare(ours, theirs, dtype)
    assert len(theirs) == (3 if attrs.get("state_update_capacity") else 2)
    for name, a, b in zip(("output", "final_state", "state_update"), ours, theirs, strict=False):
        assert torch.equal(a, b), name  # libm gates, sums in order, no FMA: ORT's bits


@pytest.mark.parametrize(("recipe", "dtype"), cases(conv_mod, ort_conv.DTYPES))
def test_varlen_causal_conv_matches_ort_cpu(recipe: dict, dtype: torch.dtype) -> None:
    ins, attrs = conv_mod.make_inputs(recipe, dtype, seed=1)
    ours = conv_mod.varlen_causal_conv(*ins, **attrs)
    theirs = ort_conv.varlen_causal_conv(*ins, **attrs)
    compare(ours, theirs, dtype)
    assert torch.equal(ours[1], theirs[1])  # the conv state holds raw samples: exact
    if attrs.get("state_update_capacity"):  # so does the capture: input rows, zeros after
        assert len(theirs) == 3 and torch.equal(ours[2], theirs[2])


CAPTURING = [r for r in conv_mod.conformance_recipes() if "capture" in r["dims"]]


@pytest.mark.parametrize("recipe", CAPTURING, ids=[r["name"] for r in CAPTURING])
def test_conv_replay_of_every_accepted_prefix_is_the_prefix_only_state(recipe: dict) -> None:
    """For every split of every sequence's captured tokens (j_b in [0, n_b]), ``replay_state``
    from the call's initial state and ``state_update`` equals, bit for bit, the final state of
    a call on only the first j_b tokens -- ours and ORT's."""
    ins, attrs = conv_mod.make_inputs(recipe, torch.float32, seed=6)
    x, w, cu, bias, state, capture = ins[:6]
    _, _, captured = conv_mod.varlen_causal_conv(*ins, **attrs)
    lens = (cu[1:] - cu[:-1]).tolist()
    counts = [max(0, min(int(n), attrs["state_update_capacity"], m))
              for n, m in zip(capture.tolist(), lens, strict=True)]
    plain = {k: v for k, v in attrs.items() if k != "state_update_capacity"}
    splits = {tuple(min(j, n) for n in counts) for j in range(max(counts) + 1)}
    splits |= {tuple(n if i == b else 0 for i, n in enumerate(counts)) for b in range(len(lens))}
    for accepted in sorted(splits):
        got = conv_mod.replay_state(state, captured, accepted, counts)
        keep = [b for b, j in enumerate(accepted) if j > 0]  # a call needs >= 1 token a sequence
        for b, j in enumerate(accepted):
            if j == 0:
                assert torch.equal(got[b], state[b])
        if not keep:
            continue
        rows = torch.cat([x[int(cu[b]):int(cu[b]) + accepted[b]] for b in keep])
        pcu = torch.tensor([0, *torch.tensor([accepted[b] for b in keep]).cumsum(0).tolist()],
                           dtype=torch.int32)
        prefix = [rows, w, pcu, bias, state[keep].contiguous()]
        for run in (conv_mod.varlen_causal_conv, ort_conv.varlen_causal_conv):
            want = run(*prefix, **plain)[1]
            assert torch.equal(got[keep], want), (recipe["name"], accepted, run.__module__)


@pytest.mark.parametrize("recipe", CAPTURING, ids=[r["name"] for r in CAPTURING])
def test_every_conv_implementation_captures_the_same_rows(recipe: dict) -> None:
    """The torch, native and ONNX Runtime implementations return the reference's
    ``state_update`` (decode-shaped calls take the native kernel's path too)."""
    importlib.import_module("pagedhybrid.kernels.cpu.varlen_causal_conv")
    importlib.import_module("pagedhybrid.kernels.native.contract")
    impls = conv_mod.SPEC.implementations()
    assert {"reference", "torch", "native", "onnxruntime"} <= set(impls)
    for lens in (recipe["dims"]["seq_lens"], [1] * len(recipe["dims"]["seq_lens"])):
        r = {**recipe, "dims": {**recipe["dims"], "seq_lens": lens}}
        ins, attrs = conv_mod.make_inputs(r, torch.float32, seed=8)
        want = conv_mod.varlen_causal_conv(*ins, **attrs)
        for name, impl in impls.items():
            got = impl.entry(*[None if t is None else t.clone() for t in ins], **attrs)
            assert len(got) == 3 and torch.equal(got[2], want[2]), (name, lens)
            assert torch.equal(got[1], want[1]), (name, lens)


def test_conv_replay_refuses_what_was_not_captured() -> None:
    recipe = CAPTURING[0]
    ins, attrs = conv_mod.make_inputs(recipe, torch.float32, seed=7)
    _, _, captured = conv_mod.varlen_causal_conv(*ins, **attrs)
    state, b = ins[4], ins[4].shape[0]
    with pytest.raises(ContractViolation, match="accepted"):
        conv_mod.replay_state(state, captured, [1] * b, [1] * (b - 1) + [0])
    with pytest.raises(ContractViolation, match="accepted"):
        conv_mod.replay_state(state, captured, [1] * (b - 1))
    with pytest.raises(ContractViolation, match="state_update"):
        conv_mod.replay_state(state, captured[:, :, :-1], [0] * b)


GDN_CAPTURING = [r for r in gdn_mod.conformance_recipes() if "capture" in r["dims"]]


def gdn_splits(counts: list[int]) -> set[tuple[int, ...]]:
    """Every sequence cut at each common length, and each sequence alone taken whole."""
    splits = {tuple(min(j, n) for n in counts) for j in range(max(counts) + 1)}
    return splits | {tuple(n if i == b else 0 for i, n in enumerate(counts))
                     for b in range(len(counts))}


def gdn_prefix_call(ins: list, attrs: dict, accepted: tuple[int, ...]) -> tuple[list, dict]:
    """The call on only the first ``accepted[b]`` tokens of each sequence ([T, ...] layouts;
    zero-length sequences pass their state through)."""
    cu = ins[3].tolist()
    rows = torch.cat([torch.arange(cu[b], cu[b] + j) for b, j in enumerate(accepted)])
    pick = [None if t is None else t[rows] for t in (*ins[:3], None, *ins[4:6])]
    pick[3] = torch.tensor([0, *torch.tensor(accepted).cumsum(0).tolist()], dtype=torch.int32)
    plain = {k: v for k, v in attrs.items() if k != "state_update_capacity"}
    return [*pick, *ins[6:9], None, None], plain


@pytest.mark.parametrize("recipe", GDN_CAPTURING, ids=[r["name"] for r in GDN_CAPTURING])
def test_gdn_replay_of_every_accepted_prefix_is_the_prefix_only_state(recipe: dict) -> None:
    """For every split of every sequence's captured tokens (j_b in [0, n_b]), ``replay_state``
    from the call's initial state and its ``state_update`` (ours, and ORT's) equals, bit for
    bit, the final state of a call on only the first j_b tokens -- ours and ORT's."""
    ins, attrs = gdn_mod.make_inputs(recipe, torch.float32, seed=6)
    d = gdn_mod.validate(*ins, **attrs)
    state = ins[6]
    geometry = {"num_heads_k": d.num_heads_qk, "capacity": d.capacity,
                "per_key_decay": d.per_key_decay}
    captures = [run(*ins, **attrs)[2] for run in (gdn_mod.gated_delta_net,
                                                  ort_gdn.gated_delta_net)]
    assert torch.equal(captures[0], captures[1])
    counts = list(d.captured)  # n_b (all 0 when switched off or asked for none)
    assert any(counts) or recipe["name"] in ("capture_inactive", "capture_none_capacity8")
    for accepted in sorted(gdn_splits(counts)):
        got = [gdn_mod.replay_state(state, c, accepted, counts, **geometry) for c in captures]
        if not any(accepted):
            assert all(torch.equal(g, state) for g in got)
            continue
        prefix, plain = gdn_prefix_call(ins, attrs, accepted)
        for run in (gdn_mod.gated_delta_net, ort_gdn.gated_delta_net):
            want = run(*prefix, **plain)[1]
            for g in got:
                assert torch.equal(g, want), (recipe["name"], accepted, run.__module__)


@pytest.mark.parametrize("recipe", GDN_CAPTURING, ids=[r["name"] for r in GDN_CAPTURING])
def test_every_gdn_implementation_captures_the_same_state_update(recipe: dict) -> None:
    """The torch, native and ONNX Runtime implementations return the reference's
    ``state_update`` bit for bit, on the recipe and on its decode shape (one token a sequence:
    the native kernel's own path for the model's form)."""
    importlib.import_module("pagedhybrid.kernels.cpu.gated_delta_net")
    native = importlib.import_module("pagedhybrid.kernels.native.contract")
    impls = gdn_mod.SPEC.implementations()
    assert {"reference", "torch", "native", "onnxruntime"} <= set(impls)
    for lens in (recipe["dims"]["seq_lens"], [1] * len(recipe["dims"]["seq_lens"])):
        r = {**recipe, "dims": {**recipe["dims"], "seq_lens": lens}}
        ins, attrs = gdn_mod.make_inputs(r, torch.float32, seed=8)
        want = gdn_mod.gated_delta_net(*ins, **attrs)
        for name, impl in impls.items():
            got = impl.entry(*[None if t is None else t.clone() for t in ins], **attrs)
            assert len(got) == 3 and torch.equal(got[2], want[2]), (name, lens)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
            if name == "native" and recipe["name"] == "capture_verify_step_gqa":
                assert native.last_path("gated_delta_net") == (
                    "native" if lens == [1] * len(lens) else "torch"), lens


@pytest.mark.parametrize("gate", ["none", "softplus", "kda"])
def test_gdn_gates_are_ort_bits_on_many_values(gate: str) -> None:
    """4000 one-token sequences (Dk = Dv = 1, k = v = 1, zero state) capture decay exp(g) and
    delta = beta directly: the gates computed with libm's expf / log1pf and ORT's sigmoid equal
    ORT's bit for bit over a wide range (torch's vectorised exp differs in ~1% of them)."""
    n = 4000
    gen = torch.Generator().manual_seed(11)
    ones = torch.ones(n, 1, 1)
    fused = gate != "none"
    decay = torch.randn(n, 1, generator=gen) * (6.0 if fused else 3.0)
    ins = [ones, ones, ones, torch.arange(n + 1, dtype=torch.int32), decay,
           torch.randn(n, 1, generator=gen) * 6, torch.zeros(n, 1, 1, 1),
           torch.tensor([0.3]) if fused else None, torch.tensor([0.2]) if fused else None,
           torch.ones(n, dtype=torch.int32)]
    attrs = {"gate_activation": gate, "beta_activation": "sigmoid", "state_update_capacity": 1}
    ours, theirs = gdn_mod.gated_delta_net(*ins, **attrs), ort_gdn.gated_delta_net(*ins, **attrs)
    for name, a, b in zip(("output", "final_state", "state_update"), ours, theirs, strict=True):
        assert torch.equal(a, b), (name, int((a != b).sum()))


def test_gdn_replay_refuses_bad_input() -> None:
    ins, attrs = gdn_mod.make_inputs(GDN_CAPTURING[0], torch.float32, seed=7)
    d = gdn_mod.validate(*ins, **attrs)
    captured = gdn_mod.gated_delta_net(*ins, **attrs)[2]
    state, b = ins[6], d.batch
    geometry = {"num_heads_k": d.num_heads_qk, "capacity": d.capacity}
    bad = [  # (accepted, captured counts, state_update, state, geometry) -> port named
        (([1] * b, [1] * (b - 1) + [0], captured, state, geometry), "accepted"),
        (([d.capacity + 1] * b, None, captured, state, geometry), "accepted"),
        (([1] * (b - 1), None, captured, state, geometry), "accepted"),
        (([0] * b, None, captured[:, :-1], state, geometry), "state_update"),
        (([0] * b, None, captured, state, {**geometry, "per_key_decay": True}), "state_update"),
        (([0] * b, None, captured, state, {**geometry, "capacity": d.capacity - 1}),
         "state_update"),
        (([0] * b, None, captured, state, {**geometry, "num_heads_k": 3}), "num_heads_k"),
        (([0] * b, None, captured, state[0], geometry), "initial_state"),
    ]
    for (accepted, counts, update, s0, geo), where in bad:
        with pytest.raises(ContractViolation) as info:
            gdn_mod.replay_state(s0, update, accepted, counts, **geo)
        assert info.value.where == where and info.value.op.endswith("GatedDeltaNet.replay_state")


def test_conv_runner_substitutes_zero_state_for_none() -> None:
    recipe = next(r for r in conv_mod.conformance_recipes() if r["name"] == "k4_none_bias")
    ins, attrs = conv_mod.make_inputs(recipe, torch.float32, seed=2)
    ins[4] = None
    compare(conv_mod.varlen_causal_conv(*ins, **attrs),
            ort_conv.varlen_causal_conv(*ins, **attrs), torch.float32)


@pytest.mark.parametrize("name", ["qwen_config", "packed_qkv_varlen", "zero_length_sequences"])
def test_gated_delta_net_state_bound_in_place_is_identical(name: str) -> None:
    """initial_state and final_state bound as one OrtValue (IOBinding) == separate buffers."""
    recipe = next(r for r in gdn_mod.conformance_recipes() if r["name"] == name)
    ins, attrs = gdn_mod.make_inputs(recipe, torch.float32, seed=3)
    attrs = gdn_mod.SPEC.resolve_attributes(attrs)
    state0 = ins[6].clone()
    separate = run_single_node(gdn_mod.SPEC, ins, attrs, n_outputs=2, ep=ort_gdn.EP)
    assert torch.equal(ins[6], state0)
    # On CPU the bound OrtValue shares memory with the torch tensor: ORT writes the new state
    # straight into ins[6], as a serving runtime's state slot would be updated.
    aliased = run_single_node(gdn_mod.SPEC, ins, attrs, n_outputs=2, ep=ort_gdn.EP,
                              inplace={6: 1})
    assert torch.equal(separate[0], aliased[0])
    assert torch.equal(separate[1], aliased[1])
    assert not torch.equal(aliased[1], state0)  # the state did advance
    assert torch.equal(ins[6], aliased[1])  # ... in place
    ins[6] = state0
    compare(gdn_mod.gated_delta_net(*ins, **attrs), tuple(aliased), torch.float32)


@pytest.mark.parametrize("gate", ["none", "kda"])
def test_gated_delta_net_l2_norm_eps_matches_ort(gate: str) -> None:
    """Tiny q/k norms expose the eps inside rsqrt(sum x^2 + eps) (ORT: 1e-12, but 1e-6 with the
    sigmoid/kda gate)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 1, 8, generator=gen) * torch.tensor([1e-7, 1e-6, 1e-5, 1.0])[:, None, None]
    k = torch.randn(4, 1, 8, generator=gen) * torch.tensor([1.0, 1e-6, 3e-7, 1e-5])[:, None, None]
    v = torch.randn(4, 2, 4, generator=gen)
    ins = [q, k, v, torch.tensor([0, 4], dtype=torch.int32)]
    attrs = {"update_rule": "linear", "qk_l2_norm": 1}
    if gate != "none":
        ins += [torch.zeros(4, 2), None, None, torch.zeros(2), torch.zeros(2)]
        attrs |= {"update_rule": "gated", "gate_activation": gate}
    ours, theirs = gdn_mod.gated_delta_net(*ins, **attrs), ort_gdn.gated_delta_net(*ins, **attrs)
    compare(ours, theirs, torch.float32)
    assert torch.equal(ours[0], theirs[0])


def test_ort_also_rejects_what_the_contract_rejects() -> None:
    """A few malformed calls: ORT's kernel refuses them too (the contract is not stricter)."""
    recipe = next(r for r in gdn_mod.conformance_recipes() if r["name"] == "prefill_unequal_gqa2")
    ins, attrs = gdn_mod.make_inputs(recipe, torch.float32, seed=4)
    count = torch.ones(4, dtype=torch.int32)
    bad = [
        (6, ins[6].transpose(-1, -2).contiguous(), {}),  # K-major state
        (3, torch.tensor([0, 5, 3, 20, 32], dtype=torch.int32), {}),  # non-monotonic cu_seqlens
        (4, None, {}),  # gated_delta without decay
        (9, None, {"state_update_capacity": 2}),  # capturing without capture_count
        (9, count, {}),  # capture_count without capturing
        (9, count[:3], {"state_update_capacity": 2}),  # capture_count not [B]
        (10, torch.ones(2, dtype=torch.int32), {}),  # state_update_active not [1]
    ]
    for index, value, extra in bad:
        broken = list(ins)
        broken[index] = value
        with pytest.raises(ContractViolation):
            gdn_mod.gated_delta_net(*broken, **attrs, **extra)
        with pytest.raises(Exception, match=r"GatedDeltaNet|gated_delta_net"):
            ort_gdn.gated_delta_net(*broken, **attrs, **extra)
