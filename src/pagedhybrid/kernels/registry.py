"""The one kernel registry: kernel bundles, their typed capabilities, and selection by needs.

A ``Backend`` (a kernel bundle) holds, for one implementation family:

* ``step`` (``StepKernels``), the model's step seam -- ``attention``, ``causal_conv``,
  ``gated_delta``: one layer's operator on a validated ``StepMetadata``, with KV pages and conv /
  recurrent state pools updated in place (signatures in ``kernels/cpu/seam.py``);
* ``modules`` (``ModuleKernels``), what the model's modules compute with: ``linear_for(dtype)``
  (every projection's and the LM head's product in a ``dtype`` model; None =
  ``torch.nn.functional.linear``), ``quantized_linear`` (the product of an int8 / int4
  projection weight: ``x``, a ``weightquant.QuantizedWeight``; ``kernels/native/quant.py``),
  ``pointwise`` (silu and sigmoid), ``norms`` (RMS, gated RMS and L2 norms) and ``moe`` (a
  mixture-of-experts block's routed experts and shared expert in one call after its router;
  ``kernels/native/moe.py``; None: the layer groups tokens by expert in torch) -- torch's by
  default; each module that uses them is a ``UsesKernels`` and takes its own;
* optionally ``fused`` (``FusedDecode``: the Gated DeltaNet mixer of a step of decodes in one
  call, a whole decoder layer of either kind, the whole decode step, and ``why_not``, the step
  test they share -- the runner's executors ask it before they run a step through them) and
  ``mtp`` (``MtpKernels``: the MTP head around its layer, the drafter's chain and its whole
  step; each returns None for a step it does not fuse, and the head then runs its modules) --
  signatures in ``kernels/native/seam.py``; ``capture``, the speculative verify step's kernels
  (``kernels.capsule.StateCapture``: the recurrent state's capture and replay; None: the bundle
  cannot verify drafts);
* the three operator contracts with the signatures of ``pagedhybrid.ops`` (``ops``), each
  validating its call fully (contract entry points), with ``ops.coverage``: per op type an
  ``OpCoverage`` -- the dtypes and contract features its fast path computes, and each feature it
  hands to the reference on purpose, with why; ``contract_id`` names its PagedAttention in
  attention-contract dispatch;
* ``capability`` -- a ``BundleCapability``, the one declaration of what it serves (below);
* ``available()`` -- why it cannot run in this process (None: it can), e.g. the prebuilt native
  extension is missing or stale. Probed only for a bundle whose capability fits.

``BundleCapability`` (frozen): activation ``dtypes``; ``kv_page_dtypes`` (element types of the KV
pages it reads and writes, quantized ones included); ``max_head_dim``; ``in_place_state`` (state
rows updated in their pool), ``paged_in_place`` (attention reads pages without gathering the
context), ``state_checkpoints`` (the linear layers emit intermediate states, which prefix caching
needs), ``state_capture`` (verify steps: compact state updates captured, accepted ones
replayed -- speculative decoding needs it), ``batch_invariant`` (every row bitwise independent
of the batch), ``exports_lse``,
``moe_batch_invariant`` (its ``modules.moe`` keeps each token's arithmetic independent of the tokens
that picked the same experts; needed with batch invariance on a mixture-of-experts model),
``quantized_weights`` (its ``modules.quantized_linear`` multiplies int8 / int4 weights held as
``weightquant.QuantizedWeight``; needed by a model quantised with ``--quantization``),
``rope_in_op`` (its contract op rotates q/k itself), ``tp_world_sizes`` / ``cp_world_sizes``,
``implementation_kind`` and ``platform``. ``gaps(needs)`` lists every reason it falls short.

Data path (one seam for the model and for contract dispatch):

    caller's Needs(backend, dtype, config, prefix_caching, kv_page_dtype, batch_invariant, ...)
      -> KernelRegistry.select(needs): walk the bundles in priority order ("auto") or only the
         named one; rejections[name] = capability.gaps(needs) or, if none, (available(),)
      -> Selection(backend, reason, rejections, needs): the first bundle with no rejection;
         ``reason`` says why it runs and why each earlier bundle was passed over;
      -> nothing fits: UnsupportedConfiguration naming every bundle's reasons (never a silent
         fallback, never a substitute for a named bundle).

``pagedhybrid.kernels.backend`` declares the four bundles and holds the process's registry
(``REGISTRY``); the attention layer's contract dispatch (``pagedhybrid.attention.backends``)
registers those same bundle objects, deriving each one's ``AttentionBackendCapability`` from its
``BundleCapability`` in one place (``AttentionBackendCapability.from_bundle``). This module
imports nothing above the kernels layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pagedhybrid.dtypes import logical_name, lookup
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

AUTO = "auto"
KINDS = ("production", "reference")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype in reasons: ``fp32`` / ``bf16`` / ``fp16`` or its logical name."""
    et = lookup(dtype)
    return et.cli or et.logical


