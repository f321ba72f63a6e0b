"""The model's kernel bundles and their selection through the one kernel registry.

A ``Backend`` bundles, for one implementation family:

* the model's step seam -- ``attention``, ``causal_conv``, ``gated_delta``: one layer's operator
  on a validated ``StepMetadata``, with KV pages and conv / recurrent state pools updated in place
  (see ``kernels/cpu/step.py`` for the signatures), and ``linear`` (every projection and the LM
  head; None = ``torch.nn.functional.linear``) and ``pointwise`` (the layers' elementwise
  nonlinearities, silu and sigmoid: torch's by default);
* the three operator contracts with the signatures of ``pagedhybrid.ops`` (``ops``), each
  validating its call fully (contract entry points);
* what it declares: its ``capability`` (an ``AttentionBackendCapability``: dtypes, head dims,
  packed varlen over a KV cache, ``batch_invariant``), features (``in_place_state``: state rows
  updated in their pool; ``paged_in_place``: attention reads pages without gathering the
  context; ``state_checkpoints``: the linear layers emit intermediate states for prefix
  caching), and ``unsupported(config, dtype)``, the reason it cannot run a model (None when it
  can).

Bundles (in the registry's priority order):

* ``native``    -- the C++ kernels (``kernels/native``) for decode / short queries and state
  updates, the torch kernels for long prefill; needs the prebuilt extension;
* ``native_batch_invariant`` -- the C++ kernels for everything, linear layers included, in forms
  whose per-row arithmetic does not depend on the batch (``kernels/native/invariant.py``);
* ``torch``     -- the vectorised torch kernels (``kernels/cpu``);
* ``reference`` -- the op references (``pagedhybrid.ops``): the declared slow path, exact.

They are registered, with their capabilities, in the one kernel registry
(``pagedhybrid.attention.backends.default_registry``), which also dispatches attention contracts.
``select(name, config, dtype, batch_invariant=...)`` asks it for the model's bundle: ``"auto"``
walks the bundles in priority order and takes the first whose capability and requirements fit,
saying why each earlier one was passed over (never a silent fallback); a named bundle that does
not fit raises ``UnsupportedConfiguration`` naming it and the missing property.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.dtypes import cli_name, logical_name
from pagedhybrid.errors import UnsupportedConfiguration

BACKENDS = ("native", "native_batch_invariant", "torch", "reference")
REGISTRY_IDS = {"native": "native_paged_attention",
                "native_batch_invariant": "native_batch_invariant",
                "torch": "cpu_paged_attention", "reference": "paged_attention_reference"}
DEFAULT_BACKEND = "auto"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ContractOps(NamedTuple):
    """The three operator contracts (signatures of ``pagedhybrid.ops``)."""

    paged_attention: Callable[..., tuple[Any, ...]]
    varlen_causal_conv: Callable[..., tuple[Any, ...]]
    gated_delta_net: Callable[..., tuple[Any, ...]]


class Pointwise(NamedTuple):
    """The elementwise nonlinearities the layers apply (same shape and dtype out as in)."""

    silu: Callable[[torch.Tensor], torch.Tensor]
    sigmoid: Callable[[torch.Tensor], torch.Tensor]


TORCH_POINTWISE = Pointwise(F.silu, torch.sigmoid)


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
    capability: AttentionBackendCapability
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    pointwise: Pointwise = TORCH_POINTWISE

    @property
    def batch_invariant(self) -> bool:
        return self.capability.batch_invariant

    def unsupported(self, config: Any, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a model of ``config`` in ``dtype`` (None: it can)."""
        if dtype not in self.dtypes:
            return f"{self.name} kernels do not serve {dtype} (they serve {list(self.dtypes)})"
        return self.requirement(config, dtype)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description,
                "dtypes": [logical_name(d) for d in self.dtypes],
                "features": sorted(self.features), "batch_invariant": self.batch_invariant}


class Selection(NamedTuple):
    backend: Backend
    reason: str  # why this backend runs (and why a preferred one does not)
    rejections: dict[str, tuple[str, ...]]  # bundles passed over, with their reasons


