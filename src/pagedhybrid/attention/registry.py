"""Attention-contract dispatch with provenance, over the one kernel registry's bundles.

``AttentionRegistry`` holds the backends an ``AttentionContract`` can be dispatched to, each
with an ``AttentionBackendCapability``:

* the kernel bundles of the one kernel registry (``pagedhybrid.kernels.registry``), registered
  with ``register_bundle(bundle)``: the entry holds the bundle object itself (``step``), its
  contract op is the bundle's PagedAttention, its id is the bundle's ``contract_id``, its
  capability is derived from the bundle's ``BundleCapability`` in one place
  (``AttentionBackendCapability.from_bundle``) and its availability is the bundle's own probe;
* attention-domain backends that are not kernel bundles (``register_attention_backend``): e.g.
  ``torch_varlen`` and ``deterministic_cp`` (``pagedhybrid.attention.backends``).

The model's bundle is chosen by the kernel registry itself (``kernels.backend.select``), not
here. ``get_op(name)`` is a plain name lookup. ``get_attention_op(contract)`` never silently
lands on a backend with different reduction semantics:

1. ``requested_backend`` is a policy (``auto`` | ``production`` | ``reference``) or an exact
   backend id. ``"deterministic"`` is refused as a policy (determinism is requested through the
   contract's ReductionSpec and matched against capability flags). ``cp_world_size > 1`` needs an
   exact backend id: per-rank automatic resolution could diverge across ranks.
2. Candidates are walked in registration priority. Only backends that declare an
   ``AttentionBackendCapability`` are considered; every skipped backend gets its reasons
   (undeclared, other platform, unavailable, each contract incompatibility). Skips caused by the
   caller's policy are listed apart and do not count as fallback.
3. Success returns ``DispatchResult(op, provenance)``; ``provenance`` (JSON-serialisable) holds the
   requested and actual backend, platform, fallback status and reason (earlier candidates were
   rejected), every prior rejection, the full contract and the selected capability.
4. Failure raises ``AttentionDispatchError`` (an ``UnsupportedConfiguration``) listing every
   rejection; an exact backend id is never replaced by another backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.attention.contract import AttentionContract
from pagedhybrid.attention.fields import ImplementationKind
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.registry import Backend, format_rejections

POLICIES = ("auto", "production", "reference")
_POLICY_KINDS = {
    "auto": tuple(ImplementationKind),
    "production": (ImplementationKind.PRODUCTION,),
    "reference": (ImplementationKind.REFERENCE, ImplementationKind.DETERMINISTIC),
}


class AttentionDispatchError(UnsupportedConfiguration):
    """No registered backend materialises the contract; ``rejections`` maps id -> reasons."""

    def __init__(self, reason: str, rejections: dict[str, tuple[str, ...]] | None = None) -> None:
        self.rejections = dict(rejections or {})
        super().__init__(reason)


@dataclass(frozen=True)
class AttentionBackend:
    """A registered attention implementation; ``capability=None`` means undeclared."""

    backend_id: str
    op: Callable[..., Any]
    capability: AttentionBackendCapability | None
    platform: str = "cpu"
    available: Callable[[], str | None] | None = None  # returns a reason when unavailable
    communication: str | None = None  # collectives it launches, for provenance
    step: Backend | None = None  # the kernel bundle behind this backend (the registry's object)

    def rejection_reasons(self, contract: AttentionContract,
                          platform: str | None) -> tuple[str, ...]:
        if self.capability is None:
            return ("no AttentionBackendCapability declared (undeclared backends are never "
                    "dispatched by contract)",)
        reasons: list[str] = []
        if platform is not None and platform != self.platform:
            reasons.append(f"platform={self.platform}, requested platform={platform}")
        reasons.extend(self.capability.incompatibilities(contract))
        if not reasons and self.available is not None:  # probe only a backend that would serve
            why = self.available()
            if why:
                reasons.append(f"unavailable: {why}")
        return tuple(reasons)


@dataclass(frozen=True)
class DispatchProvenance:
    requested_backend: str
    actual_backend: str
    implementation_kind: str
    platform: str
    communication_backend: str | None
    production_ready: bool
    fallback: bool
    fallback_reason: str | None
    prior_rejections: dict[str, tuple[str, ...]]
    policy_skipped: tuple[str, ...]
    contract: dict[str, Any]
    capability: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested_backend": self.requested_backend,
            "actual_backend": self.actual_backend,
            "implementation_kind": self.implementation_kind,
            "platform": self.platform,
            "communication_backend": self.communication_backend,
            "production_ready": self.production_ready,
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
            "prior_rejections": {k: list(v) for k, v in self.prior_rejections.items()},
            "policy_skipped": list(self.policy_skipped),
            "contract": self.contract,
            "capability": self.capability,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class DispatchResult:
    op: Callable[..., Any]
    provenance: DispatchProvenance

    @property
    def capability(self) -> dict[str, Any]:
        return self.provenance.capability


@dataclass(frozen=True)
class DispatchExplanation:
    """Everything ``dispatch explain`` prints: the decision and every backend's reasons."""

    requested_backend: str
    platform: str | None
    selected: str | None
    fallback: bool
    refusal: str | None  # why dispatch failed (policy refusal or no backend)
    rejections: dict[str, tuple[str, ...]]  # every backend, in priority order
    policy_skipped: tuple[str, ...]
    provenance: DispatchProvenance | None

    def to_dict(self) -> dict[str, Any]:
        return {"requested_backend": self.requested_backend, "platform": self.platform,
                "selected": self.selected, "fallback": self.fallback, "refusal": self.refusal,
                "rejections": {k: list(v) for k, v in self.rejections.items()},
                "policy_skipped": list(self.policy_skipped),
                "provenance": None if self.provenance is None else self.provenance.to_dict()}