@dataclass(frozen=True)
class OpCoverage:
    """What one fast kernel of an operator contract computes itself, and what it hands to the
    reference on purpose (never a silent fallback: the kernel routes those calls explicitly).

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


class ContractOps(NamedTuple):
    """The three operator contracts (signatures of ``pagedhybrid.ops``) and, per op type, what
    each fast kernel covers (``coverage``; absent: the op is the reference, covering all)."""

    paged_attention: Callable[..., tuple[Any, ...]]
    varlen_causal_conv: Callable[..., tuple[Any, ...]]
    gated_delta_net: Callable[..., tuple[Any, ...]]
    coverage: Mapping[str, OpCoverage] = {}


class Pointwise(NamedTuple):
    """The elementwise nonlinearities the layers apply (same shape and dtype out as in)."""

    silu: Callable[[torch.Tensor], torch.Tensor]
    sigmoid: Callable[[torch.Tensor], torch.Tensor]


TORCH_POINTWISE = Pointwise(F.silu, torch.sigmoid)


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _torch_rms(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    y = _rms_scaled(x, eps)
    return (y * ((1.0 + w.float()) if offset else w.float())).to(x.dtype)


def _torch_gated(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float,
                 silu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return (_rms_scaled(x, eps) * w.float() * silu(gate.float())).to(x.dtype)


def _torch_l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)


class Norms(NamedTuple):
    """The row-wise normalisations the layers apply, over the last axis, fp32 math:

    * ``rms(x, w, eps, offset)`` -- ``x * rsqrt(mean(x^2) + eps) * (1 + w if offset else w)``,
      in ``x``'s dtype (HF ``Qwen3_5RMSNorm``: offset);
    * ``gated(x, gate, w, eps, silu)`` -- ``x * rsqrt(mean(x^2) + eps) * w * silu(gate)``, in
      ``x``'s dtype (HF ``Qwen3_5RMSNormGated``); ``silu`` is the bundle's ``pointwise.silu``
      (a bundle with its own fused form may ignore it);
    * ``l2(x, eps)`` -- ``x * rsqrt(sum(x^2) + eps)`` in fp32 (HF ``l2norm`` of q / k).
    """

    rms: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
    gated: Callable[..., torch.Tensor]
    l2: Callable[[torch.Tensor, float], torch.Tensor]


TORCH_NORMS = Norms(_torch_rms, _torch_gated, _torch_l2)


@dataclass(frozen=True)
class Needs:
    """What a caller needs from the model's kernels (the engine builds one per engine).

    ``backend``: ``"auto"`` or one bundle's name. ``config``: the model config (its ``head_dim``
    is checked unless ``head_dim`` is given). ``prefix_caching`` needs state checkpoints,
    ``speculative`` (speculative decoding) state capture.
    ``kv_page_dtype``: the KV pages' element type (None: the activation ``dtype``).
    """

    backend: str = AUTO
    dtype: torch.dtype = torch.float32
    config: Any = None
    head_dim: int | None = None
    prefix_caching: bool = False
    speculative: bool = False
    kv_page_dtype: torch.dtype | None = None
    batch_invariant: bool = False
    exports_lse: bool = False
    tp_world_size: int = 1
    cp_world_size: int = 1
    weight_format: str | None = None  # projections in int8 / int4 (weightquant); None: dtype

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_page_dtype"):
            v = getattr(self, name)
            if not (isinstance(v, torch.dtype) or (v is None and name == "kv_page_dtype")):
                raise ContractViolation("Needs", name, "must be a torch.dtype", v)
        for name in ("tp_world_size", "cp_world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ContractViolation("Needs", name, "must be an int >= 1", v)
        if not isinstance(self.backend, str) or not self.backend:
            raise ContractViolation("Needs", "backend", "must be 'auto' or a bundle name",
                                    self.backend)

    @property
    def mixture_of_experts(self) -> bool:
        """The model's feed-forward is a mixture of experts (``config.num_experts``)."""
        return bool(getattr(self.config, "num_experts", 0))

    @property
    def model_head_dim(self) -> int | None:
        if self.head_dim is not None:
            return int(self.head_dim)
        hd = getattr(self.config, "head_dim", None)
        return None if hd is None else int(hd)

    @property
    def page_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_page_dtype is None else self.kv_page_dtype

    def describe(self) -> str:
        """One line: what was asked for (used in refusals)."""
        parts = [f"dtype {dtype_name(self.dtype)}"]
        if self.weight_format is not None:
            parts.append(f"{self.weight_format} weights")
        if self.model_head_dim is not None:
            parts.append(f"head_dim {self.model_head_dim}")
        if self.kv_page_dtype is not None and self.kv_page_dtype != self.dtype:
            parts.append(f"KV pages {dtype_name(self.kv_page_dtype)}")
        for flag, text in ((self.prefix_caching, "prefix caching"),
                           (self.speculative, "speculative decoding"),
                           (self.batch_invariant, "batch invariance"),
                           (self.exports_lse, "LSE export")):
            if flag:
                parts.append(text)
        if self.tp_world_size > 1:
            parts.append(f"TP={self.tp_world_size}")
        if self.cp_world_size > 1:
            parts.append(f"CP={self.cp_world_size}")
        return ", ".join(parts)