def _capability(name: str, dtypes: tuple[torch.dtype, ...], kind: str, invariant: bool,
                what: str, rope: bool = False) -> AttentionBackendCapability:
    """Conservative: a bundle never claims more than it is known to do (``rope``: its contract
    op rotates q/k itself through cos/sin caches)."""
    return AttentionBackendCapability(
        backend_id=REGISTRY_IDS[name], roles=("infer",),
        modes=("prefill", "chunked_prefill", "decode"),
        dtypes=tuple(cli_name(d) for d in dtypes if d != torch.float64),
        cp_world_sizes=(1,), exports_attention_lse=False, supports_packed_varlen=True,
        supports_kv_cache=True, implementation_kind=kind, supports_rope_metadata=rope,
        supports_fused_rope_attention=rope, batch_invariant=invariant,
        description=f"com.microsoft.PagedAttention and the model's step on {what}; no LSE")


def _always(config: Any, dtype: torch.dtype) -> str | None:
    return None


def _native_requirement(config: Any, dtype: torch.dtype) -> str | None:
    from pagedhybrid.kernels.native import status

    st = status()
    if not st.available:
        return st.reason
    if config is not None and config.head_dim > 256:
        return f"native attention needs head_dim <= 256 ({config.head_dim})"
    return None


def _make(name: str) -> Backend:
    if name == "reference":
        from pagedhybrid import ops
        from pagedhybrid.kernels import step_reference as step

        return Backend("reference", "op references (pagedhybrid.ops), exact, slow",
                       (*_DTYPES, torch.float64), frozenset(), step.attention, step.causal_conv,
                       step.gated_delta, ContractOps(ops.paged_attention, ops.varlen_causal_conv,
                                                     ops.gated_delta_net), _always,
                       _capability(name, _DTYPES, "reference", False, "the op references",
                                   rope=True))
    if name == "torch":
        from pagedhybrid.kernels import cpu
        from pagedhybrid.kernels.cpu import step

        return Backend("torch", "vectorised torch kernels (kernels/cpu)",
                       (*_DTYPES, torch.float64), frozenset({"in_place_state",
                                                             "state_checkpoints"}),
                       step.attention,
                       step.causal_conv, step.gated_delta,
                       ContractOps(cpu.paged_attention, cpu.varlen_causal_conv,
                                   cpu.gated_delta_net), _always,
                       _capability(name, _DTYPES, "production", False,
                                   "vectorised torch kernels"))
    if name == "native":
        from pagedhybrid.kernels.native import contract
        from pagedhybrid.kernels.native import step as nstep

        return Backend("native", "C++ kernels (kernels/native): paged decode / short-query "
                       "attention, in-place state updates; torch kernels for long prefill",
                       _DTYPES, frozenset({"in_place_state", "paged_in_place",
                                           "state_checkpoints"}),
                       nstep.attention, nstep.causal_conv, nstep.gated_delta,
                       ContractOps(contract.paged_attention, contract.varlen_causal_conv,
                                   contract.gated_delta_net), _native_requirement,
                       _capability(name, _DTYPES, "production", False, "the C++ kernels"))
    if name == "native_batch_invariant":
        from pagedhybrid.kernels.native import contract
        from pagedhybrid.kernels.native import invariant as inv

        return Backend("native_batch_invariant", "C++ kernels for every token and projection "
                       "in batch-invariant forms (kernels/native/invariant.py)", inv.DTYPES,
                       frozenset({"in_place_state", "paged_in_place", "state_checkpoints"}),
                       inv.attention, inv.causal_conv, inv.gated_delta,
                       ContractOps(contract.paged_attention, contract.varlen_causal_conv,
                                   contract.gated_delta_net), _native_requirement,
                       _capability(name, inv.DTYPES, "production", True,
                                   "the C++ kernels in batch-invariant forms"), inv.linear,
                       Pointwise(inv.silu, inv.sigmoid))
    raise UnsupportedConfiguration(
        f"unknown kernel backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")


_CACHE: dict[str, Backend] = {}


def backend(name: str) -> Backend:
    """The kernel bundle ``name`` (one of ``BACKENDS``)."""
    if name not in _CACHE:
        _CACHE[name] = _make(name)
    return _CACHE[name]


def select(name: str = DEFAULT_BACKEND, config: Any = None,
           dtype: torch.dtype = torch.float32, *, batch_invariant: bool = False) -> Selection:
    """The bundle to run a model of ``config`` in ``dtype`` on, from the one kernel registry
    (see the module docstring)."""
    from pagedhybrid.attention.backends import default_registry

    return default_registry().select_step(name, config=config, dtype=dtype,
                                          batch_invariant=batch_invariant)
