"""Ops benchmark: native and torch CPU kernels vs their peers, side by side in one run.

    python benchmarks/ops.py [--quick] [--threads N] [--reps R] [--json PATH] [--profile]

Sections (medians of ``--reps`` repetitions after one warm-up; wall time and process CPU time,
so runs on a shared machine can be read through the noise):

* memory bandwidth of this machine, measured here: ``copy_`` of a 256 MiB buffer (read + write
  bytes counted) and a read-only ``sum``;
* PagedAttention decode (ctx 1k/4k/16k x B 1/16/64, Hq 32 / Hkv 4, D 128, bf16 or fp32 pages of
  16 tokens, shuffled in the pool): the native kernel (``native``: the contract call with its
  validation; ``native_kernel``: the step kernel as the model calls it, metadata prebuilt) and
  the torch kernel (``fast``) vs torch SDPA on the same K/V laid out contiguously
  (``enable_gqa=True``, and the stronger GQA-folded call), vs the reference where it fits; K/V
  bytes read per second against the measured copy bandwidth;
* GatedDeltaNet (Hk 16 / Hv 32, D 128, Qwen gate + sigmoid beta + l2 norm, fp32): packed prefill
  (2x2048, 8x512) and decode (B 1/16/64) vs onnxruntime's CPU kernel (session built once, same
  thread count; ``ort_inplace`` binds the state output onto the input, as a serving graph does),
  vs HF transformers' ``torch_chunk_gated_delta_rule`` per sequence (prefill) and
  ``torch_recurrent_gated_delta_rule`` (decode, one batched call), vs the reference; decode also
  runs the native in-place step kernel on a state pool (``native_kernel``);
* VarlenCausalConvWithState (C 8192 = Qwen3.5 conv_dim, K 4, silu, fp32) vs onnxruntime's CPU
  kernel and the reference;
* quantized pages (``--only quant``): the native step kernel (as the model calls it: write +
  attend, metadata prebuilt) on bf16 vs int8 vs fp8-e4m3 pages with per-channel scales, decode B
  16 at ctx 4k / 16k, same queries; time, speed-up over bf16 pages, page bytes read per second
  and the fraction of copy bandwidth, max error vs fp32 SDPA on the dequantized pages;
* CPU forms (``--only forms``): per form of the native kernels this CPU runs, projections with
  fp32 vs bf16 weights (bf16 widened to fp32 in registers) next to torch's fp32 / bf16 GEMMs,
  paged attention on fp32 vs bf16 pages, and the cost of paged_attention's argument checks.
  ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` shows torch's bf16 GEMM as on a CPU without
  AVX512-BF16; ``PAGEDHYBRID_CPU_FEATURES`` picks the form the model's kernels run.

Prints one table per section and writes everything to ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from pagedhybrid.kernels import cpu
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.native import contract as native
from pagedhybrid.kernels.onnxruntime.session import single_node_model
from pagedhybrid.kernels.step import StepMetadata

gdn_ref = importlib.import_module("pagedhybrid.ops.gated_delta_net")
pa_ref = importlib.import_module("pagedhybrid.ops.paged_attention")
conv_ref = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

GIB = 1 << 30
pa_fast = importlib.import_module("pagedhybrid.kernels.cpu.paged_attention")


# -- timing ---------------------------------------------------------------------------------------
def timeit(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    fn()  # warm-up
    wall, cpu_t = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu_t.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"ms": statistics.median(wall) * 1e3, "min_ms": min(wall) * 1e3,
            "cpu_ms": statistics.median(cpu_t) * 1e3}


def bandwidth(reps: int) -> dict[str, float]:
    x = torch.ones(256 << 20 >> 2)  # 256 MiB fp32
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    c = timeit(lambda: y.copy_(x), reps)
    r = timeit(lambda: x.sum(), reps)
    return {"copy_gbps": 2 * nbytes / c["min_ms"] / 1e6, "read_gbps": nbytes / r["min_ms"] / 1e6,
            "copy_gbps_median": 2 * nbytes / c["ms"] / 1e6}


class OrtNode:
    """One ORT node in a session built once; inputs bound once, ``run()`` timed."""

    def __init__(self, spec: Any, inputs: list[torch.Tensor | None], attrs: dict[str, Any],
                 n_outputs: int, threads: int, inplace: dict[int, int] | None = None) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.log_severity_level = 3
        model = single_node_model(spec, inputs, spec.resolve_attributes(attrs), n_outputs)
        self.sess = ort.InferenceSession(model.SerializeToString(), so,
                                         providers=["CPUExecutionProvider"])
        self.io = self.sess.io_binding()
        self.keep = []
        aliased = {}
        for i, (port, t) in enumerate(zip(spec.inputs, inputs, strict=False)):
            if t is not None:
                v = ort.OrtValue.ortvalue_from_numpy(np.array(t.numpy()))  # own copy
                self.keep.append(v)
                self.io.bind_ortvalue_input(port.name, v)
                if inplace and i in inplace:
                    aliased[inplace[i]] = v
        for j, port in enumerate(spec.outputs[:n_outputs]):
            if j in aliased:  # state updated in place, as a serving graph binds it
                self.io.bind_ortvalue_output(port.name, aliased[j])
            else:
                self.io.bind_output(port.name, "cpu")

    def run(self) -> list[torch.Tensor]:
        self.sess.run_with_iobinding(self.io)
        return [torch.from_numpy(np.array(v.numpy())) for v in self.io.get_outputs()]


def ratio(a: dict[str, float] | None, b: dict[str, float] | None, key: str = "ms") -> float | None:
    return None if a is None or b is None else a[key] / b[key]


# -- PagedAttention decode ------------------------------------------------------------------------
def paged_inputs(b: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                 seed: int = 0) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    pages = -(-ctx // bs)
    nb = b * pages + 4
    perm = torch.randperm(nb, generator=gen)[: b * pages].view(b, pages).to(torch.int32)
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    vc = (torch.randn(nb, bs, hkv, d, generator=gen) * 0.5).to(dtype)
    q = torch.randn(b, hq * d, generator=gen).to(dtype)
    k = torch.randn(b, hkv * d, generator=gen).to(dtype)
    v = torch.randn(b, hkv * d, generator=gen).to(dtype)
    cu = torch.arange(b + 1, dtype=torch.int32)
    past = torch.full((b,), ctx - 1, dtype=torch.int32)
    inputs = [q, k, v, kc, vc, cu, past, perm, *([None] * 9)]
    return inputs, {"num_heads": hq, "kv_num_heads": hkv}


def contiguous_kv(inputs: list[torch.Tensor | None], b: int, ctx: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc, table = inputs[3], inputs[4], inputs[7]
    assert kc is not None and vc is not None and table is not None
    hkv, d = kc.shape[2:]
    k = kc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    return k, v  # [B, Hkv, L, D] each


def bench_paged(args: argparse.Namespace, bw: dict[str, float]) -> list[dict[str, Any]]:
    ctxs = [1024, 4096] if args.quick else [1024, 4096, 16384]
    batches = [1, 16] if args.quick else [1, 16, 64]
    rows = []
    for ctx in ctxs:
        for b in batches:
            rows.append(paged_row(args, bw, b, ctx))
            print_row("paged", rows[-1], flush=True)
    return rows


def paged_row(args: argparse.Namespace, bw: dict[str, float], b: int, ctx: int
              ) -> dict[str, Any]:
    hq, hkv, d, bs = 32, 4, 128, args.block_size
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    kv_bytes = 2 * b * ctx * hkv * d * dtype.itemsize
    row: dict[str, Any] = {"ctx": ctx, "batch": b, "dtype": args.dtype, "block_size": bs,
                           "kv_mib": kv_bytes / 2**20}
    if 2 * kv_bytes > args.max_gib * GIB:
        row["skipped"] = f"pool + contiguous copy exceed --max-gib {args.max_gib}"
        return row
    inputs, attrs = paged_inputs(b, ctx, hq, hkv, d, bs, dtype)
    dims = pa_ref.validate(inputs, attrs)
    row["fast"] = timeit(lambda: cpu.paged_attention(*inputs, **attrs), args.reps)
    row["fast_compute"] = timeit(lambda: pa_fast.compute(inputs, dims), args.reps)
    row["validate"] = timeit(lambda: pa_ref.validate(inputs, attrs), args.reps)
    row["native"] = timeit(lambda: native.paged_attention(*inputs, **attrs), args.reps)
    meta = StepMetadata.build([1] * b, [ctx - 1] * b, inputs[7], range(b), block_size=bs,
                              num_pages=inputs[3].shape[0], num_slots=b)  # type: ignore[union-attr]
    q3, k3, v3 = (t.view(b, -1, d) for t in inputs[:3])  # type: ignore[union-attr]
    step = backend("native")
    row["native_kernel"] = timeit(lambda: step.attention(q3, k3, v3, inputs[3], inputs[4], meta,
                                                         d ** -0.5), args.reps)
    out = pa_fast.compute(inputs, dims)[0]
    out_native = native.paged_attention(*inputs, **attrs)[0]
    kk, vv = contiguous_kv(inputs, b, ctx)
    q = inputs[0]
    assert q is not None
    q4, qf = q.view(b, hq, 1, d), q.view(b, hkv, hq // hkv, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_gqa"] = timeit(lambda: sdpa(q4, kk, vv, enable_gqa=True), args.reps)
    row["sdpa_folded"] = timeit(lambda: sdpa(qf, kk, vv), args.reps)
    want = sdpa(q4.float(), kk.float(), vv.float(), enable_gqa=True)
    row["max_err_vs_sdpa_fp32"] = (out.float().view(b, hq, d) -
                                   want.view(b, hq, d)).abs().max().item()
    row["native_max_err_vs_sdpa_fp32"] = (out_native.float().view(b, hq, d) -
                                          want.view(b, hq, d)).abs().max().item()
    if b * ctx <= args.ref_tokens:
        row["reference"] = timeit(lambda: pa_ref.paged_attention(*inputs, **attrs),
                                  max(1, args.reps // 2))
    row["kv_gbps"] = kv_bytes / row["fast"]["ms"] / 1e6
    row["kv_gbps_compute"] = kv_bytes / row["fast_compute"]["ms"] / 1e6
    row["frac_copy_bw"] = row["kv_gbps_compute"] / bw["copy_gbps"]
    # CPU-time based: what the kernel reaches when it has the core (shared machines)
    row["kv_gbps_cpu"] = kv_bytes / row["fast_compute"]["cpu_ms"] / 1e6
    row["frac_copy_bw_cpu"] = row["kv_gbps_cpu"] / bw["copy_gbps"]
    row["x_sdpa_gqa"] = ratio(row["fast"], row["sdpa_gqa"])
    row["x_sdpa_folded"] = ratio(row["fast"], row["sdpa_folded"])
    row["x_sdpa_folded_compute"] = ratio(row["fast_compute"], row["sdpa_folded"])
    row["x_sdpa_folded_cpu"] = ratio(row["fast_compute"], row["sdpa_folded"], "cpu_ms")
    row["reference_over_fast"] = ratio(row.get("reference"), row["fast"])
    best = min(row["sdpa_gqa"]["ms"], row["sdpa_folded"]["ms"])
    row["native_x_best_sdpa"] = row["native_kernel"]["ms"] / best
    row["native_contract_x_best_sdpa"] = row["native"]["ms"] / best
    row["native_kv_gbps"] = kv_bytes / row["native_kernel"]["ms"] / 1e6
    row["native_frac_copy_bw"] = row["native_kv_gbps"] / bw["copy_gbps"]
    return row


# -- quantized pages ------------------------------------------------------------------------------
def bench_quant(args: argparse.Namespace, bw: dict[str, float]) -> list[dict[str, Any]]:
    from pagedhybrid.kvquant import KVScales, dequantize, quantize

    hq, hkv, d, bs, b = 32, 4, 128, args.block_size, 16
    rows = []
    for ctx in ([4096] if args.quick else [4096, 16384]):
        inputs, _ = paged_inputs(b, ctx, hq, hkv, d, bs, torch.bfloat16)
        q3, k3, v3 = (t.view(b, -1, d) for t in inputs[:3])  # type: ignore[union-attr]
        kc, vc = inputs[3], inputs[4]
        assert kc is not None and vc is not None
        meta = StepMetadata.build([1] * b, [ctx - 1] * b, inputs[7], range(b), block_size=bs,
                                  num_pages=kc.shape[0], num_slots=b)
        gen = torch.Generator().manual_seed(1)
        step = backend("native")
        row: dict[str, Any] = {"ctx": ctx, "batch": b, "block_size": bs}
        for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8),
                         ("fp8", torch.float8_e4m3fn)):
            if dt == torch.bfloat16:
                pages, scales = (kc, vc), None
            else:
                qmax = 127.0 if dt == torch.int8 else 448.0
                s = [(kc.float().abs().amax((0, 1)) / qmax * (1 + 0.1 * torch.rand(
                    hkv, d, generator=gen))).unsqueeze(1) for _ in range(2)]  # [Hkv, 1, D]
                scales = KVScales(s[0], s[1] * 0.5)
                pages = (quantize(kc, scales.k, dt), quantize(vc, scales.v, dt))
            call = functools.partial(step.attention, q3, k3, v3, pages[0], pages[1], meta,
                                     d ** -0.5, scales)
            t = timeit(call, args.reps)
            out = call()
            deq = [p.float() if scales is None else dequantize(p, sc) for p, sc in
                   zip(pages, (None, None) if scales is None else scales, strict=True)]
            kk, vv = contiguous_kv([None, None, None, deq[0], deq[1], None, None, inputs[7]],
                                   b, ctx)
            want = torch.nn.functional.scaled_dot_product_attention(
                q3.float().view(b, hq, 1, d), kk, vv, enable_gqa=True).view(b, hq, d)
            page_bytes = 2 * b * ctx * hkv * d * dt.itemsize
            row[name] = {**t, "gbps": page_bytes / t["ms"] / 1e6,
                         "frac_copy_bw": page_bytes / t["ms"] / 1e6 / bw["copy_gbps"],
                         "max_err": (out.float() - want).abs().max().item()}
        row["int8_speedup"] = row["bf16"]["ms"] / row["int8"]["ms"]
        row["fp8_speedup"] = row["bf16"]["ms"] / row["fp8"]["ms"]
        print(f"quant ctx {ctx:6d} B {b}: bf16 {row['bf16']['ms']:.2f} ms "
              f"({100 * row['bf16']['frac_copy_bw']:.0f}% copy bw), int8 {row['int8']['ms']:.2f}"
              f" ms ({row['int8_speedup']:.2f}x, {100 * row['int8']['frac_copy_bw']:.0f}%), fp8 "
              f"{row['fp8']['ms']:.2f} ms ({row['fp8_speedup']:.2f}x, "
              f"{100 * row['fp8']['frac_copy_bw']:.0f}%); max err int8 {row['int8']['max_err']:.1e}"
              f" fp8 {row['fp8']['max_err']:.1e}", flush=True)
        rows.append(row)
    return rows


# -- CPU forms: bf16 vs fp32 per form, and the cost of the native ops' argument checks -----------
def _refused(lib: Any, *args: Any) -> None:
    try:
        lib.paged_attention(*args)
    except ValueError:
        return
    raise AssertionError("not refused")


def bench_forms(args: argparse.Namespace) -> dict[str, Any]:
    """Per CPU form this machine runs (kernels/native: ``avx512_bf16``, ``avx512``, ``avx2``):
    projections (x [M, 2048] @ w [4096, 2048]^T) in fp32 and in bf16 on the native ``linear``
    kernel (``dense.linear``: bf16 widened to fp32 in registers) next to torch's GEMMs (oneDNN;
    run with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` to see torch on a CPU without AVX512-BF16),
    and paged
    attention decode on fp32 vs bf16 pages; then the cost of paged_attention's argument checks
    (one min/max over the table entries each sequence reads)."""
    from pagedhybrid.kernels import native as nat

    part = functools.partial
    forms = nat.runnable_forms()
    k, n = 2048, 4096
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(n, k, generator=gen) * 0.02
    w16 = w32.bfloat16()
    lin_rows = []
    for m in ([1, 16] if args.quick else [1, 16, 256]):
        x32 = torch.randn(m, k, generator=gen)
        x16 = x32.bfloat16()
        out, out16 = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
        row: dict[str, Any] = {"M": m, "torch_fp32": timeit(part(F.linear, x32, w32), args.reps),
                               "torch_bf16": timeit(part(F.linear, x16, w16), args.reps)}
        for form in forms:
            lib = nat.form_library(form)
            row[f"{form}_fp32"] = timeit(part(lib.linear, x32, w32, out), args.reps)
            row[f"{form}_bf16"] = timeit(part(lib.linear, x16, w16, out16), args.reps)
        from pagedhybrid.kernels.native import dense

        row["dense_bf16"] = timeit(part(dense.linear, x16, w16), args.reps)
        lin_rows.append(row)
        cells = "  ".join(f"{f}: fp32 {row[f + '_fp32']['ms']:.2f} bf16 "
                          f"{row[f + '_bf16']['ms']:.2f} (bf16/fp32 "
                          f"{row[f + '_bf16']['ms'] / row[f + '_fp32']['ms']:.2f})" for f in forms)
        print(f"forms  linear M={m:<4} torch: fp32 {row['torch_fp32']['ms']:.2f} bf16 "
              f"{row['torch_bf16']['ms']:.2f} ms (bf16/fp32 "
              f"{row['torch_bf16']['ms'] / row['torch_fp32']['ms']:.2f})  | dense.linear bf16 "
              f"{row['dense_bf16']['ms']:.2f} ({nat.status().isa})  | native {cells}",
              flush=True)
    hq, hkv, d, bs, b, ctx = 32, 4, 128, 16, 16, 2048
    seqs = torch.arange(b, dtype=torch.int32)
    att_rows = []
    for dt in (torch.float32, torch.bfloat16):
        inputs, _ = paged_inputs(b, ctx, hq, hkv, d, bs, dt)
        q = inputs[0].float().view(b, hq, d).contiguous()  # type: ignore[union-attr]
        out = torch.empty(b, hq, d)
        row = {"pages": str(dt), "ctx": ctx, "batch": b}
        for form in forms:
            row[form] = timeit(part(nat.form_library(form).paged_attention, q, inputs[3],
                                    inputs[4], inputs[7], inputs[5], inputs[6], seqs, out,
                                    d ** -0.5, nat.KV_SPLIT), args.reps)
        att_rows.append(row)
        print(f"forms  paged attention B={b} ctx={ctx} {dt} pages: " + "  ".join(
            f"{f} {row[f]['ms']:.2f} ms" for f in forms), flush=True)
    # the checks: a call refused at the last table entry it reads (every check ran) minus one
    # refused at its first check (the exception's own cost), against a good call of that size
    lib = nat.library()
    check_rows = []
    for b, ctx in ((16, 4096), (64, 16384)):
        pages = -(-ctx // bs)
        kc = torch.zeros(b * pages, bs, 1, 8)  # tiny pages: the checks read only the table
        table = torch.arange(b * pages, dtype=torch.int32).view(b, pages).contiguous()
        bad = table.clone()
        bad[-1, -1] = b * pages
        q, out = torch.zeros(b, 1, 8), torch.zeros(b, 1, 8)
        cu = torch.arange(b + 1, dtype=torch.int32)
        past = torch.full((b,), ctx - 1, dtype=torch.int32)
        seqs = torch.arange(b, dtype=torch.int32)
        tail = (cu, past, seqs, out, 1.0, nat.KV_SPLIT)
        last = timeit(part(_refused, lib, q, kc, kc, bad, *tail), args.reps * 20)
        first = timeit(part(_refused, lib, q.double(), kc, kc, table, *tail), args.reps * 20)
        row = {"batch": b, "ctx": ctx, "entries": b * pages,
               "checks_us": max(0.0, last["min_ms"] - first["min_ms"]) * 1e3}
        if b * ctx <= 16 * 4096:  # a good call of that size (bf16 pages, Hq 32 / Hkv 4 / D 128)
            good, _ = paged_inputs(b, ctx, hq, hkv, d, bs, torch.bfloat16)
            gq = good[0].float().view(b, hq, d).contiguous()  # type: ignore[union-attr]
            row["call_ms"] = timeit(part(lib.paged_attention, gq, good[3], good[4], good[7], cu,
                                         past, seqs, torch.empty(b, hq, d), d ** -0.5,
                                         nat.KV_SPLIT), args.reps)["min_ms"]
            row["share"] = row["checks_us"] / 1e3 / row["call_ms"]
        check_rows.append(row)
        share = (f" = {100 * row['share']:.3f}% of the call ({row['call_ms']:.2f} ms, bf16 pages, "
                 f"Hq {hq} / Hkv {hkv} / D {d})" if "share" in row else "")
        print(f"checks paged_attention B={b} ctx={ctx}: {row['entries']} table entries checked "
              f"in {row['checks_us']:.1f} us{share}", flush=True)
    return {"forms": list(forms), "chosen": nat.cpu_form(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "linear": lin_rows, "paged_attention": att_rows, "checks": check_rows}


# -- GatedDeltaNet ---------------------------------------------------------------------------------
def gdn_inputs(lens: list[int], hk: int = 16, hv: int = 32, d: int = 128, seed: int = 0
               ) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hk, d, generator=gen)
    k = torch.randn(t, hk, d, generator=gen)
    v = torch.randn(t, hv, d, generator=gen) * 0.5
    a = torch.randn(t, hv, generator=gen)
    b = torch.randn(t, hv, generator=gen)
    s0 = torch.randn(len(lens), hv, d, d, generator=gen) * 0.1
    a_log = torch.randn(hv, generator=gen) * 0.5 - 1.0
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    attrs = {"gate_activation": "qwen", "beta_activation": "sigmoid", "qk_l2_norm": 1}
    return [q, k, v, cu, a, b, s0, a_log, dt_bias, None, None], attrs


def hf_gdn(inputs: list[torch.Tensor | None], lens: list[int], decode: bool) -> Callable[[], Any]:
    q, k, v, _cu, a, b, s0, a_log, dt_bias = inputs[:9]
    assert q is not None and k is not None and v is not None and s0 is not None
    assert a is not None and b is not None and a_log is not None and dt_bias is not None
    g = -torch.exp(a_log) * torch.nn.functional.softplus(a + dt_bias)  # HF's caller does this
    beta = torch.sigmoid(b)
    state = s0.transpose(-1, -2).contiguous()  # HF is K-major
    if decode:  # B single-token sequences: one uniform batched call
        def run_decode() -> Any:
            return hf.torch_recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return run_decode
    starts = np.cumsum([0, *lens]).tolist()

    def run_chunk() -> Any:
        for i, n in enumerate(lens):
            sl = slice(starts[i], starts[i] + n)
            hf.torch_chunk_gated_delta_rule(
                q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
                initial_state=state[i: i + 1], output_final_state=True,
                use_qk_l2norm_in_kernel=True)
    return run_chunk


def bench_gdn(args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = [("prefill", [2048, 2048]), ("prefill", [512] * 8)]
    shapes += [("decode", [1] * b) for b in ([1, 16] if args.quick else [1, 16, 64])]
    rows = []
    for kind, lens in shapes:
        rows.append(gdn_row(args, kind, lens))
        print_row("gdn", rows[-1], flush=True)
    return rows


def gdn_row(args: argparse.Namespace, kind: str, lens: list[int]) -> dict[str, Any]:
    inputs, attrs = gdn_inputs(lens)
    row: dict[str, Any] = {"kind": kind, "seqs": len(lens), "tokens": sum(lens)}
    row["fast"] = timeit(lambda: cpu.gated_delta_net(*inputs, **attrs), args.reps)
    # the model's form: q/k normalised outside the op, the state resident in a pool
    q, k, v, _cu, a, b = inputs[:6]
    qn, kn = (torch.nn.functional.normalize(x, dim=-1, eps=1e-6) for x in (q, k))  # type: ignore[arg-type]
    pool = inputs[6].clone()  # type: ignore[union-attr]  # state pool, rows 0..B-1
    meta = StepMetadata.build(lens, [1] * len(lens), None, range(len(lens)), block_size=16,
                              num_pages=0, num_slots=len(lens))
    scale = qn.shape[-1] ** -0.5
    for name in ("native", "torch"):
        if kind == "decode" or name == "torch":
            step = backend(name)
            row[f"{name}_kernel"] = timeit(lambda step=step: step.gated_delta(
                qn, kn, v, a, b, inputs[7], inputs[8], pool, meta, scale), args.reps)
    if kind == "decode":
        row["native"] = timeit(lambda: native.gated_delta_net(
            qn, kn, v, inputs[3], a, b, inputs[6], inputs[7], inputs[8], **{
                **attrs, "qk_l2_norm": 0}), args.reps)
    node = OrtNode(gdn_ref.SPEC, inputs, attrs, 2, args.threads)
    row["ort"] = timeit(node.run, args.reps)
    row["ort_inplace"] = timeit(OrtNode(gdn_ref.SPEC, inputs, attrs, 2, args.threads,
                                        inplace={6: 1}).run, args.reps)
    row["hf"] = timeit(hf_gdn(inputs, lens, kind == "decode"), args.reps)
    o_f, s_f = cpu.gated_delta_net(*inputs, **attrs)
    o_o, s_o = node.run()
    row["max_err_vs_ort"] = max((o_f - o_o).abs().max().item(), (s_f - s_o).abs().max().item())
    if kind == "decode" or not args.quick:
        reps = max(1, args.reps // 2) if kind == "prefill" else args.reps
        row["reference"] = timeit(lambda: gdn_ref.gated_delta_net(*inputs, **attrs), reps)
    row["tok_per_s"] = sum(lens) / row["fast"]["ms"] * 1e3
    row["ort_over_fast"] = ratio(row["ort"], row["fast"])
    row["ort_over_fast_cpu"] = ratio(row["ort"], row["fast"], "cpu_ms")
    row["ort_inplace_over_torch_kernel"] = ratio(row["ort_inplace"], row["torch_kernel"])
    row["ort_inplace_over_native_kernel"] = ratio(row["ort_inplace"], row.get("native_kernel"))
    row["ort_over_native"] = ratio(row["ort"], row.get("native"))
    row["hf_over_fast"] = ratio(row["hf"], row["fast"])
    row["reference_over_fast"] = ratio(row.get("reference"), row["fast"])
    if kind == "decode":
        row["state_gbps"] = 2 * s_f.numel() * 4 / row["native_kernel"]["ms"] / 1e6  # r + w
    return row


# -- VarlenCausalConvWithState ---------------------------------------------------------------------
def bench_conv(args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = [("prefill", [2048, 2048]), ("prefill", [512] * 8)]
    shapes += [("decode", [1] * b) for b in ([1, 16] if args.quick else [1, 16, 64])]
    rows = []
    for kind, lens in shapes:
        rows.append(conv_row(args, kind, lens))
        print_row("conv", rows[-1], flush=True)
    return rows


def conv_row(args: argparse.Namespace, kind: str, lens: list[int]) -> dict[str, Any]:
    c, k = 8192, 4  # Qwen3.5 conv_dim = 2*16*128 + 32*128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lens), c, generator=gen)
    w = torch.randn(c, 1, k, generator=gen) * 0.5
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    st = torch.randn(len(lens), c, k - 1, generator=gen)
    inputs = [x, w, cu, None, st, None, None, None]
    attrs = {"activation": "silu"}
    row: dict[str, Any] = {"kind": kind, "seqs": len(lens), "tokens": sum(lens)}
    row["fast"] = timeit(lambda: cpu.varlen_causal_conv(*inputs, **attrs), args.reps)
    if kind == "decode":
        row["native"] = timeit(lambda: native.varlen_causal_conv(*inputs, **attrs), args.reps)
    node = OrtNode(conv_ref.SPEC, inputs, attrs, 2, args.threads)
    row["ort"] = timeit(node.run, args.reps)
    row["reference"] = timeit(lambda: conv_ref.varlen_causal_conv(*inputs, **attrs), args.reps)
    o_f, s_f = cpu.varlen_causal_conv(*inputs, **attrs)
    o_o, s_o = node.run()
    row["max_err_vs_ort"] = max((o_f - o_o).abs().max().item(), (s_f - s_o).abs().max().item())
    row["ort_over_fast"] = ratio(row["ort"], row["fast"])
    row["ort_over_fast_cpu"] = ratio(row["ort"], row["fast"], "cpu_ms")
    row["ort_over_native"] = ratio(row["ort"], row.get("native"))
    row["reference_over_fast"] = ratio(row["reference"], row["fast"])
    row["gbps"] = 2 * x.numel() * 4 / row["fast"]["ms"] / 1e6  # read x + write y
    return row


# -- profile ---------------------------------------------------------------------------------------
def profile(args: argparse.Namespace) -> dict[str, str]:
    from torch.profiler import profile as prof

    cases = {
        "paged_attention decode B16 ctx4k": (lambda: paged_inputs(16, 4096, 32, 4, 128,
                                                                  args.block_size,
                                                                  torch.bfloat16),
                                             cpu.paged_attention),
        "gated_delta_net prefill 2x2048": (lambda: gdn_inputs([2048, 2048]),
                                           cpu.gated_delta_net),
        "gated_delta_net decode B64": (lambda: gdn_inputs([1] * 64), cpu.gated_delta_net),
    }
    tables = {}
    for name, (make, fn) in cases.items():
        inputs, attrs = make()
        fn(*inputs, **attrs)
        with prof() as p:
            fn(*inputs, **attrs)
        tables[name] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        print(f"\n## profile: {name}\n{tables[name]}")
    return tables


# -- output ----------------------------------------------------------------------------------------
def fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, dict):
        return f"{x['ms']:.2f}"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def print_row(section: str, r: dict[str, Any], flush: bool = False) -> None:
    if section == "paged":
        if "skipped" in r:
            print(f"paged  ctx={r['ctx']:>6} B={r['batch']:>3}  skipped: {r['skipped']}")
            return
        print(f"paged  ctx={r['ctx']:>6} B={r['batch']:>3}  native {fmt(r['native_kernel'])} ms "
              f"(contract {fmt(r['native'])}) = {fmt(r['native_x_best_sdpa'])}x best SDPA, "
              f"{fmt(r['native_kv_gbps'], 1)} GB/s = {100 * r['native_frac_copy_bw']:.0f}% copy bw"
              f"  | torch kernel {fmt(r['fast'])} ms "
              f"(compute {fmt(r['fast_compute'])}, validate {fmt(r['validate'])})  "
              f"sdpa_gqa {fmt(r['sdpa_gqa'])}  sdpa_folded {fmt(r['sdpa_folded'])}  "
              f"ref {fmt(r.get('reference'))}  | x_folded {fmt(r['x_sdpa_folded'])} "
              f"(compute {fmt(r['x_sdpa_folded_compute'])}, cpu {fmt(r['x_sdpa_folded_cpu'])}) "
              f"x_gqa {fmt(r['x_sdpa_gqa'])}  {fmt(r['kv_gbps_compute'], 1)} GB/s = "
              f"{100 * r['frac_copy_bw']:.0f}% copy bw (cpu-time {fmt(r['kv_gbps_cpu'], 1)} "
              f"GB/s = {100 * r['frac_copy_bw_cpu']:.0f}%)", flush=flush)
    else:
        extra = ""
        if "native_kernel" in r:
            extra += (f"  native kernel {fmt(r['native_kernel'])} vs ort-inplace "
                      f"{fmt(r['ort_inplace'])} = {fmt(r['ort_inplace_over_native_kernel'])}x")
        if "native" in r:
            extra += (f"  native contract {fmt(r['native'])} "
                      f"(ort/native {fmt(r['ort_over_native'])})")
        extra += f"  state {fmt(r['state_gbps'], 1)} GB/s" if "state_gbps" in r else ""
        extra += f"  hf {fmt(r['hf'])}  hf/fast {fmt(r['hf_over_fast'])}" if "hf" in r else ""
        print(f"{section:5}  {r['kind']:7} {r['seqs']:>2}x{r['tokens'] // r['seqs']:<5} "
              f"fast {fmt(r['fast'])} ms (cpu {r['fast']['cpu_ms']:.1f})  ort {fmt(r['ort'])} "
              f"(cpu {r['ort']['cpu_ms']:.1f})  ref {fmt(r.get('reference'))}  | ort/fast "
              f"{fmt(r['ort_over_fast'])} (cpu {fmt(r['ort_over_fast_cpu'])})  ref/fast "
              f"{fmt(r['reference_over_fast'])}{extra}  err {r['max_err_vs_ort']:.1e}",
              flush=flush)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--no-thp" not in argv and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        # PyTorch's CPU allocator madvises huge pages for blocks >= 2 MiB only with this flag
        # (read once per process): without it every fresh large output pays 4 KiB page faults.
        os.execve(sys.executable, [sys.executable, __file__, *argv],
                  {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-thp", action="store_true",
                    help="do not set THP_MEM_ALLOC_ENABLE=1 (huge pages for torch allocations)")
    ap.add_argument("--quick", action="store_true", help="small shape sets, fewer repetitions")
    ap.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="paged attention activation/cache type")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-gib", type=float, default=5.0, help="memory cap per paged config")
    ap.add_argument("--ref-tokens", type=int, default=16384,
                    help="run the reference paged attention when B*ctx <= this")
    ap.add_argument("--only", choices=["paged", "gdn", "conv", "quant", "forms"],
                    action="append")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, default=Path("ops-benchmark.json"))
    args = ap.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    sections = args.only or ["paged", "gdn", "conv"]
    bw = bandwidth(args.reps)
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": args.threads, "torch": torch.__version__,
                    "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
                    "onnxruntime": ort.__version__, **bw},
        "args": {k: str(v) for k, v in vars(args).items()},
        "capabilities": {op: c.describe() for op, c in cpu.COVERAGE.items()},
        "native_capabilities": {op: c.describe() for op, c in native.COVERAGE.items()},
    }
    print(f"# threads={args.threads}  THP_MEM_ALLOC_ENABLE="
          f"{os.environ.get('THP_MEM_ALLOC_ENABLE', '')}  copy {bw['copy_gbps']:.1f} GB/s "
          f"(read+write)  "
          f"read {bw['read_gbps']:.1f} GB/s  torch {torch.__version__}  ort {ort.__version__}")
    print("# times: median wall ms of the full call; ratios < 1 favour the fast kernel for "
          "x_*, > 1 for */fast")
    if "paged" in sections:
        result["paged_attention_decode"] = bench_paged(args, bw)
    if "gdn" in sections:
        result["gated_delta_net"] = bench_gdn(args)
    if "conv" in sections:
        result["varlen_causal_conv"] = bench_conv(args)
    if "quant" in sections:
        result["quantized_pages"] = bench_quant(args, bw)
    if "forms" in sections:
        result["cpu_forms"] = bench_forms(args)
    if args.profile:
        result["profile"] = profile(args)
    args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