@dataclass(frozen=True)
class BundleCapability:
    """What one kernel bundle truthfully serves (see the module docstring)."""

    dtypes: tuple[torch.dtype, ...]
    kv_page_dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None = None  # None: any head_dim
    in_place_state: bool = False
    paged_in_place: bool = False
    state_checkpoints: bool = False
    state_capture: bool = False
    batch_invariant: bool = False
    moe_batch_invariant: bool = False  # expert products independent of the other tokens
    quantized_weights: bool = False  # int8 / int4 products (its modules.quantized_linear)
    exports_lse: bool = False
    rope_in_op: bool = False
    tp_world_sizes: tuple[int, ...] | None = None  # None: any (the step runs on local heads)
    cp_world_sizes: tuple[int, ...] | None = (1,)  # None: any
    implementation_kind: str = "production"
    platform: str = "cpu"

    def __post_init__(self) -> None:
        if not self.dtypes:
            raise ContractViolation("BundleCapability", "dtypes", "must not be empty", [])
        if self.implementation_kind not in KINDS:
            raise ContractViolation("BundleCapability", "implementation_kind",
                                    f"must be one of {list(KINDS)}", self.implementation_kind)
        if self.max_head_dim is not None and self.max_head_dim < 1:
            raise ContractViolation("BundleCapability", "max_head_dim", "must be >= 1",
                                    self.max_head_dim)

    def gaps(self, needs: Needs, name: str = "this bundle") -> tuple[str, ...]:
        """Every reason the bundle ``name`` cannot serve ``needs`` (empty when it can)."""
        r: list[str] = []
        if needs.dtype not in self.dtypes:
            r.append(f"dtype={dtype_name(needs.dtype)} is unsupported (it serves "
                     f"{', '.join(dtype_name(d) for d in self.dtypes)})")
        if needs.page_dtype not in self.kv_page_dtypes:
            r.append(f"KV pages of {dtype_name(needs.page_dtype)} are unsupported (it reads "
                     f"{', '.join(dtype_name(d) for d in self.kv_page_dtypes)})")
        hd = needs.model_head_dim
        if hd is not None and self.max_head_dim is not None and hd > self.max_head_dim:
            r.append(f"{name} attention needs head_dim <= {self.max_head_dim} ({hd})")
        if needs.prefix_caching and not self.state_checkpoints:
            r.append("prefix caching needs state checkpoints (the linear layers' intermediate "
                     "states), which these kernels do not emit; use a bundle that does or turn "
                     "prefix caching off (enable_prefix_caching=False)")
        if needs.speculative and not self.state_capture:
            r.append("speculative decoding needs compact state capture and replay in verify "
                     "steps, which these kernels do not have")
        if needs.batch_invariant and not self.batch_invariant:
            r.append("batch-invariant reduction is unsupported (its rows depend on the batch: "
                     "GEMM kernels and K splits chosen by shape, chunked prefill forms)")
        if needs.batch_invariant and needs.mixture_of_experts and not self.moe_batch_invariant:
            r.append("batch-invariant mixture of experts is unsupported (each expert's rows are "
                     "one product over the tokens that picked it, so a token's arithmetic "
                     "depends on the others)")
        if needs.weight_format is not None and not self.quantized_weights:
            r.append(f"{needs.weight_format} weights are unsupported (no product of int8 / int4 "
                     "weights; the native bundles have one)")
        if needs.exports_lse and not self.exports_lse:
            r.append("attention-domain LSE export is unsupported")
        if self.tp_world_sizes is not None and needs.tp_world_size not in self.tp_world_sizes:
            r.append(f"TP={needs.tp_world_size} is unsupported")
        if self.cp_world_sizes is not None and needs.cp_world_size not in self.cp_world_sizes:
            r.append(f"CP={needs.cp_world_size} is unsupported")
        return tuple(r)

    def describe(self) -> dict[str, object]:
        """JSON-able summary."""
        return {"dtypes": [dtype_name(d) for d in self.dtypes],
                "kv_page_dtypes": [dtype_name(d) for d in self.kv_page_dtypes],
                "max_head_dim": self.max_head_dim, "in_place_state": self.in_place_state,
                "paged_in_place": self.paged_in_place,
                "state_checkpoints": self.state_checkpoints,
                "state_capture": self.state_capture,
                "batch_invariant": self.batch_invariant,
                "moe_batch_invariant": self.moe_batch_invariant,
                "quantized_weights": self.quantized_weights, "exports_lse": self.exports_lse,
                "rope_in_op": self.rope_in_op,
                "tp_world_sizes": None if self.tp_world_sizes is None else
                list(self.tp_world_sizes),
                "cp_world_sizes": None if self.cp_world_sizes is None else
                list(self.cp_world_sizes),
                "implementation_kind": self.implementation_kind, "platform": self.platform}