@dataclass
class AttentionRegistry:
    ops: dict[str, Callable[..., Any]] = field(default_factory=dict)
    backends: list[AttentionBackend] = field(default_factory=list)

    # -- plain ops ---------------------------------------------------------------------------
    def register_op(self, name: str, fn: Callable[..., Any], *, replace: bool = False) -> None:
        if name in self.ops and not replace:
            raise ValueError(f"op {name!r} is already registered")
        self.ops[name] = fn

    def get_op(self, name: str) -> Callable[..., Any]:
        if name not in self.ops:
            raise UnsupportedConfiguration(
                f"no op named {name!r} is registered; known ops: {sorted(self.ops)}")
        return self.ops[name]

    # -- attention backends ------------------------------------------------------------------
    def register_attention_backend(self, backend_id: str, op: Callable[..., Any],
                                   capability: AttentionBackendCapability | None = None, *,
                                   platform: str = "cpu",
                                   available: Callable[[], str | None] | None = None,
                                   communication: str | None = None,
                                   prepend: bool = False) -> AttentionBackend:
        """Register an attention backend that is not a kernel bundle (``capability=None``:
        undeclared, never dispatched by contract)."""
        return self._add(AttentionBackend(backend_id, op, capability, platform, available,
                                          communication), prepend)

    def register_bundle(self, bundle: Backend, *, prepend: bool = False) -> AttentionBackend:
        """Register a kernel bundle of the kernel registry (module docstring); its contract op
        is also ``get_op(bundle.contract_id)``."""
        entry = self._add(AttentionBackend(
            bundle.contract_id, bundle.ops.paged_attention,
            AttentionBackendCapability.from_bundle(bundle), bundle.capability.platform,
            bundle.available, None, bundle), prepend)
        self.register_op(bundle.contract_id, bundle.ops.paged_attention)
        return entry

    def _add(self, backend: AttentionBackend, prepend: bool) -> AttentionBackend:
        backend_id, capability = backend.backend_id, backend.capability
        if any(b.backend_id == backend_id for b in self.backends):
            raise ValueError(f"attention backend {backend_id!r} is already registered")
        if backend_id in POLICIES or backend_id == "deterministic":
            raise ValueError(f"{backend_id!r} is a dispatch policy name, not a backend id")
        if capability is not None and capability.backend_id != backend_id:
            raise ValueError(f"capability.backend_id {capability.backend_id!r} must equal the "
                             f"registered id {backend_id!r}")
        if prepend:
            self.backends.insert(0, backend)
        else:
            self.backends.append(backend)
        return backend

    def backend(self, backend_id: str) -> AttentionBackend:
        for b in self.backends:
            if b.backend_id == backend_id:
                return b
        raise UnsupportedConfiguration(
            f"unknown attention backend {backend_id!r}; registered: "
            f"{[b.backend_id for b in self.backends]}; policies: {list(POLICIES)}")

    def explain(self, contract: AttentionContract, *, requested_backend: str = "auto",
                platform: str | None = None) -> DispatchExplanation:
        """The dispatch decision without raising (used by ``get_attention_op`` and the CLI)."""
        if not isinstance(contract, AttentionContract):
            raise TypeError(f"contract must be an AttentionContract, got {type(contract)}")
        every = {b.backend_id: b.rejection_reasons(contract, platform) for b in self.backends}
        refusal = _policy_refusal(contract, requested_backend)
        if refusal is None and requested_backend not in POLICIES:
            try:
                self.backend(requested_backend)
            except UnsupportedConfiguration as e:
                refusal = str(e)
        if refusal is not None:
            return DispatchExplanation(requested_backend, platform, None, False, refusal, every,
                                       (), None)
        if requested_backend in POLICIES:
            kinds = _POLICY_KINDS[requested_backend]
            skipped = tuple(b.backend_id for b in self.backends if b.capability is not None
                            and b.capability.implementation_kind not in kinds)
            walk = [b for b in self.backends if b.backend_id not in skipped]
        else:
            skipped = ()
            walk = [self.backend(requested_backend)]
        prior: dict[str, tuple[str, ...]] = {}
        for b in walk:
            reasons = every[b.backend_id]
            if reasons:
                prior[b.backend_id] = reasons
                continue
            assert b.capability is not None
            fallback = bool(prior)
            prov = DispatchProvenance(
                requested_backend=requested_backend, actual_backend=b.backend_id,
                implementation_kind=b.capability.implementation_kind.value,
                platform=b.platform, communication_backend=b.communication,
                production_ready=b.capability.implementation_kind is ImplementationKind.PRODUCTION,
                fallback=fallback,
                fallback_reason=(format_rejections(prior) if fallback else None),
                prior_rejections=prior, policy_skipped=skipped, contract=contract.to_dict(),
                capability=b.capability.to_dict())
            return DispatchExplanation(requested_backend, platform, b.backend_id, fallback, None,
                                       every, skipped, prov)
        where = platform or "any platform"
        sh = contract.sharding
        refusal = (
            f"No attention backend supports the requested contract on {where}: "
            f"role={contract.role.value}, mode={contract.mode.value}, "
            f"dtype={contract.dtype.value}, TP={sh.tp_world_size}, CP={sh.cp_world_size}, "
            f"packed={sh.is_packed}, kv_cache={contract.kv_cache is not None}, "
            f"rope={'none' if contract.rope is None else contract.rope.fusion_boundary.value}"
            f" (requested_backend={requested_backend!r}). "
            f"Rejections: {format_rejections(prior) or 'none'}"
            + (f". Skipped by policy: {list(skipped)}" if skipped else ""))
        return DispatchExplanation(requested_backend, platform, None, False, refusal, every,
                                   skipped, None)

    def get_attention_op(self, contract: AttentionContract, *, requested_backend: str = "auto",
                         platform: str | None = None) -> DispatchResult:
        ex = self.explain(contract, requested_backend=requested_backend, platform=platform)
        if ex.selected is None or ex.provenance is None:
            raise AttentionDispatchError(ex.refusal or "no backend", ex.rejections)
        return DispatchResult(self.backend(ex.selected).op, ex.provenance)


def _policy_refusal(contract: AttentionContract, requested: str) -> str | None:
    if requested == "deterministic":
        return ("'deterministic' is not a dispatch policy: request determinism through the "
                "contract's ReductionSpec and name a backend whose capability declares "
                "deterministic_cp_merge")
    cp = contract.sharding.cp_world_size
    if cp > 1 and requested in POLICIES:
        return (f"CP={cp} requires an explicitly named backend (requested_backend="
                f"{requested!r}): per-rank automatic resolution could diverge across ranks")
    return None


