"""Small building blocks of the Qwen3.5 decoder (HF ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
``Qwen3_5MLP``, ``Qwen3_5MoeSparseMoeBlock``).

* ``OffsetRMSNorm``: ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back. HF stores
  ``w`` zero-initialised; a checkpoint's value is used as is and the ``1 +`` is applied here.
* ``GatedRMSNorm`` (Gated DeltaNet output norm over ``Dv`` per head):
  ``y = o * rsqrt(mean(o^2) + eps) * w * silu(z)`` with the **raw** weight ``w``, fp32 math.
* ``MLP``: ``down(silu(gate(x)) * up(x))``; under tensor parallelism ``gate`` / ``up`` are
  column-parallel (rows ``[r * I / W, +I / W)``) and ``down`` row-parallel (its partial sums
  all-reduced), so each rank computes ``I / W`` intermediate channels.
* ``SparseMoE`` (Qwen3.5-MoE's feed-forward, transformers 5.24's math): router logits
  ``gate(x)`` in the model dtype, softmax in fp32, top-k, the k weights renormalised to sum 1
  and cast back; each token's k experts ``down_e(silu(g) * u)`` with ``[g; u] = gate_up_e(x)``,
  weighted and summed; plus the shared expert (an ``MLP``) times ``sigmoid(shared_expert_gate
  (x))``. Experts are stored fused as transformers 5 holds them (``experts.gate_up_proj
  [E, 2I, H]``, ``experts.down_proj [E, H, I]``; per-expert checkpoints are fused on load,
  ``weights.fuse_experts``). Where the bundle has a fused MoE kernel (``kernels.moe``,
  ``Backend.modules.moe``: the native bundles' ``kernels/native/moe.py``) the routed experts and
  the shared expert run in it, one call per layer (the shared expert's module when its weights
  are quantised); otherwise (torch, reference) ``Experts`` groups the tokens by expert with
  one stable sort per layer, computes each expert's rows together and adds them back per token
  in expert order (HF's order).
* Projections are ``pagedhybrid.parallel.linear``'s (``ReplicatedLinear``,
  ``ColumnParallelLinear``, ``RowParallelLinear``): bias-free, the product is the kernel
  bundle's (``Backend.modules.linear_for``, given to each with the model's bundle; None =
  ``F.linear``); at TP world size 1 they are plain projections.
* SiLU and sigmoid are the kernel bundle's too (``kernels.pointwise``: every module here is a
  ``UsesKernels`` and holds its bundle's ``ModuleKernels``; torch's by default): the
  batch-invariant bundle's compute every element alike. So are the two norms' arithmetic
  (``kernels.norms``: torch's formulas above by default, one native call per norm in the native
  bundles).

Parameter names equal HF's so ``state_dict()`` keys are the checkpoint keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedhybrid.kernels.registry import UsesKernels
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    ReplicatedLinear,
    RowParallelLinear,
    Segment,
    shard_weight,
)


class OffsetRMSNorm(nn.Module, UsesKernels):

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.norms.rms(x, self.weight, self.eps, True)


class GatedRMSNorm(nn.Module, UsesKernels):

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        return k.norms.gated(x, gate, self.weight, self.eps, k.pointwise.silu)


class MLP(nn.Module, UsesKernels):

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        channels = Segment(intermediate, intermediate, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden, channels, dtype, parallel)
        self.up_proj = ColumnParallelLinear(hidden, channels, dtype, parallel)
        self.down_proj = RowParallelLinear(channels, hidden, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.pointwise.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module, UsesKernels):
    """The routed experts' weights, fused (``SparseMoE``). Under tensor parallelism each rank
    holds ``I / W`` of every expert's channels (its gate rows and up rows of ``gate_up_proj``,
    its columns of ``down_proj``) and the block's output is all-reduced, as ``MLP``'s."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 dtype: torch.dtype, parallel: ParallelConfig | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelConfig()
        channels = Segment(intermediate, intermediate, "moe_intermediate_size")
        local = parallel.local(intermediate, "moe_intermediate_size")
        self.num_experts = num_experts
        self.gate_up_proj = shard_weight(nn.Parameter(torch.empty(
            num_experts, 2 * local, hidden, dtype=dtype), requires_grad=False), 1,
            (channels, channels), parallel)
        self.down_proj = shard_weight(nn.Parameter(torch.empty(
            num_experts, hidden, local, dtype=dtype), requires_grad=False), 2, (channels,),
            parallel)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{index[t, j]}(x[t])`` for every token ``t``."""
        out = torch.zeros_like(x)
        flat = index.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        k = index.shape[1]
        tokens, slots = order // k, order % k
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            t, j = tokens[start:start + n], slots[start:start + n]
            start += n
            gate, up = F.linear(x[t], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.kernels.pointwise.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, t, (y * weights[t, j, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module, UsesKernels):
    """Qwen3.5-MoE's feed-forward block (module docstring)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 shared_intermediate: int, dtype: torch.dtype, parallel: ParallelConfig
                 ) -> None:
        super().__init__()
        self.top_k, self.parallel = top_k, parallel
        self.gate = ReplicatedLinear(hidden, num_experts, dtype)
        self.experts = Experts(num_experts, hidden, intermediate, dtype, parallel)
        self.shared_expert = MLP(hidden, shared_intermediate, dtype, parallel)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids ``[T, k]``, their renormalised weights ``[T, k]`` in x's dtype)."""
        return route(self.gate(x), self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        index, weights = self.route(x)
        moe = self.kernels.moe
        if moe is None:
            routed = self.experts(x, index, weights)
        else:
            s = self.shared_expert
            held = (s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight,
                    self.shared_expert_gate.weight)
            # the shared expert in the same call, unless its weights are quantised (its modules
            # run it)
            shared = None if any(w.is_meta for w in held) else held
            routed = moe(x, index, weights, self.experts.gate_up_proj,
                              self.experts.down_proj, shared)
            if shared is not None:  # routed and shared: the ranks' partial sums reduced once
                return self.parallel.all_reduce(routed).reshape(shape)
        routed = self.parallel.all_reduce(routed)  # the ranks' channels
        gate = self.kernels.pointwise.sigmoid(self.shared_expert_gate(x))
        shared_out = gate * self.shared_expert(x)
        return (routed + shared_out).reshape(shape)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its projection (transformers' ``Qwen3_5MoeTopKRouter``): softmax of
    ``logits [T, E]`` in fp32, the ``top_k`` largest, renormalised to sum 1 and cast to the
    logits' dtype -> (expert ids ``[T, k]``, weights ``[T, k]``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, index = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return index, top.to(logits.dtype)
