"""The attention-contract backends and their truthful capabilities; the default registry.

``build_default_registry(kernels=REGISTRY)`` registers, in priority order:

* ``webgpu_paged_attention`` -- the WGSL PagedAttention kernel package (``kernels.webgpu``),
  when its module imports (float16, causal, no rotary input; probed for an adapter).
* the production kernel bundles of the one kernel registry (``kernels.backend.REGISTRY``:
  ``native_paged_attention``, ``native_batch_invariant``, ``cpu_paged_attention``), the same
  bundle objects the model runs (``AttentionRegistry.register_bundle``: contract op = the
  bundle's PagedAttention, capability derived from its ``BundleCapability``). ORT's
  PagedAttention returns no LSE, so every strict (LSE-exporting) contract rejects them.
* ``torch_varlen`` -- ``torch_varlen_attention``: packed varlen prefill on one rank, matmul
  scores, fp32 math, exports attention-domain LSE, differentiable (role train).
* ``deterministic_cp`` -- ``pagedhybrid.parallel.context_parallel_attention``: any CP degree,
  fixed global KV grid, ``(out, lse)`` partials merged in global block order; prefill and
  decode / chunked prefill over a paged cache; forward only.
* the reference kernel bundles (``paged_attention_reference``: ``pagedhybrid.ops.paged_attention``,
  the ORT-contract torch reference, ORT's positional signature): packed, paged, fused RoPE; no
  LSE output. ``get_op("paged_attention")`` is that reference.

No bundle name is spelled here: the bundles come from the kernel registry, production kinds
before the attention-domain backends, references after them.

``torch_varlen_attention(query, key, value, *, contract, scale=None) -> (out, lse)`` takes
``query [L, Hq, D]``, ``key``/``value [L, Hkv, D]`` packed by the contract's sequence offsets;
query row ``i`` of sequence ``b`` sees keys ``j <= i + causal_offsets[b]`` (causal). ``out`` is
cast to the input dtype once; ``lse`` is fp32 ``[L, Hq]``.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.attention.context_parallel import context_parallel_attention
from pagedhybrid.attention.contract import AttentionContract
from pagedhybrid.attention.registry import AttentionRegistry
from pagedhybrid.dtypes import to_torch
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.backend import REGISTRY
from pagedhybrid.kernels.registry import KernelRegistry
from pagedhybrid.ops.paged_attention import paged_attention

OP = "pagedhybrid.attention.torch_varlen_attention"
ALL_MODES = ("prefill", "chunked_prefill", "decode")
ALL_DTYPES = ("fp32", "bf16", "fp16")

TORCH_VARLEN = AttentionBackendCapability(
    backend_id="torch_varlen", roles=("infer", "train"), modes=("prefill",), dtypes=ALL_DTYPES,
    cp_world_sizes=(1,), exports_attention_lse=True, deterministic_cp_merge=False,
    supports_packed_varlen=True, supports_kv_cache=False, implementation_kind="production",
    supports_rope_metadata=True, supports_fused_rope_attention=False,
    description="packed varlen prefill on one rank (torch matmul, fp32 math), exports LSE; "
                "consumes post-RoPE Q/K (unfused boundary)")
DETERMINISTIC_CP = AttentionBackendCapability(
    backend_id="deterministic_cp", roles=("infer",), modes=ALL_MODES, dtypes=ALL_DTYPES,
    cp_world_sizes=None, exports_attention_lse=True, deterministic_cp_merge=True,
    supports_packed_varlen=True, supports_kv_cache=True, implementation_kind="deterministic",
    supports_rope_metadata=True, supports_fused_rope_attention=False,
    kv_cache_modes=("chunked_prefill", "decode"),
    description="context-parallel reference over torch.distributed: fixed global KV grid, fp32 "
                "(out, lse) partials folded in global block order, bitwise equal for every CP "
                "size; prefill (contiguous / zigzag, packed varlen) and decode / chunked "
                "prefill over a paged KV cache; forward only")
def _fast_capability(backend_id: str, dtypes: tuple[str, ...], *, non_causal: bool,
                     what: str) -> AttentionBackendCapability:
    """Conservative: a fast PagedAttention kernel never claims more than it is known to do."""
    return AttentionBackendCapability(
        backend_id=backend_id, roles=("infer",), modes=ALL_MODES, dtypes=dtypes,
        cp_world_sizes=(1,), exports_attention_lse=False, deterministic_cp_merge=False,
        supports_packed_varlen=True, supports_kv_cache=True, implementation_kind="production",
        supports_rope_metadata=False, supports_fused_rope_attention=False,
        supports_non_causal=non_causal,
        description=f"com.microsoft.PagedAttention {what} (ORT signature); returns no LSE")


def torch_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                           contract: AttentionContract, scale: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen attention with LSE export (module docstring)."""
    bad = TORCH_VARLEN.incompatibilities(contract)
    if bad:
        raise UnsupportedConfiguration(f"torch_varlen: {'; '.join(bad)}")
    sh = contract.sharding
    dt = to_torch(contract.dtype)
    hq, hkv, d, n = sh.local_q_heads, sh.local_kv_heads, contract.head_dim, sh.local_sequence_length
    for name, t, heads in (("query", query, hq), ("key", key, hkv), ("value", value, hkv)):
        if not isinstance(t, torch.Tensor) or t.dtype != dt:
            raise ContractViolation(OP, name, f"must be a {dt} tensor",
                                    getattr(t, "dtype", type(t).__name__))
        if tuple(t.shape) != (n, heads, d):
            raise ContractViolation(OP, name, f"must have shape [{n}, {heads}, {d}]",
                                    list(t.shape))
    if contract.rope is not None and contract.rope.fused:
        raise UnsupportedConfiguration("torch_varlen consumes post-RoPE Q/K only")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    bounds = sh.global_sequence_offsets
    group = hq // hkv
    outs, lses = [], []
    for b in range(len(bounds) - 1):
        sl = slice(bounds[b], bounds[b + 1])
        q = query[sl].to(torch.float32).transpose(0, 1)  # [Hq, n, D]
        k = key[sl].to(torch.float32).repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        v = value[sl].to(torch.float32).repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        s = (q @ k.transpose(1, 2)) * scale  # [Hq, n, n]
        if contract.causal:
            assert contract.causal_offsets is not None
            m = q.shape[1]
            allowed = (torch.arange(m)[None, :]
                       <= torch.arange(m)[:, None] + contract.causal_offsets[b])  # [n, n]
            s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [Hq, n]; rows always see key 0 (offsets >= 0)
        outs.append((torch.exp(s - lse[..., None]) @ v).transpose(0, 1))  # [n, Hq, D]
        lses.append(lse.transpose(0, 1))  # [n, Hq]
    return torch.cat(outs).to(dt), torch.cat(lses)


