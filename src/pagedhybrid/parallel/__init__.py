"""Context and tensor parallelism over torch.distributed.

* ``context_parallel_attention`` (``context_parallel``, grid in ``cp_plan``) -- deterministic CP
  attention: fixed global KV grid, fp32 ``(out, lse)`` partials exchanged with their global block
  ids, left fold in global block order; bitwise equal for every CP size.
* ``cp_sharding`` (``layouts``) -- contiguous / zigzag (head-tail) CP layouts as ShardingSpecs.
* ``tensor_parallel_qwen35`` (``tensor_parallel``) -- a TP rank's shard of a Qwen3.5 model
  (column/row-parallel projections, all_reduce after o_proj / out_proj / down_proj).
* ``run_gloo`` (``launch``) -- run a function on W real gloo ranks (spawned processes).
"""

from __future__ import annotations

from pagedhybrid.parallel.context_parallel import context_parallel_attention
from pagedhybrid.parallel.launch import RankFailed, run_gloo
from pagedhybrid.parallel.layouts import cp_sharding
from pagedhybrid.parallel.tensor_parallel import attention_sharding, tensor_parallel_qwen35

__all__ = ["RankFailed", "attention_sharding", "context_parallel_attention", "cp_sharding",
           "run_gloo", "tensor_parallel_qwen35"]
