"""Attention contract, capability registry and dispatch with provenance.

* ``contract``  -- AttentionContract, ShardingSpec, ReductionSpec, KVCacheSpec, RoPESpec,
  AttentionBackendCapability (validated at construction, JSON round-trip)
* ``lse``       -- attention-domain (out, lse) partial states and the pinned online-softmax merge
* ``registry``  -- KernelRegistry: ``get_op(name)`` and ``get_attention_op(contract)``
* ``backends``  -- the real backends with truthful capabilities; ``default_registry()``
* ``cli``       -- ``pagedhybrid dispatch explain CONTRACT.json``
"""

from __future__ import annotations

from pagedhybrid.attention.contract import (
    AttentionBackendCapability,
    AttentionContract,
    AttentionContractError,
    KVCacheSpec,
    ReductionSpec,
    RoPESpec,
    ShardingSpec,
)
from pagedhybrid.attention.registry import (
    AttentionDispatchError,
    DispatchProvenance,
    DispatchResult,
    KernelRegistry,
)

__all__ = [
    "AttentionBackendCapability", "AttentionContract", "AttentionContractError",
    "AttentionDispatchError", "DispatchProvenance", "DispatchResult", "KVCacheSpec",
    "KernelRegistry", "ReductionSpec", "RoPESpec", "ShardingSpec",
]
