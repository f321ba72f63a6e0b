"""The one registry of kernel backends, and the selection the model and the engine run on.

A ``Backend`` bundles, for one implementation family:

* the model's step seam -- ``attention``, ``causal_conv``, ``gated_delta``: one layer's operator
  on a validated ``StepMetadata``, with KV pages and conv / recurrent state pools updated in place
  (see ``kernels/cpu/step.py`` for the signatures);
* the three operator contracts with the signatures of ``pagedhybrid.ops`` (``ops``), each
  validating its call fully (contract entry points);
* what it declares: element types, features (``in_place_state``: state rows updated in their
  pool; ``paged_in_place``: attention reads pages without gathering the context;
  ``state_checkpoints``: the linear layers emit intermediate states for prefix caching), and
  ``unsupported(config, dtype)``, the reason it cannot run a model (None when it can).

Registered backends:

* ``native``    -- the C++ kernels (``kernels/native``) for decode / short queries and state
  updates, the torch kernels for long prefill; needs the prebuilt extension;
* ``torch``     -- the vectorised torch kernels (``kernels/cpu``);
* ``reference`` -- the op references (``pagedhybrid.ops``): the declared slow path, exact.

``select(name, config, dtype)`` resolves ``"auto"`` to ``native`` when it is available and can
serve the model, else ``torch`` -- and says why in ``Selection.reason`` (never a silent
fallback); an explicit name that cannot serve raises ``UnsupportedConfiguration``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pagedhybrid.dtypes import logical_name
from pagedhybrid.errors import UnsupportedConfiguration

BACKENDS = ("native", "torch", "reference")
DEFAULT_BACKEND = "auto"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ContractOps(NamedTuple):
    """The three operator contracts (signatures of ``pagedhybrid.ops``)."""

    paged_attention: Callable[..., tuple[Any, ...]]
    varlen_causal_conv: Callable[..., tuple[Any, ...]]
    gated_delta_net: Callable[..., tuple[Any, ...]]


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    dtypes: tuple[torch.dtype, ...]
    features: frozenset[str]
    attention: Callable[..., torch.Tensor]
    causal_conv: Callable[..., torch.Tensor]
    gated_delta: Callable[..., torch.Tensor]
    ops: ContractOps
    requirement: Callable[[Any, torch.dtype], str | None]

    def unsupported(self, config: Any, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a model of ``config`` in ``dtype`` (None: it can)."""
        if dtype not in self.dtypes:
            return f"{self.name} kernels do not serve {dtype} (they serve {list(self.dtypes)})"
        return self.requirement(config, dtype)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description,
                "dtypes": [logical_name(d) for d in self.dtypes],
                "features": sorted(self.features)}


class Selection(NamedTuple):
    backend: Backend
    reason: str  # why this backend runs (and why a preferred one does not)


def _always(config: Any, dtype: torch.dtype) -> str | None:
    return None


def _native_requirement(config: Any, dtype: torch.dtype) -> str | None:
    from pagedhybrid.kernels.native import status

    st = status()
    if not st.available:
        return st.reason
    if config is not None and (config.head_dim % 16 or config.head_dim > 256):
        return f"native attention needs head_dim a multiple of 16 and <= 256 ({config.head_dim})"
    return None


def _make(name: str) -> Backend:
    if name == "reference":
        from pagedhybrid import ops
        from pagedhybrid.kernels import step_reference as step

        return Backend("reference", "op references (pagedhybrid.ops), exact, slow",
                       (*_DTYPES, torch.float64), frozenset(), step.attention, step.causal_conv,
                       step.gated_delta, ContractOps(ops.paged_attention, ops.varlen_causal_conv,
                                                     ops.gated_delta_net), _always)
    if name == "torch":
        from pagedhybrid.kernels import cpu
        from pagedhybrid.kernels.cpu import step

        return Backend("torch", "vectorised torch kernels (kernels/cpu)",
                       (*_DTYPES, torch.float64), frozenset({"in_place_state",
                                                             "state_checkpoints"}),
                       step.attention,
                       step.causal_conv, step.gated_delta,
                       ContractOps(cpu.paged_attention, cpu.varlen_causal_conv,
                                   cpu.gated_delta_net), _always)
    if name == "native":
        from pagedhybrid.kernels.native import contract
        from pagedhybrid.kernels.native import step as nstep

        return Backend("native", "C++ kernels (kernels/native): paged decode / short-query "
                       "attention, in-place state updates; torch kernels for long prefill",
                       _DTYPES, frozenset({"in_place_state", "paged_in_place",
                                           "state_checkpoints"}),
                       nstep.attention, nstep.causal_conv, nstep.gated_delta,
                       ContractOps(contract.paged_attention, contract.varlen_causal_conv,
                                   contract.gated_delta_net), _native_requirement)
    raise UnsupportedConfiguration(
        f"unknown kernel backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")


_CACHE: dict[str, Backend] = {}


def backend(name: str) -> Backend:
    """The registered backend ``name`` (``native``, ``torch`` or ``reference``)."""
    if name not in _CACHE:
        _CACHE[name] = _make(name)
    return _CACHE[name]


def select(name: str = DEFAULT_BACKEND, config: Any = None,
           dtype: torch.dtype = torch.float32) -> Selection:
    """The backend to run a model of ``config`` in ``dtype`` on (see the module docstring)."""
    if name == "auto":
        why = backend("native").unsupported(config, dtype)
        if why is None:
            return Selection(backend("native"), "native kernels (auto)")
        return Selection(backend("torch"), f"torch kernels: native unavailable -- {why}")
    chosen = backend(name)
    why = chosen.unsupported(config, dtype)
    if why is not None:
        raise UnsupportedConfiguration(f"kernel backend {name!r}: {why}")
    return Selection(chosen, f"{name} kernels (requested)")
