"""Operator contracts: one module per op, each an ``OpSpec`` + validation + torch reference.

* ``paged_attention``      -- com.microsoft.PagedAttention (SEPARATE K/V pages)
* ``varlen_causal_conv``   -- com.microsoft.VarlenCausalConvWithState
* ``gated_delta_net``      -- com.microsoft.GatedDeltaNet

Positional arguments follow ONNX Runtime's input order and keyword names its input and attribute
names; outputs come back as a tuple in ONNX Runtime's output order.
"""

from __future__ import annotations

import importlib
from typing import Any

OP_MODULES = {
    "com.microsoft.PagedAttention": "pagedhybrid.ops.paged_attention",
    "com.microsoft.VarlenCausalConvWithState": "pagedhybrid.ops.varlen_causal_conv",
    "com.microsoft.GatedDeltaNet": "pagedhybrid.ops.gated_delta_net",
}
_FUNCTIONS = {
    "paged_attention": "pagedhybrid.ops.paged_attention",
    "varlen_causal_conv": "pagedhybrid.ops.varlen_causal_conv",
    "gated_delta_net": "pagedhybrid.ops.gated_delta_net",
}

__all__ = ["OP_MODULES", "gated_delta_net", "op_module", "paged_attention", "varlen_causal_conv"]


def op_module(qualname: str) -> Any:
    """The module of an operator contract by its ``domain.Name``."""
    return importlib.import_module(OP_MODULES[qualname])


def __getattr__(name: str) -> Any:  # lazy, so ``pagedhybrid.ops.spec`` imports stand alone
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    raise AttributeError(name)