def _optional(module: str, attr: str) -> Callable[..., Any] | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    fn = getattr(mod, attr, None)
    return fn if callable(fn) else None


@functools.cache
def _webgpu_available() -> str | None:
    try:
        from pagedhybrid.kernels.webgpu.runner import gpu

        gpu()
    except Exception as e:  # report any adapter/driver problem as the reason
        return f"{type(e).__name__}: {e}"
    return None


def build_default_registry(kernels: KernelRegistry = REGISTRY) -> AttentionRegistry:
    """A fresh contract-dispatch registry over ``kernels`` (see the module docstring)."""
    reg = AttentionRegistry()
    webgpu = _optional("pagedhybrid.kernels.webgpu", "paged_attention")
    if webgpu is not None:  # float16, no rotary input (its manifest)
        reg.register_op("webgpu_paged_attention", webgpu)
        reg.register_attention_backend(
            "webgpu_paged_attention", webgpu,
            _fast_capability("webgpu_paged_attention", ("fp16",), non_causal=True,
                             what="WGSL kernel package on wgpu"),
            platform="webgpu", available=_webgpu_available)
    production = [b for b in kernels if b.capability.implementation_kind == "production"]
    for bundle in production:
        reg.register_bundle(bundle)
    reg.register_op("torch_varlen_attention", torch_varlen_attention)
    reg.register_attention_backend("torch_varlen", torch_varlen_attention, TORCH_VARLEN)
    reg.register_op("context_parallel_attention", context_parallel_attention)
    reg.register_attention_backend(
        "deterministic_cp", context_parallel_attention, DETERMINISTIC_CP, platform="cpu",
        communication="torch.distributed all_gather_object + all_gather + all_to_all_single "
                      "(gloo on CPU, nccl on CUDA); no float reductions")
    for bundle in kernels:
        if bundle not in production:
            reg.register_bundle(bundle)
    reg.register_op("paged_attention", paged_attention)
    return reg


@functools.cache
def default_registry() -> AttentionRegistry:
    """The process's contract-dispatch registry over ``kernels.backend.REGISTRY`` (built once:
    the WebGPU module import and the entries' derived capabilities)."""
    return build_default_registry()


__all__ = ["DETERMINISTIC_CP", "TORCH_VARLEN", "build_default_registry",
           "default_registry", "torch_varlen_attention"]
