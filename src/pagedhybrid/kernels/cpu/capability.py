"""What a fast CPU kernel implements itself, and what it hands to the reference on purpose.

Every kernel in ``pagedhybrid.kernels.cpu`` validates with its contract's own ``validate_call()``
and then runs a vectorised compute path. A feature the fast path does not cover is never a silent
fallback: it is listed in ``delegated`` (feature -> reason), the kernel routes such calls to the
reference explicitly, and ``supports(...)`` says so before a call is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedhybrid.dtypes import logical_name


@dataclass(frozen=True)
class KernelCapability:
    """Declared coverage of one fast kernel.

    ``dtypes``: activation element types the fast path computes (float32 accumulation always).
    ``features``: contract features the fast path implements itself.
    ``delegated``: feature -> why it is routed to the reference instead (explicit, documented).
    ``paths``: the compute paths and when each is taken.
    """

    op: str
    dtypes: tuple[torch.dtype, ...]
    features: tuple[str, ...]
    delegated: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def supports(self, feature: str) -> bool:
        """True when ``feature`` runs on the fast path (False: delegated or unknown)."""
        return feature in self.features and feature not in self.delegated

    def describe(self) -> dict[str, object]:
        """JSON-able summary (for ``pagedhybrid kernels`` and benchmark reports)."""
        return {"op": self.op, "dtypes": [logical_name(d) for d in self.dtypes],
                "features": list(self.features), "delegated": dict(self.delegated),
                "paths": dict(self.paths)}
