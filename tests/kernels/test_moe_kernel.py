"""The mixture-of-experts experts: the native kernel (``kernels/native/moe.py``,
``csrc/moe.cpp``) and the torch grouping (``layers.Experts``, the torch / reference bundles').

* the torch grouping equals a naive per-token, per-expert loop (float64) on the same routings;
* both kernel forms equal a naive per-token, per-expert loop (float64) on random routings, with most
  experts empty, with every token on one expert (the packed many-row path) and with the shared
  expert fused in; in bf16 both equal the torch grouping (transformers' roundings) closely;
* the invariant form is bitwise batch-invariant: a token's row is the same alone, among other
  tokens that picked the same experts, at any position, with any number of threads;
* bad calls raise ValueError naming the argument and the rule, before any work.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedhybrid.kernels.native import moe, status
from pagedhybrid.models.qwen35.layers import Experts

E, H, INTER, SHARED = 16, 48, 40, 24


@pytest.fixture(autouse=True)
def _native_kernels_built() -> None:
    assert status().available, status().reason


def weights(dtype: torch.dtype = torch.float32, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) / 6).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) / 5).to(dtype)
    shared = tuple((torch.randn(*s, generator=g) / 5).to(dtype)
                   for s in ((SHARED, H), (SHARED, H), (H, SHARED), (1, H)))
    return gate_up, down, shared


def routing(kind: str, tokens: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    elif kind == "one expert":
        index = torch.full((tokens, 1), 11)
    else:  # "few experts": most experts get no token
        index = torch.stack([torch.tensor([2, 9])[torch.randperm(2, generator=g)]
                             for _ in range(tokens)])
    w = torch.rand(index.shape, generator=g)
    return index, w / w.sum(-1, keepdim=True)


def naive(x, index, w, gate_up, down, shared=None) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += float(w[t, j]) * (down[e] @ (F.silu(g) * u))
        if shared is not None:
            gp, up, dp, sg = (s.double() for s in shared)
            out[t] += torch.sigmoid(sg @ x[t]) * (dp @ (F.silu(gp @ x[t]) * (up @ x[t])))
    return out


@pytest.mark.parametrize("kind,k", [("random", 4), ("one expert", 1), ("few experts", 2)])
def test_torch_grouping_equals_a_naive_loop(kind: str, k: int) -> None:
    gate_up, down, _ = weights()
    ex = Experts(E, H, INTER, torch.float32)
    with torch.no_grad():
        ex.gate_up_proj.copy_(gate_up)
        ex.down_proj.copy_(down)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(37))
    index, w = routing(kind, 37, k)
    got = ex(x, index, w)
    assert torch.allclose(got.double(), naive(x, index, w, gate_up, down), atol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("kind,tokens,k", [("random", 37, 4), ("random", 1, 4),
                                           ("random", 150, 8), ("one expert", 70, 1),
                                           ("few experts", 37, 2)])
def test_equals_a_naive_loop(kind: str, tokens: int, k: int, with_shared: bool,
                             invariant: bool) -> None:
    gate_up, down, shared = weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    index, w = routing(kind, tokens, k)
    sh = shared if with_shared else None
    got = moe.experts(x, index, w, gate_up, down, sh, invariant=invariant)
    want = naive(x, index, w, gate_up, down, sh)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5), \
        (got.double() - want).abs().max()


@pytest.mark.parametrize("invariant", [False, True])
def test_bf16_follows_the_torch_grouping(invariant: bool) -> None:
    """bf16 rounds where transformers' module rounds: within a few bf16 ulps of the torch
    grouping (``Experts``), which equals HF's module in its order of operations."""
    gate_up, down, _ = weights(torch.bfloat16)
    ex = Experts(E, H, INTER, torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_proj.copy_(gate_up)
        ex.down_proj.copy_(down)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    index, w = routing("random", 64, 4)
    w = w.bfloat16()
    got = moe.experts(x, index, w, gate_up, down, invariant=invariant)
    want = ex(x, index, w)
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 2e-2 * scale
    exact = naive(x, index, w, gate_up, down)
    # no worse than the torch grouping against the float64 truth (x2: rounding luck)
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6


def test_fp32_activations_with_bf16_weights() -> None:
    gate_up, down, shared = weights(torch.bfloat16)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    index, w = routing("random", 20, 4)
    got = moe.experts(x, index, w, gate_up, down, shared)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), naive(x, index, w, gate_up, down, shared), atol=2e-5)


def test_invariant_form_is_bitwise_batch_invariant() -> None:
    """Token 0's row alone equals its row among 1..200 other tokens that pick the same
    experts, wherever it sits, with one thread or two."""
    gate_up, down, shared = weights()
    g = torch.Generator().manual_seed(9)
    probe = torch.randn(1, H, generator=g)
    probe_index = torch.tensor([[3, 7, 11, 12]])
    probe_w = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    alone = moe.experts(probe, probe_index, probe_w, gate_up, down, shared, invariant=True)
    fast_differs = False
    threads = torch.get_num_threads()
    try:
        for n, at, nthreads in ((1, 0, 2), (7, 3, 2), (60, 59, 1), (200, 100, 2), (200, 0, 1)):
            torch.set_num_threads(nthreads)
            x = torch.randn(n + 1, H, generator=g)
            index = torch.stack([torch.tensor([3, 7, 11, 12])[torch.randperm(4, generator=g)]
                                 for _ in range(n + 1)])  # everyone on the probe's experts
            w = torch.rand(n + 1, 4, generator=g)
            x[at], index[at], w[at] = probe[0], probe_index[0], probe_w[0]
            got = moe.experts(x, index, w, gate_up, down, shared, invariant=True)
            assert torch.equal(got[at], alone[0]), (n, at, nthreads)
            fast = moe.experts(x, index, w, gate_up, down, shared)
            fast_differs |= not torch.equal(fast[at], alone[0])
    finally:
        torch.set_num_threads(threads)
    assert fast_differs  # the packed form's sums do depend on the batch: the test can tell


def test_bad_calls_name_the_argument() -> None:
    gate_up, down, shared = weights()
    x = torch.randn(4, H)
    index, w = routing("random", 4, 2)
    with pytest.raises(ValueError, match=r"moe_experts: index: index\[1, 0\] = 16 is outside"):
        bad = index.clone()
        bad[1, 0] = E
        moe.experts(x, bad, w, gate_up, down)
    with pytest.raises(ValueError, match=r"moe_experts: down: size\(1\) must equal the hidden"):
        moe.experts(x, index, w, gate_up, down[:, :-1].contiguous())
    with pytest.raises(ValueError, match=r"moe_experts: weights: size\(1\) must equal the top-k"):
        moe.experts(x, index, w[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="moe_experts: shared_down_proj"):
        moe.experts(x, index, w, gate_up, down, (shared[0], shared[1], shared[0], shared[3]))
    with pytest.raises(ValueError, match="moe_experts: gate_up: dtype must be x's"):
        moe.experts(x.bfloat16(), index, w, gate_up, down)
    with pytest.raises(ValueError, match=r"moe_experts: index: top-k .* must be in \[1, "):
        moe.experts(x, torch.zeros(4, 0, dtype=torch.long), w[:, :0], gate_up, down)
    out = moe.experts(x[:0], index[:0], w[:0], gate_up, down, shared)
    assert out.shape == (0, H)
