"""``AttentionBackendCapability``: the layouts and semantics one backend truthfully supports.

``incompatibilities(contract)`` lists every reason a contract is out of the backend's reach
(role, mode, dtype, head_dim, TP/CP degree, attention-domain LSE export, deterministic CP merge,
packed varlen, KV-cache identity, non-causal, RoPE metadata, fused RoPE+Attention boundary,
modes that need a cache, batch invariance); ``supports`` is "no reasons". Re-exported by
``pagedhybrid.attention.contract``.

A kernel bundle of the one kernel registry (``pagedhybrid.kernels.registry``) declares a
``BundleCapability``; its attention-contract capability is derived from that here, in one
place (``from_bundle``): the bundle's contract op is a PagedAttention over packed varlen
queries and a paged KV cache (role ``infer``, every mode), with the bundle's dtypes, head-dim
limit, LSE export, batch invariance, TP/CP degrees and RoPE support.

``batch_invariant``: every output row is bitwise the same whatever else is in the call, where
the row sits in the packed stream, how the sequence's tokens were chunked over calls and which
pages hold its keys -- the property ``ReductionSpec.batch_invariant`` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedhybrid import dtypes
from pagedhybrid.attention.fields import (
    AttentionDType,
    AttentionMode,
    AttentionRole,
    Checker,
    ImplementationKind,
    JsonObject,
)

if TYPE_CHECKING:
    from pagedhybrid.attention.contract import AttentionContract
    from pagedhybrid.kernels.registry import Backend


@dataclass(frozen=True)
class AttentionBackendCapability(JsonObject):
    """The layouts and semantics one backend explicitly (and truthfully) supports."""

    backend_id: str
    roles: tuple[AttentionRole, ...]
    modes: tuple[AttentionMode, ...]
    dtypes: tuple[AttentionDType, ...]
    cp_world_sizes: tuple[int, ...] | None = (1,)  # None: any CP degree
    tp_world_sizes: tuple[int, ...] | None = None  # None: any TP degree
    exports_attention_lse: bool = False
    deterministic_cp_merge: bool = False
    supports_packed_varlen: bool = False
    supports_kv_cache: bool = False
    implementation_kind: ImplementationKind = ImplementationKind.REFERENCE
    supports_rope_metadata: bool = False
    supports_fused_rope_attention: bool = False
    head_dims: tuple[int, ...] | None = None  # None: any head_dim
    max_head_dim: int | None = None  # None: no upper bound
    supports_non_causal: bool = True
    kv_cache_modes: tuple[AttentionMode, ...] = ()  # modes in which K/V must come from a cache
    batch_invariant: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        c = Checker("AttentionBackendCapability")
        c.check(isinstance(self.backend_id, str) and self.backend_id != "", "backend_id",
                "must be a non-empty string", self.backend_id)
        for name, enum in (("roles", AttentionRole), ("modes", AttentionMode),
                           ("dtypes", AttentionDType)):
            vals = tuple(c.enum(enum, v, name) for v in getattr(self, name))
            c.check(len(vals) >= 1, name, "must not be empty", [])
            object.__setattr__(self, name, vals)
        object.__setattr__(self, "kv_cache_modes", tuple(
            c.enum(AttentionMode, v, "kv_cache_modes") for v in self.kv_cache_modes))
        c.check(self.supports_kv_cache or not self.kv_cache_modes, "kv_cache_modes",
                "requires supports_kv_cache", list(self.kv_cache_modes))
        c.check(self.max_head_dim is None or (isinstance(self.max_head_dim, int)
                                               and self.max_head_dim >= 1),
                "max_head_dim", "must be None or an int >= 1", self.max_head_dim)
        for name in ("cp_world_sizes", "tp_world_sizes", "head_dims"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, c.ints(getattr(self, name), name, minimum=1))
        object.__setattr__(self, "implementation_kind",
                           c.enum(ImplementationKind, self.implementation_kind,
                                  "implementation_kind"))
        c.check(self.exports_attention_lse or not self.deterministic_cp_merge,
                "deterministic_cp_merge", "requires exports_attention_lse (the merge consumes "
                "(out, lse) partial states)", True)
        c.check(self.supports_rope_metadata or not self.supports_fused_rope_attention,
                "supports_fused_rope_attention", "requires supports_rope_metadata", True)

    def incompatibilities(self, contract: AttentionContract) -> tuple[str, ...]:
        """Every reason this backend cannot materialise ``contract`` (empty when it can)."""
        r: list[str] = []
        sh = contract.sharding
        if contract.role not in self.roles:
            r.append(f"role={contract.role.value} is unsupported")
        if contract.mode not in self.modes:
            r.append(f"mode={contract.mode.value} is unsupported")
        r.extend(self._common_gaps(contract.dtype, contract.head_dim,
                                   contract.reduction.batch_invariant))
        if self.tp_world_sizes is not None and sh.tp_world_size not in self.tp_world_sizes:
            r.append(f"TP={sh.tp_world_size} is unsupported")
        if self.cp_world_sizes is not None and sh.cp_world_size not in self.cp_world_sizes:
            r.append(f"CP={sh.cp_world_size} is unsupported")
        if contract.export_lse and not self.exports_attention_lse:
            r.append("attention-domain LSE export is unsupported")
        if sh.cp_world_size > 1 and not self.deterministic_cp_merge:
            r.append("deterministic CP (out, lse) merge is unsupported")
        if sh.is_packed and not self.supports_packed_varlen:
            r.append("packed varlen layout is unsupported")
        if contract.kv_cache is not None and not self.supports_kv_cache:
            r.append("KV-cache identity materialization is unsupported")
        if contract.kv_cache is None and contract.mode in self.kv_cache_modes:
            r.append(f"mode={contract.mode.value} without a KV cache is unsupported")
        if not contract.causal and not self.supports_non_causal:
            r.append("non-causal attention is unsupported")
        if contract.rope is not None:
            if not self.supports_rope_metadata:
                r.append("RoPE/position metadata is unsupported")
            if contract.rope.fused and not self.supports_fused_rope_attention:
                r.append("fused RoPE+Attention boundary is unsupported")
        return tuple(r)

    def supports(self, contract: AttentionContract) -> bool:
        return not self.incompatibilities(contract)

    def _common_gaps(self, dtype: AttentionDType, head_dim: int, batch_invariant: bool
                     ) -> list[str]:
        r = []
        if dtype not in self.dtypes:
            r.append(f"dtype={dtype.value} is unsupported")
        if self.head_dims is not None and head_dim not in self.head_dims:
            r.append(f"head_dim={head_dim} is unsupported")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            r.append(f"head_dim={head_dim} is unsupported (at most {self.max_head_dim})")
        if batch_invariant and not self.batch_invariant:
            r.append("batch-invariant reduction is unsupported (its rows depend on the batch: "
                     "GEMM kernels and K splits chosen by shape, chunked prefill forms)")
        return r

    @classmethod
    def from_bundle(cls, bundle: Backend) -> AttentionBackendCapability:
        """The contract capability of a kernel bundle's PagedAttention (module docstring)."""
        cap = bundle.capability
        rope = cap.rope_in_op
        return cls(
            backend_id=bundle.contract_id, roles=("infer",),
            modes=("prefill", "chunked_prefill", "decode"),
            dtypes=tuple(dtypes.lookup(d).cli for d in cap.dtypes
                         if dtypes.lookup(d).cli is not None),
            cp_world_sizes=cap.cp_world_sizes, tp_world_sizes=cap.tp_world_sizes,
            exports_attention_lse=cap.exports_lse, supports_packed_varlen=True,
            supports_kv_cache=True, implementation_kind=cap.implementation_kind,
            supports_rope_metadata=rope, supports_fused_rope_attention=rope,
            max_head_dim=cap.max_head_dim, batch_invariant=cap.batch_invariant,
            description=f"com.microsoft.PagedAttention and the model's step of the "
                        f"{bundle.name!r} kernel bundle ({bundle.description})"
                        + ("" if cap.exports_lse else "; no LSE"))
