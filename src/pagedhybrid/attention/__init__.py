"""Attention contract and contract-aware dispatch with provenance.

* ``contract``   -- AttentionContract, ShardingSpec, ReductionSpec, KVCacheSpec, RoPESpec,
  AttentionBackendCapability (validated at construction, JSON round-trip)
* ``capability`` -- AttentionBackendCapability; ``from_bundle`` derives a kernel bundle's from
  its ``BundleCapability`` (the one kernel registry, ``pagedhybrid.kernels.registry``)
* ``lse``        -- attention-domain (out, lse) partial states and the pinned online-softmax merge
* ``registry``   -- AttentionRegistry: ``get_op(name)`` and ``get_attention_op(contract)`` over
  the kernel registry's bundles plus the attention-domain backends
* ``backends``   -- the attention-domain backends with truthful capabilities;
  ``default_registry()`` over ``kernels.backend.REGISTRY``
* ``cli``        -- ``pagedhybrid dispatch explain CONTRACT.json``
"""

from __future__ import annotations

from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.attention.contract import (
    AttentionContract,
    AttentionContractError,
    KVCacheSpec,
    ReductionSpec,
    RoPESpec,
    ShardingSpec,
)
from pagedhybrid.attention.registry import (
    AttentionDispatchError,
    AttentionRegistry,
    DispatchProvenance,
    DispatchResult,
)

__all__ = [
    "AttentionBackendCapability", "AttentionContract", "AttentionContractError",
    "AttentionDispatchError", "AttentionRegistry", "DispatchProvenance", "DispatchResult",
    "KVCacheSpec", "ReductionSpec", "RoPESpec", "ShardingSpec",
]
