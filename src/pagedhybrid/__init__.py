"""pagedhybrid: packed, paged attention for hybrid GatedDeltaNet / full-attention decoders.

The engine names below are imported on first use (``pagedhybrid.LLM``), so that importing a
light part of the package -- the op contracts, the errors, the CLI's argument parsing -- does not
load the engine, the model and the kernels. Importing it first sets OpenMP's spin for torch's
threads (``pagedhybrid.openmp``).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from pagedhybrid import openmp

openmp.configure()  # before anything loads torch (and libgomp): pagedhybrid/openmp.py

from pagedhybrid.errors import (  # noqa: E402
    CapacityError,
    ContractViolation,
    PagedHybridError,
    UnsupportedConfiguration,
)

if TYPE_CHECKING:
    from pagedhybrid.engine import (
        BlockPool,
        Engine,
        EngineConfig,
        InvalidRequest,
        RequestOutput,
        SamplingParams,
        Scheduler,
        StatePool,
    )
    from pagedhybrid.serve.llm import LLM

# name -> the module it lives in, imported on first use
_LAZY = {"LLM": "pagedhybrid.serve.llm",
         **{n: "pagedhybrid.engine" for n in ("BlockPool", "Engine", "EngineConfig",
                                              "InvalidRequest", "RequestOutput", "SamplingParams",
                                              "Scheduler", "StatePool")}}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedhybrid' has no attribute {name!r}")
