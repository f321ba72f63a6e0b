"""Tensor parallelism for the Qwen3.5 model: a per-rank shard of a loaded model.

``tensor_parallel_qwen35(model, sharding=..., process_group=...)`` returns a new
``Qwen35ForCausalLM`` holding rank ``tp_rank``'s slice of every weight; the model's own code runs
unchanged on the local head counts (its config is the local one), and the three row-parallel
projections sum their partial outputs across the TP group:

* full attention (heads owned as ``ShardingSpec`` says: contiguous query heads
  ``[local_q_head_start, +local_q_heads)`` and KV heads ``[local_kv_head_start, +local_kv_heads)``,
  which keeps the GQA mapping ``kv = q // (H / Hkv)``): ``q_proj`` (per head ``query | gate``
  rows), ``k_proj``, ``v_proj`` column-parallel; ``o_proj`` row-parallel + ``all_reduce``;
* Gated DeltaNet (contiguous key heads ``Hk / TP`` and value heads ``Hv / TP``, keeping
  ``hv // (Hv / Hk)``): ``in_proj_qkv`` rows ``[q | k | v]`` of the local heads, the depthwise
  ``conv1d`` channels alike, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias``
  per local value head; ``out_proj`` row-parallel + ``all_reduce``;
* MLP: ``gate_proj`` / ``up_proj`` rows ``[r * I / TP, +I / TP)``; ``down_proj`` row-parallel +
  ``all_reduce``;
* embeddings, norms (per-head-dim weights) and ``lm_head`` are replicated.

Each rank keeps its own ``PagedHybridCache`` allocated with ``local_config`` (local KV heads,
local conv channels and recurrent heads). The ``all_reduce`` is a float sum (TP logits match TP=1
within rounding, not bitwise); every rank receives the same sum, so replicated activations stay
identical across ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pagedhybrid.attention.contract import ShardingSpec
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.models.qwen35.layers import Matmul, project

OP = "pagedhybrid.parallel.tensor_parallel_qwen35"


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T)`` over the TP group (weight name kept: ``weight``;
    the product is the kernel bundle's, as for every ``Linear``). With two ranks the sum is
    ``a + b`` element-wise, the same bits on both ranks and for any batch."""

    matmul: Matmul | None = None

    def __init__(self, weight: torch.Tensor, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = project(self, x)  # [T, out] partial sum of this rank's input slice
        if self.group is not False:
            dist.all_reduce(y, group=self.group)
        return y


def attention_sharding(config: Any, tp_rank: int, tp_world_size: int) -> ShardingSpec:
    """The full-attention head ownership of a TP rank (CP = 1; sequence fields unused: 1 token)."""
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    if h % tp_world_size or hkv % tp_world_size:
        raise UnsupportedConfiguration(
            f"TP={tp_world_size} must divide num_attention_heads={h} and "
            f"num_key_value_heads={hkv}")
    return ShardingSpec(
        tp_rank=tp_rank, tp_world_size=tp_world_size, cp_rank=0, cp_world_size=1,
        global_q_heads=h, global_kv_heads=hkv, local_q_head_start=tp_rank * h // tp_world_size,
        local_q_heads=h // tp_world_size, local_kv_head_start=tp_rank * hkv // tp_world_size,
        local_kv_heads=hkv // tp_world_size, global_sequence_length=1, local_sequence_length=1,
        global_block_indices=(0,), global_block_token_starts=(0,), local_block_offsets=(0, 1))


def local_config(config: Any, tp_world_size: int) -> Any:
    """The per-rank config: every sharded head / channel count divided by ``tp_world_size``."""
    fields = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
              "linear_num_value_heads", "intermediate_size")
    for f in fields:
        if getattr(config, f) % tp_world_size:
            raise UnsupportedConfiguration(
                f"TP={tp_world_size} must divide {f}={getattr(config, f)} (whole heads / "
                "channels per rank)")
    return dataclasses.replace(config, **{f: getattr(config, f) // tp_world_size for f in fields})


def _rows(w: torch.Tensor, groups: int, start: int, count: int) -> torch.Tensor:
    """Rows of ``count`` contiguous groups (heads) from ``start``; ``w`` is ``[groups*g, ...]``."""
    per = w.shape[0] // groups
    return w[start * per:(start + count) * per]


def _cols(w: torch.Tensor, groups: int, start: int, count: int) -> torch.Tensor:
    per = w.shape[1] // groups
    return w[:, start * per:(start + count) * per]


def shard_state_dict(state: dict[str, torch.Tensor], config: Any, sharding: ShardingSpec
                     ) -> dict[str, torch.Tensor]:
    """Rank ``sharding.tp_rank``'s slice of a full Qwen3.5 state dict (HF names)."""
    tp, r = sharding.tp_world_size, sharding.tp_rank
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    qs, qn = sharding.local_q_head_start, sharding.local_q_heads
    ks, kn = sharding.local_kv_head_start, sharding.local_kv_heads
    lk, lv = hk // tp, hv // tp
    local_config(config, tp)  # divisibility of every sharded count
    key_dim, value_dim = config.key_dim, config.value_dim
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] if "." in name else name
        if ".self_attn." in name and leaf == "q_proj.weight":
            w = _rows(w, h, qs, qn)  # per head [query | gate]
        elif ".self_attn." in name and leaf in ("k_proj.weight", "v_proj.weight"):
            w = _rows(w, hkv, ks, kn)
        elif ".self_attn." in name and leaf == "o_proj.weight":
            w = _cols(w, h, qs, qn)
        elif ".linear_attn." in name and leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            q, k, v = torch.split(w, [key_dim, key_dim, value_dim], dim=0)
            w = torch.cat([_rows(q, hk, r * lk, lk), _rows(k, hk, r * lk, lk),
                           _rows(v, hv, r * lv, lv)])
        elif ".linear_attn." in name and (
                leaf in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight")
                or name.endswith((".A_log", ".dt_bias"))):
            w = _rows(w, hv, r * lv, lv)  # per value head
        elif ".linear_attn." in name and leaf == "out_proj.weight":
            w = _cols(w, hv, r * lv, lv)
        elif ".mlp." in name and leaf in ("gate_proj.weight", "up_proj.weight"):
            w = _rows(w, tp, r, 1)
        elif ".mlp." in name and leaf == "down_proj.weight":
            w = _cols(w, tp, r, 1)
        out[name] = w.contiguous().clone()
    return out


def tensor_parallel_qwen35(model: Any, *, sharding: ShardingSpec,
                           process_group: Any = None) -> Any:
    """Rank ``sharding.tp_rank``'s TP shard of a loaded ``Qwen35ForCausalLM`` (module docstring).

    ``process_group`` is the TP group (default: the world group); with ``tp_world_size == 1``
    no collective is launched.
    """
    from pagedhybrid.models.qwen35.model import build

    cfg = model.config
    if not isinstance(sharding, ShardingSpec):
        raise ContractViolation(OP, "sharding", "must be a ShardingSpec",
                                type(sharding).__name__)
    want = attention_sharding(cfg, sharding.tp_rank, sharding.tp_world_size)
    for f in ("global_q_heads", "global_kv_heads", "local_q_head_start", "local_q_heads",
              "local_kv_head_start", "local_kv_heads"):
        if getattr(sharding, f) != getattr(want, f):
            raise ContractViolation(OP, f"sharding.{f}",
                                    f"must match the model's heads ({getattr(want, f)})",
                                    getattr(sharding, f))
    tp = sharding.tp_world_size
    group: Any = False
    if tp > 1:
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedConfiguration(
                f"TP={tp} needs an initialised torch.distributed process group")
        group = process_group if process_group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (tp, sharding.tp_rank):
            raise ContractViolation(OP, "process_group",
                                    f"must have tp_world_size = {tp} ranks with this rank at "
                                    f"tp_rank = {sharding.tp_rank}", f"size {size}, rank {rank}")
    local = build(local_config(cfg, tp), model.dtype, "cpu", model._backend)
    local.load_weights(shard_state_dict(model.state_dict(), cfg, sharding))
    for layer in local.model.layers:
        mixer = layer.self_attn if layer.is_full else layer.linear_attn
        proj = "o_proj" if layer.is_full else "out_proj"
        setattr(mixer, proj, RowParallelLinear(getattr(mixer, proj).weight, group))
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight, group)
    if local._backend is not None:
        local.backend = local._backend  # the row-parallel projections take its product too
    return local.eval()