def _always() -> str | None:
    return None


LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (x [T, H], index [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I],
#  shared (gate_proj, up_proj, down_proj, shared_gate) | None) -> [T, H]
MoeFn = Callable[..., torch.Tensor]
# (x [..., K], weightquant.QuantizedWeight of [N, K]) -> [..., N] in x's dtype
QLinearFn = Callable[[torch.Tensor, Any], torch.Tensor]


def _torch_linear(dtype: torch.dtype) -> LinearFn | None:
    return None


class StepKernels(NamedTuple):
    """A bundle's step seam: one layer's operator on a validated ``StepMetadata``, KV pages and
    conv / recurrent state pools updated in place (signatures in ``kernels/cpu/seam.py``)."""

    attention: Callable[..., torch.Tensor]
    causal_conv: Callable[..., torch.Tensor]
    gated_delta: Callable[..., torch.Tensor]


class ModuleKernels(NamedTuple):
    """What a model's modules compute with (torch's by default): ``linear_for(dtype)`` -- the
    product of every projection and the LM head in a ``dtype`` model (None:
    ``torch.nn.functional.linear``); ``quantized_linear`` -- the product of an int8 / int4
    weight (None: the bundle has none); ``pointwise`` (silu, sigmoid); ``norms``; ``moe`` -- a
    mixture-of-experts block's experts in one call (None: grouped by expert in torch)."""

    linear_for: Callable[[torch.dtype], LinearFn | None] = _torch_linear
    quantized_linear: QLinearFn | None = None
    pointwise: Pointwise = TORCH_POINTWISE
    norms: Norms = TORCH_NORMS
    moe: MoeFn | None = None


TORCH_MODULES = ModuleKernels()


class UsesKernels:
    """A module that computes with its bundle's ``ModuleKernels`` (``kernels``: torch's until
    the model hands it its bundle's with ``use_kernels``)."""

    kernels: ModuleKernels = TORCH_MODULES

    def use_kernels(self, kernels: ModuleKernels, dtype: torch.dtype) -> None:
        self.kernels = kernels


@dataclass(frozen=True)
class Backend:
    """One kernel bundle (see the module docstring)."""

    name: str
    description: str
    contract_id: str  # its PagedAttention's id in attention-contract dispatch
    capability: BundleCapability
    step: StepKernels
    ops: ContractOps
    available: Callable[[], str | None] = field(default=_always)
    modules: ModuleKernels = TORCH_MODULES
    fused: FusedDecode | None = None  # whole layers / the whole decode step in one call
    mtp: MtpKernels | None = None  # the MTP head's fused kernels
    capture: Any = None  # kernels.capsule.StateCapture (this module imports nothing above it)

    def __post_init__(self) -> None:
        if self.capability.quantized_weights != (self.modules.quantized_linear is not None):
            raise ContractViolation("Backend", "modules.quantized_linear",
                                    "must be given exactly when the capability declares "
                                    "quantized_weights", self.name)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self.capability.dtypes

    @property
    def batch_invariant(self) -> bool:
        return self.capability.batch_invariant

    @property
    def features(self) -> frozenset[str]:
        """Deprecated string view of the capability's flags (read ``capability`` instead)."""
        c = self.capability
        return frozenset(n for n in ("in_place_state", "paged_in_place", "state_checkpoints",
                                     "state_capture")
                         if getattr(c, n))

    def rejections(self, needs: Needs) -> tuple[str, ...]:
        """Why this bundle cannot serve ``needs``: its capability's gaps, or, when it fits,
        why it cannot run in this process (empty: it serves)."""
        gaps = self.capability.gaps(needs, self.name)
        if gaps:
            return gaps
        why = self.available()
        return (why,) if why else ()

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description,
                "contract_id": self.contract_id,
                "dtypes": [dtype_name(d) for d in self.dtypes],
                "features": sorted(self.features), "batch_invariant": self.batch_invariant,
                "op_coverage": {op: c.describe() for op, c in self.ops.coverage.items()},
                "capability": self.capability.describe(), "unavailable": self.available()}


