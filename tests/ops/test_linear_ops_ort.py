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
    for name, a, b in zip(("output", "final_state"), ours, theirs, strict=True):
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
