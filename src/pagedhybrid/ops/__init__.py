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

# Bound here, after the submodules are imported: importing ``pagedhybrid.ops.gated_delta_net``
# sets the package attribute of that name to the *module*; these imports rebind it to the
# function once and for all (a later ``import pagedhybrid.ops.x`` does not rebind it).
from pagedhybrid.ops.gated_delta_net import gated_delta_net
from pagedhybrid.ops.paged_attention import paged_attention
from pagedhybrid.ops.varlen_causal_conv import varlen_causal_conv

OP_MODULES = {
    "com.microsoft.PagedAttention": "pagedhybrid.ops.paged_attention",
    "com.microsoft.VarlenCausalConvWithState": "pagedhybrid.ops.varlen_causal_conv",
    "com.microsoft.GatedDeltaNet": "pagedhybrid.ops.gated_delta_net",
}

__all__ = ["OP_MODULES", "gated_delta_net", "op_module", "paged_attention", "varlen_causal_conv"]


def op_module(qualname: str) -> Any:
    """The module of an operator contract by its ``domain.Name``."""
    return importlib.import_module(OP_MODULES[qualname])
