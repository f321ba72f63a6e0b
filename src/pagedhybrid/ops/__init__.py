"""Operator contracts: one module per op, each an ``OpSpec`` + validation + torch reference.

* ``paged_attention``      -- com.microsoft.PagedAttention (SEPARATE K/V pages)
* ``varlen_causal_conv``   -- com.microsoft.VarlenCausalConvWithState
* ``gated_delta_net``      -- com.microsoft.GatedDeltaNet

Each op's signature is written once, as its ``SPEC`` (``pagedhybrid.ops.spec.OpSpec``): inputs
positional or by keyword in ONNX Runtime's order and names, attributes keyword-only with ORT's
defaults (``SPEC.signature()``); outputs come back as a tuple in ONNX Runtime's output order.
Every implementation (the references here, ``kernels.cpu``, ``kernels.native.contract``,
``kernels.onnxruntime``, ``kernels.webgpu``) is a ``run(call)`` registered with
``SPEC.implement(backend)``, which publishes that signature and hands ``run`` the ``BoundCall``
of ``SPEC.bind``.
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
