"""pagedhybrid: packed, paged attention for hybrid GatedDeltaNet / full-attention decoders."""

from __future__ import annotations

from pagedhybrid.engine import (
    LLM,
    BlockPool,
    Engine,
    EngineConfig,
    InvalidRequest,
    RequestOutput,
    SamplingParams,
    Scheduler,
    StatePool,
)
from pagedhybrid.errors import (
    CapacityError,
    ContractViolation,
    PagedHybridError,
    UnsupportedConfiguration,
)

__all__ = [
    "LLM",
    "BlockPool",
    "CapacityError",
    "ContractViolation",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "PagedHybridError",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "StatePool",
    "UnsupportedConfiguration",
]
__version__ = "0.1.0"
