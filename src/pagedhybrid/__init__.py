"""pagedhybrid: packed, paged attention for hybrid GatedDeltaNet / full-attention decoders."""

from __future__ import annotations

from pagedhybrid.errors import (
    CapacityError,
    ContractViolation,
    PagedHybridError,
    UnsupportedConfiguration,
)

__all__ = ["CapacityError", "ContractViolation", "PagedHybridError", "UnsupportedConfiguration"]
__version__ = "0.1.0"
