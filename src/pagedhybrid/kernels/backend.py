"""The one seam between a model and its operators: ``OpBackend`` and backend selection.

Every call the model makes to ``PagedAttention``, ``VarlenCausalConvWithState`` and
``GatedDeltaNet`` goes through an ``OpBackend``: a NamedTuple of three callables with the
signatures of the public ops in ``pagedhybrid.ops`` (positional = ONNX Runtime input order,
keywords = ONNX Runtime names, tuple results in ONNX Runtime output order). The default is the
fast CPU kernels (``pagedhybrid.kernels.cpu``); the torch reference of each contract stays
selectable (``select("reference")``, e.g. for verification runs). Any implementation of the
same contracts is swapped in with one option (``load(..., backend=...)`` or
``model.backend = ...``) without touching the model.

Contract reminders (shapes as the model uses them):

* ``paged_attention(query[N, H*D], key[N, Hkv*D], value[N, Hkv*D], key_cache[P, bs, Hkv, D],
  value_cache, cumulative_sequence_length int32[B+1], past_seqlens int32[B],
  block_table int32[B, M], attention_metadata=int32[3] | None, *, num_heads, kv_num_heads,
  scale=0.0) -> (output[N, H*D], key_cache, value_cache)`` -- pages written in place.
* ``varlen_causal_conv(input[T, C], weight[C, 1, K], cumulative_sequence_length int32[B+1],
  bias=None, initial_state[B, C, K-1], *, activation="silu") -> (output[T, C], final_state)``.
* ``gated_delta_net(query[T, Hk, Dk], key[T, Hk, Dk], value[T, Hv, Dv], cu_seqlens int32[B+1],
  decay[T, Hv] (raw a), beta[T, Hv] (raw b), initial_state fp32[B, Hv, Dv, Dk], a_log fp32[Hv],
  dt_bias fp32[Hv], *, gate_activation="qwen", beta_activation="sigmoid", qk_l2_norm=1,
  scale=0.0) -> (output[T, Hv, Dv], final_state fp32[B, Hv, Dv, Dk])``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

from pagedhybrid.errors import UnsupportedConfiguration

BACKENDS = ("cpu", "reference")
DEFAULT_BACKEND = "cpu"  # for torch CPU tensors


class OpBackend(NamedTuple):
    """The three operator implementations a model calls."""

    paged_attention: Callable[..., tuple[Any, ...]]
    varlen_causal_conv: Callable[..., tuple[Any, ...]]
    gated_delta_net: Callable[..., tuple[Any, ...]]
    name: str = "custom"


def _backend(package: str, name: str) -> OpBackend:
    def op(module: str) -> Callable[..., tuple[Any, ...]]:
        return getattr(importlib.import_module(f"{package}.{module}"), module)

    return OpBackend(paged_attention=op("paged_attention"),
                     varlen_causal_conv=op("varlen_causal_conv"),
                     gated_delta_net=op("gated_delta_net"), name=name)


def reference_backend() -> OpBackend:
    """The torch references of ``pagedhybrid.ops`` (the single source of truth)."""
    return _backend("pagedhybrid.ops", "reference")


def cpu_backend() -> OpBackend:
    """The vectorised CPU kernels of ``pagedhybrid.kernels.cpu``."""
    return _backend("pagedhybrid.kernels.cpu", "cpu")


def select(name: str = DEFAULT_BACKEND) -> OpBackend:
    """``OpBackend`` by name: ``"cpu"`` (fast kernels, the default) or ``"reference"``."""
    if name == "cpu":
        return cpu_backend()
    if name == "reference":
        return reference_backend()
    raise UnsupportedConfiguration(
        f"unknown op backend {name!r}; choose one of {', '.join(BACKENDS)}")
