"""Context and tensor parallelism over torch.distributed.

* ``context_parallel_attention`` (``attention.context_parallel``, grid in ``attention.cp_plan``)
  -- deterministic CP attention: fixed global KV grid, fp32 ``(out, lse)`` partials exchanged
  with their global block ids, left fold in global block order; bitwise equal for every CP size.
  It lives in the attention layer, whose dispatch registers it; re-exported here.
* ``cp_sharding`` (``attention.layouts``) -- contiguous / zigzag (head-tail) CP layouts as
  ShardingSpecs; re-exported here.
* ``ParallelConfig``, ``ColumnParallelLinear``, ``RowParallelLinear``, ``ReplicatedLinear``
  (``linear``) -- TP as layers: each holds one rank's slice, loaded by its parameters'
  ``weight_loader`` from the full checkpoint tensor; row-parallel outputs are all-reduced. A
  model built with a ``ParallelConfig`` is a TP rank (``models.qwen35.build`` / ``load``).
* ``run_gloo`` (``launch``) -- run a function on W real gloo ranks (spawned processes).
"""

from __future__ import annotations

from pagedhybrid.attention.context_parallel import context_parallel_attention
from pagedhybrid.attention.layouts import cp_sharding
from pagedhybrid.parallel.launch import RankFailed, run_gloo
from pagedhybrid.parallel.linear import (
    ColumnParallelLinear,
    ParallelConfig,
    ReplicatedLinear,
    RowParallelLinear,
    Segment,
)

__all__ = ["ColumnParallelLinear", "ParallelConfig", "RankFailed", "ReplicatedLinear",
           "RowParallelLinear", "Segment", "context_parallel_attention", "cp_sharding",
           "run_gloo"]
