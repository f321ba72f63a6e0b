"""The GatedDeltaNet / VarlenCausalConvWithState references against ONNX Runtime 1.32's CPU kernels.

Every conformance recipe runs through the real ORT kernel (one-node model, CPU EP) in each dtype
the kernel takes, and must agree with the torch reference on ``output`` and ``final_state``:
max abs error <= 1e-5 in float32 and <= 2e-3 in float16.
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
    compare(gdn_mod.gated_delta_net(*ins, **attrs), ort_gdn.gated_delta_net(*ins, **attrs),
            dtype)


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


def test_gated_delta_net_l2_norm_eps_matches_ort() -> None:
    """Tiny q/k norms expose the eps inside rsqrt(sum x^2 + eps) (ORT: 1e-12)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 1, 8, generator=gen) * torch.tensor([1e-7, 1e-6, 1e-5, 1.0])[:, None, None]
    k = torch.randn(4, 1, 8, generator=gen) * torch.tensor([1.0, 1e-6, 3e-7, 1e-5])[:, None, None]
    v = torch.randn(4, 2, 4, generator=gen)
    ins = [q, k, v, torch.tensor([0, 4], dtype=torch.int32)]
    attrs = {"update_rule": "linear", "qk_l2_norm": 1}
    compare(gdn_mod.gated_delta_net(*ins, **attrs), ort_gdn.gated_delta_net(*ins, **attrs),
            torch.float32)


def test_ort_also_rejects_what_the_contract_rejects() -> None:
    """A few malformed calls: ORT's kernel refuses them too (the contract is not stricter)."""
    recipe = next(r for r in gdn_mod.conformance_recipes() if r["name"] == "prefill_unequal_gqa2")
    ins, attrs = gdn_mod.make_inputs(recipe, torch.float32, seed=4)
    bad = [
        (6, ins[6].transpose(-1, -2).contiguous()),  # K-major state
        (3, torch.tensor([0, 5, 3, 20, 32], dtype=torch.int32)),  # non-monotonic cu_seqlens
        (4, None),  # gated_delta without decay
    ]
    for index, value in bad:
        broken = list(ins)
        broken[index] = value
        with pytest.raises(ContractViolation):
            gdn_mod.gated_delta_net(*broken, **attrs)
        with pytest.raises(Exception, match=r"GatedDeltaNet|gated_delta_net"):
            ort_gdn.gated_delta_net(*broken, **attrs)
