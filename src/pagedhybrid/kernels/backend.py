"""The model's kernel bundles, declared once, in the process's one kernel registry.

Each bundle is a ``pagedhybrid.kernels.registry.Backend`` with its typed ``BundleCapability``
(the registry's module docstring says what each field means and how selection walks them).
Bundles, in priority order (``REGISTRY``):

* ``native``    -- the C++ kernels (``kernels/native``) for decode / short queries and state
  updates, the torch kernels for long prefill; head_dim <= 256; available when the prebuilt
  extension is present and current;
* ``native_batch_invariant`` -- the C++ kernels for everything, linear layers included, in forms
  whose per-row arithmetic does not depend on the batch (``kernels/native/invariant.py``);
  fp32 / bf16;
* ``torch``     -- the vectorised torch kernels (``kernels/cpu``);
* ``reference`` -- the op references (``pagedhybrid.ops``): the declared slow path, exact; it
  emits no state checkpoints and captures no state updates, so it cannot serve prefix caching
  or speculative decoding.

The other three capture a verify step's compact state updates and replay the accepted ones
(``Backend.capture``, ``kernels/capsule.py``): the native bundles in C++, torch in torch.
The native bundles run a mixture-of-experts block's experts in one C++ call
(``Backend.modules.moe``, ``kernels/native/moe.py``; the batch-invariant bundle its invariant
form, so it declares ``moe_batch_invariant``); torch and reference group tokens by expert in
torch.

All of them update state rows in their pools and read / write KV pages of the activation dtype
or quantized (int8 / fp8 e4m3). None exports attention-domain LSE; none runs context
parallelism; any TP degree (the step runs on the rank's local heads).

``select(needs=Needs(...))`` asks ``REGISTRY`` for the bundle (``Selection``: the bundle, why,
and every bundle passed over with its reasons). The older call form
``select(name, config, dtype, batch_invariant=...)`` builds the same ``Needs`` (without prefix
caching or a KV page dtype) and is kept until every caller passes ``needs``. ``backend(name)``
is ``REGISTRY.bundle(name)``. The attention layer's contract dispatch registers these same
objects (``pagedhybrid.attention.backends``).

``pagedhybrid kernels select [--dtype bf16 --kv-cache-dtype int8 --batch-invariant ...]``
(``select_main``) prints every bundle's capability, the choice for those needs and every
rejection (exit 1 when nothing serves them).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedhybrid import ops, weightquant
from pagedhybrid.dtypes import to_torch
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels import capsule, cpu, native
from pagedhybrid.kernels import reference as reference_seam
from pagedhybrid.kernels.cpu import seam as cpu_seam
from pagedhybrid.kernels.native import contract as native_contract
from pagedhybrid.kernels.native import dense as native_dense
from pagedhybrid.kernels.native import invariant as native_invariant
from pagedhybrid.kernels.native import moe as native_moe
from pagedhybrid.kernels.native import norms as native_norms
from pagedhybrid.kernels.native import quant as native_quant
from pagedhybrid.kernels.native import seam as native_seam
from pagedhybrid.kernels.registry import (
    AUTO,
    TORCH_POINTWISE,
    Backend,
    BundleCapability,
    ContractOps,
    KernelRegistry,
    ModuleKernels,
    Needs,
    Pointwise,
    Selection,
    StepKernels,
)
from pagedhybrid.kvquant import KV_DTYPES

DEFAULT_BACKEND = AUTO
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_DTYPES = (*_DTYPES, torch.float64)  # float64: verification only
_QUANT = tuple(KV_DTYPES.values())
NATIVE_MAX_HEAD_DIM = 256  # the native attention tile holds at most 256 dims


def _native_available() -> str | None:
    st = native.status()  # looked up on the module at call time (tests replace it)
    return None if st.available else st.reason


def _declare() -> KernelRegistry:
    native_ops = ContractOps(native_contract.paged_attention, native_contract.varlen_causal_conv,
                             native_contract.gated_delta_net, native_contract.COVERAGE)
    native_pages = (*native_contract.NATIVE_DTYPES, *native_contract.QUANT_CACHES)
    return KernelRegistry((
        Backend(
            "native", "C++ kernels (kernels/native): paged decode / short-query attention, "
            "in-place state updates; torch kernels for long prefill", "native_paged_attention",
            BundleCapability(_DTYPES, native_pages, max_head_dim=NATIVE_MAX_HEAD_DIM,
                             in_place_state=True, paged_in_place=True, state_checkpoints=True,
                             state_capture=True, quantized_weights=True),
            StepKernels(native_seam.attention, native_seam.causal_conv, native_seam.gated_delta),
            native_ops, _native_available,
            ModuleKernels(native_dense.preferred_linear, native_quant.linear,
                          norms=native_norms.NATIVE_NORMS, moe=native_moe.experts),
            fused=native_seam.FUSED, mtp=native_seam.MTP, capture=native_seam.CAPTURE),
        Backend(
            "native_batch_invariant", "C++ kernels for every token and projection in "
            "batch-invariant forms (kernels/native/invariant.py)", "native_batch_invariant",
            BundleCapability(native_invariant.DTYPES, native_pages,
                             max_head_dim=NATIVE_MAX_HEAD_DIM, in_place_state=True,
                             paged_in_place=True, state_checkpoints=True, state_capture=True,
                             batch_invariant=True, moe_batch_invariant=True,
                             quantized_weights=True),
            StepKernels(native_invariant.attention, native_invariant.causal_conv,
                        native_invariant.gated_delta), native_ops, _native_available,
            ModuleKernels(lambda dtype: native_invariant.linear, native_quant.invariant_linear,
                          Pointwise(native_invariant.silu, native_invariant.sigmoid),
                          native_norms.NATIVE_NORMS, native_moe.invariant_experts),
            capture=native_seam.CAPTURE),
        Backend(
            "torch", "vectorised torch kernels (kernels/cpu)", "cpu_paged_attention",
            BundleCapability(_TORCH_DTYPES, (*_TORCH_DTYPES, *_QUANT), in_place_state=True,
                             state_checkpoints=True, state_capture=True),
            StepKernels(cpu_seam.attention, cpu_seam.causal_conv, cpu_seam.gated_delta),
            ContractOps(cpu.paged_attention, cpu.varlen_causal_conv, cpu.gated_delta_net,
                        cpu.COVERAGE), capture=capsule.StateCapture(capsule.torch_capture,
                                                                    capsule.torch_replay)),
        Backend(
            "reference", "op references (pagedhybrid.ops), exact, slow",
            "paged_attention_reference",
            BundleCapability(_TORCH_DTYPES, (*_TORCH_DTYPES, *_QUANT), rope_in_op=True,
                             quantized_weights=True, implementation_kind="reference"),
            StepKernels(reference_seam.attention, reference_seam.causal_conv,
                        reference_seam.gated_delta),
            ContractOps(ops.paged_attention, ops.varlen_causal_conv, ops.gated_delta_net),
            modules=ModuleKernels(quantized_linear=weightquant.reference_linear)),
    ))


REGISTRY: KernelRegistry = _declare()
BACKENDS: tuple[str, ...] = REGISTRY.names


def backend(name: str) -> Backend:
    """The kernel bundle ``name`` (one of ``BACKENDS``)."""
    return REGISTRY.bundle(name)


def select(name: str = DEFAULT_BACKEND, config: Any = None,
           dtype: torch.dtype = torch.float32, *, batch_invariant: bool = False,
           needs: Needs | None = None) -> Selection:
    """The bundle for ``needs`` from ``REGISTRY`` (see the module docstring).

    ``select(needs=Needs(...))`` is the call form; ``select(name, config, dtype,
    batch_invariant=...)`` is the older one (same as ``Needs(name, dtype, config,
    batch_invariant=...)``)."""
    if needs is None:
        needs = Needs(name, dtype, config, batch_invariant=batch_invariant)
    elif (name, config, dtype, batch_invariant) != (DEFAULT_BACKEND, None, torch.float32, False):
        raise TypeError("select: pass either needs=Needs(...) or the older positional form")
    return REGISTRY.select(needs)


def add_select_arguments(p: Any) -> None:
    """The ``kernels select`` options (an argparse parser): the fields of ``Needs``."""
    p.add_argument("--backend", default=DEFAULT_BACKEND,
                   help=f"auto or one bundle: {', '.join(BACKENDS)}")
    p.add_argument("--dtype", default="fp32", help="activation dtype: fp32 | bf16 | fp16")
    p.add_argument("--head-dim", type=int, default=None, help="the model's head_dim")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefix caching off (on by default, as in the engine)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help=f"KV pages: auto (= dtype) | {' | '.join(KV_DTYPES)}")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def select_main(args: Any) -> int:
    """``pagedhybrid kernels select``: the choice for the given needs and every reason."""
    dtype = to_torch(args.dtype)
    needs = Needs(args.backend, dtype, head_dim=args.head_dim,
                  prefix_caching=args.prefix_caching,
                  kv_page_dtype=None if args.kv_cache_dtype == "auto" else
                  KV_DTYPES[{"fp8": "fp8_e4m3"}.get(args.kv_cache_dtype, args.kv_cache_dtype)],
                  batch_invariant=args.batch_invariant, tp_world_size=args.tp)
    try:
        sel: Selection | None = REGISTRY.select(needs)
        refusal = None
    except UnsupportedConfiguration as e:
        sel, refusal = None, str(e)
    every = REGISTRY.rejections(needs)
    if args.json:
        print(json.dumps({"needs": needs.describe(), "selected": sel and sel.backend.name,
                          "reason": sel.reason if sel else refusal,
                          "rejections": {k: list(v) for k, v in every.items()},
                          "bundles": [b.describe() for b in REGISTRY]}, indent=2))
    else:
        print(f"needs: {needs.describe()} (backend {needs.backend})")
        print(f"selected: {sel.reason}" if sel else f"REFUSED: {refusal}")
        print("bundles (priority order):")
        for b in REGISTRY:
            mark = "selected" if sel and b is sel.backend else \
                "; ".join(every[b.name]) or "serves (not reached)"
            print(f"  {b.name}: {mark}")
    return 0 if sel else 1


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "REGISTRY", "TORCH_POINTWISE", "Backend",
           "BundleCapability", "ContractOps", "ModuleKernels", "Needs", "Pointwise", "Selection",
           "StepKernels", "backend", "select", "select_main"]
