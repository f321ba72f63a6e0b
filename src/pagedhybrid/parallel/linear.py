"""Tensor-parallel layers: projections that hold one rank's slice and load it from the checkpoint.

A TP group of ``W`` ranks splits every sharded tensor by whole **heads** (groups of rows that
must stay together), contiguously: rank ``r`` owns heads ``[r * g / W, (r + 1) * g / W)`` of a
segment with ``g`` heads. A tensor may be the concatenation of several segments along the split
axis (a *merged* projection, e.g. Gated DeltaNet's ``in_proj_qkv`` rows ``[q | k | v]``); each
segment is split on its own and the rank's parts are concatenated in the same order.

A *shared* segment (GQA key/value heads, Gated DeltaNet key heads: heads that the partitioned
heads read) may have fewer heads than ranks: when ``W % g == 0`` every rank holds one head,
``r * g // W``, which is exactly the head its partitioned heads read (replicated KV). Any other
count that ``W`` does not divide is refused with ``UnsupportedConfiguration`` naming the config
field.

Layers (bias-free, weight ``[out, in]`` named ``weight`` so state-dict keys are the checkpoint's;
the product is the kernel bundle's ``matmul``, ``F.linear`` when None):

* ``ReplicatedLinear`` -- every rank holds the whole weight (``lm_head``);
* ``ColumnParallelLinear`` -- output rows split (``q_proj``, ``k_proj``, ``v_proj`` by heads --
  the QKV-parallel case, GQA-aware -- MLP ``gate_proj`` / ``up_proj``, and merged segments such
  as ``in_proj_qkv``); the output stays local (no collective);
* ``RowParallelLinear`` -- input columns split; ``y = all_reduce(x_local @ W_local^T)`` over the
  TP group (a float sum: every rank receives the same bits), no collective at ``W == 1``.

Each sharded parameter carries ``weight_loader(param, loaded_weight) -> Tensor`` (a
``ShardedWeight``): the rank's slice of the **full** checkpoint tensor, in the parameter's dtype.
A contiguous slice along dim 0 stays a view (zero copy, e.g. of a memory-mapped file); at
``W == 1`` the loader returns the tensor itself, so a world-size-1 model is the plain model.
Parameters without a loader are replicated (``replicated_weight_loader``); ``shard_weight`` gives
any other parameter (a depthwise conv, per-head vectors) a loader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.registry import ModuleKernels, UsesKernels
from pagedhybrid.weightquant import (
    QuantizedWeight,
    WeightFormat,
    group_rows,
    quantize,
    reference_linear,
)

OP = "pagedhybrid.parallel.RowParallelLinear"
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
QMatmul = Callable[[torch.Tensor, QuantizedWeight], torch.Tensor]


class Segment(NamedTuple):
    """A run of ``size`` rows (or columns) made of ``heads`` equal groups, counted by the config
    field ``field``; ``shared`` heads may be replicated when there are fewer than ranks."""

    size: int
    heads: int
    field: str
    shared: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in its TP group; ``process_group`` None = the world group;
    ``communicator`` (e.g. ``shm.ShmAllReduce`` for ranks on one machine) does the all-reduces
    instead of torch.distributed when given."""

    tp_rank: int = 0
    tp_world_size: int = 1
    process_group: Any = field(default=None, compare=False, repr=False)
    communicator: Any = field(default=None, compare=False, repr=False)
    _checked: Any = field(default=None, init=False, compare=False, repr=False)  # group()

    def __post_init__(self) -> None:
        if self.tp_world_size < 1 or not 0 <= self.tp_rank < self.tp_world_size:
            raise ContractViolation("pagedhybrid.parallel.ParallelConfig", "tp_rank",
                                    f"must be in [0, tp_world_size={self.tp_world_size})",
                                    self.tp_rank)

    def owned(self, heads: int, field: str, shared: bool = False) -> tuple[int, int]:
        """(first head, head count) of this rank among ``heads`` (module docstring rule)."""
        w = self.tp_world_size
        if heads % w == 0:
            return self.tp_rank * heads // w, heads // w
        if shared and w % heads == 0:
            return self.tp_rank * heads // w, 1  # replicated: the head the rank's queries read
        also = " or be a multiple of it" if shared else ""
        raise UnsupportedConfiguration(
            f"TP={w} must divide {field}={heads}{also} (whole heads / channels per rank)")

    def local(self, heads: int, field: str, shared: bool = False) -> int:
        return self.owned(heads, field, shared)[1]

    def group(self) -> Any:
        """The checked TP process group (raises when the group does not match this config)."""
        w = self.tp_world_size
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedConfiguration(
                f"TP={w} needs an initialised torch.distributed process group")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (w, self.tp_rank):
            raise ContractViolation(OP, "process_group",
                                    f"must have tp_world_size = {w} ranks with this rank at "
                                    f"tp_rank = {self.tp_rank}", f"size {size}, rank {rank}")
        return group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed in place over the TP group (nothing at world size 1); the group is
        checked on the first call only."""
        if self.tp_world_size > 1:
            if self.communicator is not None:
                return self.communicator.all_reduce(t)
            if self._checked is None:
                object.__setattr__(self, "_checked", self.group())
            dist.all_reduce(t, group=self._checked)
        return t


@dataclass(frozen=True)
class ShardedWeight:
    """The weight loader of a parameter split along ``dim`` into ``segments`` (module docstring)."""

    dim: int
    segments: tuple[Segment, ...]
    parallel: ParallelConfig

    def local_size(self) -> int:
        return sum(s.size // s.heads * self.parallel.local(s.heads, s.field, s.shared)
                   for s in self.segments)

    def checkpoint_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(s.size for s in self.segments)
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view when it is one contiguous dim-0 run)."""
        if self.parallel.tp_world_size == 1:
            return full
        parts, offset = [], 0
        for s in self.segments:
            start, count = self.parallel.owned(s.heads, s.field, s.shared)
            per = s.size // s.heads
            parts.append(full.narrow(self.dim, offset + start * per, count * per))
            offset += s.size
        return (parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)).contiguous()

    def __call__(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> torch.Tensor:
        return self.shard(loaded_weight).to(param.dtype)


def replicated_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> torch.Tensor:
    """Every rank holds the whole tensor, in the parameter's dtype."""
    return loaded_weight.to(param.dtype)


def weight_loader(param: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return getattr(param, "weight_loader", replicated_weight_loader)


def checkpoint_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the full checkpoint tensor that ``param`` holds a slice of."""
    loader = getattr(param, "weight_loader", None)
    if isinstance(loader, ShardedWeight):
        return loader.checkpoint_shape(param.shape)
    return tuple(param.shape)


def shard_weight(param: nn.Parameter, dim: int, segments: Sequence[Segment],
                 parallel: ParallelConfig) -> nn.Parameter:
    """Give ``param`` (already of the local shape) the loader of its split; returns it."""
    param.weight_loader = ShardedWeight(dim, tuple(segments), parallel)  # type: ignore[attr-defined]
    return param


class ReplicatedLinear(nn.Module, UsesKernels):
    """``y = x @ W^T``, the whole ``W`` on every rank (weights are loaded, never initialised).

    ``quantize(fmt)`` holds ``W`` (this rank's slice) in 8 or 4 bits instead
    (``pagedhybrid.weightquant``; in the engine's groups of 16 rows, ``group_rows``):
    ``quant`` then has the codes and scales, ``weight`` becomes a
    placeholder on the meta device (its shape and dtype, no memory) and the product is the
    bundle's ``qmatmul`` (``ModuleKernels.quantized_linear``; ``weightquant.reference_linear``
    when the bundle has none)."""

    matmul: Matmul | None = None  # the bundle's product (None: F.linear)
    qmatmul: QMatmul = staticmethod(reference_linear)  # the bundle's product of ``quant``
    quant: QuantizedWeight | None = None

    def use_kernels(self, kernels: ModuleKernels, dtype: torch.dtype) -> None:
        self.matmul = kernels.linear_for(dtype)
        if kernels.quantized_linear is not None:
            self.qmatmul = kernels.quantized_linear

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.qmatmul(x, self.quant)
        mm = self.matmul
        return F.linear(x, self.weight) if mm is None else mm(x, self.weight)

    def quantize(self, fmt: WeightFormat, name: str = "weight") -> torch.Tensor | None:
        """Hold the weight in ``fmt`` (class docstring); returns the plain weight it no longer
        holds (None when it already was in ``fmt``), whose mapped file pages the caller may
        release."""
        w = self.weight
        if self.quant is not None:
            if self.quant.fmt != fmt:
                raise UnsupportedConfiguration(
                    f"{name} is already held as {self.quant.fmt.name}; load the checkpoint "
                    f"again to hold it as {fmt.name}")
            return None
        self.quant = group_rows(quantize(w, fmt, name))
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                   requires_grad=False)
        return w


class ColumnParallelLinear(ReplicatedLinear):
    """Output rows split by ``segments`` (one segment: a plain or head-split projection; several:
    a merged one); ``y_local = x @ W_local^T`` holds this rank's heads, no collective."""

    def __init__(self, in_features: int, segments: Segment | Sequence[Segment],
                 dtype: torch.dtype, parallel: ParallelConfig) -> None:
        segs = (segments,) if isinstance(segments, Segment) else tuple(segments)
        loader = ShardedWeight(0, segs, parallel)
        super().__init__(in_features, loader.local_size(), dtype)
        shard_weight(self.weight, 0, segs, parallel)


class RowParallelLinear(ReplicatedLinear):
    """Input columns split by ``segment``; ``y = all_reduce(x_local @ W_local^T)`` over the TP
    group (none at world size 1). With two ranks the sum is ``a + b`` element-wise, the same
    bits on both ranks and for any batch."""

    def __init__(self, segment: Segment, out_features: int, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        loader = ShardedWeight(1, (segment,), parallel)
        super().__init__(loader.local_size(), out_features, dtype)
        shard_weight(self.weight, 1, (segment,), parallel)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, out] partial sum of this rank's input slice, summed over the ranks
        return self.parallel.all_reduce(super().forward(x))