class FusedDecode(NamedTuple):
    """A bundle's fused decode path (``kernels/native/seam.py``): ``mixer`` -- the Gated
    DeltaNet mixer of a step of decodes (and verify chunks) in one call, None for any other step
    (the module then runs its ops); ``gdn_layer`` / ``attention_layer`` -- a whole decoder layer
    in one call; ``stack`` -- binds a model's whole decode step as one call (``DecodeStack``);
    ``why_not(meta, rows, dtype, matmul, quantized)`` -- why a step's layers do not fuse (None:
    they do), the test the runner's layers executor makes before it runs a step through them."""

    mixer: Callable[..., torch.Tensor | None]
    gdn_layer: Callable[..., torch.Tensor]
    attention_layer: Callable[..., torch.Tensor]
    why_not: Callable[..., str | None]
    stack: Callable[..., Any]


class MtpKernels(NamedTuple):
    """A bundle's MTP head kernels (``kernels/native/seam.py``), each None for a step it does
    not fuse: the head's input before its layer, its output after it (the drafter's greedy
    picks), the drafter's whole chain, and its catch-up and chain in one call."""

    head_input: Callable[..., torch.Tensor | None]
    head_output: Callable[..., tuple[torch.Tensor, torch.Tensor] | None]
    chain: Callable[..., tuple[torch.Tensor, torch.Tensor] | None]
    draft: Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


class Selection(NamedTuple):
    backend: Backend
    reason: str  # why this bundle runs (and why earlier ones do not)
    rejections: dict[str, tuple[str, ...]]  # bundles passed over, with their reasons
    needs: Needs | None = None


def format_rejections(rejections: dict[str, tuple[str, ...]]) -> str:
    return " | ".join(f"{k}: {'; '.join(v)}" for k, v in rejections.items())


class KernelRegistry:
    """Kernel bundles in priority order (registration order); see the module docstring."""

    def __init__(self, bundles: tuple[Backend, ...] = ()) -> None:
        self._bundles: dict[str, Backend] = {}
        for b in bundles:
            self.register(b)

    def register(self, bundle: Backend) -> Backend:
        if not isinstance(bundle, Backend):
            raise TypeError(f"a kernel bundle must be a Backend, got {type(bundle).__name__}")
        if bundle.name == AUTO or bundle.name in self._bundles:
            raise ValueError(f"kernel bundle {bundle.name!r} is already registered or reserved")
        if any(b.contract_id == bundle.contract_id for b in self._bundles.values()):
            raise ValueError(f"contract id {bundle.contract_id!r} is already registered")
        self._bundles[bundle.name] = bundle
        return bundle

    def __iter__(self) -> Iterator[Backend]:
        return iter(tuple(self._bundles.values()))

    def __len__(self) -> int:
        return len(self._bundles)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._bundles)

    def bundle(self, name: str) -> Backend:
        """The bundle ``name``; an unknown name is refused with the known ones."""
        if name not in self._bundles:
            raise UnsupportedConfiguration(
                f"unknown kernel backend {name!r}; choose one of {AUTO}, "
                f"{', '.join(self._bundles)}")
        return self._bundles[name]

    def rejections(self, needs: Needs) -> dict[str, tuple[str, ...]]:
        """Every bundle's reasons against ``needs`` (empty tuple: it would serve)."""
        return {b.name: b.rejections(needs) for b in self}

    def select(self, needs: Needs) -> Selection:
        """The bundle for ``needs`` (module docstring); raises UnsupportedConfiguration."""
        walk = tuple(self) if needs.backend == AUTO else (self.bundle(needs.backend),)
        rejections: dict[str, tuple[str, ...]] = {}
        for b in walk:
            reasons = b.rejections(needs)
            if reasons:
                rejections[b.name] = reasons
                continue
            how = "requested" if needs.backend != AUTO else AUTO
            passed = f"; passed over: {format_rejections(rejections)}" if rejections else ""
            return Selection(b, f"{b.name} kernels ({how}{passed})", rejections, needs)
        what = "batch-invariant " if needs.batch_invariant else ""
        raise UnsupportedConfiguration(
            f"kernel backend {needs.backend!r}: no {what}kernel bundle serves "
            f"{needs.describe()}: {format_rejections(rejections)}")


__all__ = ["AUTO", "TORCH_NORMS", "TORCH_POINTWISE", "Backend", "BundleCapability", "ContractOps",
           "KernelRegistry", "MoeFn", "Needs", "Norms", "Pointwise", "Selection", "dtype_name",
           "format_rejections"]
