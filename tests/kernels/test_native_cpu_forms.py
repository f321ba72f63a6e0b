"""The native kernels in every CPU form this machine runs, against references.

A CPU form is one compilation of the kernels for an ISA (``avx512_bf16``: bf16 pairs by
vdpbf16ps; ``avx512``: AVX-512 with bf16 widened to fp32 in registers; ``avx2``: 8 lanes, the
same widening). ``make native`` builds every form the CPU can run, so on a CPU with AVX512-BF16
all three are tested here -- the fallback forms included, which is how a machine without BF16
dot instructions is covered on one that has them. The form the engine runs is the fastest one,
or the one ``PAGEDHYBRID_CPU_FEATURES`` names; ``native.status()`` / ``cpu_form()`` say which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedhybrid.kernels import native
from pagedhybrid.kernels import reference as ref_step
from pagedhybrid.kernels.native import dense
from pagedhybrid.kernels.native import seam as native_seam
from pagedhybrid.kernels.native.sampling import (
    apply_token_bitmask_,
    greedy_rows,
    top_rows,
    unpack_bitmask,
)
from pagedhybrid.kernels.step import StepMetadata

HERE = native.runnable_forms()
CPUINFO = Path("/proc/cpuinfo").read_text()  # the vendor picks the codes' prefetch (quant.cpp)
LANES = {"avx512_bf16": 16, "avx512_vnni": 16, "avx512": 16, "avx2": 8}


@contextmanager
def forced(form: str) -> Iterator[None]:
    """The process's native kernels in ``form`` (as PAGEDHYBRID_CPU_FEATURES=form at start)."""
    old = os.environ.get(native.ENV_FORM)
    os.environ[native.ENV_FORM] = form
    native.status.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[native.ENV_FORM]
        else:
            os.environ[native.ENV_FORM] = old
        native.status.cache_clear()


def test_every_form_this_cpu_runs_is_built_and_says_what_it_is() -> None:
    assert HERE, "the native kernels need AVX2 + FMA + F16C"
    for form in HERE:
        st = native.form_status(form)
        assert st.available, st.reason  # make native builds every runnable form
        lib = native.form_library(form)
        assert lib.cpu_form() == form
        assert lib.bf16_dot() == (form == "avx512_bf16")
        assert lib.vector_lanes() == LANES[form]
        assert lib.int8_dot() == ("vpdpbusd" if form in native.VNNI_FORMS else "vpmaddubsw")
        assert lib.code_prefetch() == ("NTA 2 KiB ahead (AMD)" if "AuthenticAMD" in CPUINFO
                                       else "T0 4 KiB ahead")
    for form in set(native.FORMS) - set(HERE):
        assert "cannot run" in native.form_status(form).reason


def test_the_form_comes_from_the_cpu_flags_or_the_environment() -> None:
    bf16, vnni, avx512, avx2 = (native.FORMS[f] for f in ("avx512_bf16", "avx512_vnni",
                                                          "avx512", "avx2"))
    assert native.runnable_forms(bf16) == ("avx512_bf16", "avx512_vnni", "avx512", "avx2")
    assert native.runnable_forms(vnni) == ("avx512_vnni", "avx512", "avx2")
    assert native.runnable_forms(bf16 - {"avx512_vnni"}) == ("avx512", "avx2")
    assert native.runnable_forms(avx512) == ("avx512", "avx2")
    assert native.runnable_forms(avx2) == ("avx2",)
    assert native.chosen_form("", bf16)[:2] == ("avx512_bf16", False)
    assert native.chosen_form("auto", avx512)[:2] == ("avx512", False)
    assert native.chosen_form("", avx2)[:2] == ("avx2", False)
    assert native.chosen_form(" AVX2 ", bf16)[:2] == ("avx2", True)
    form, forced_, why = native.chosen_form("avx512_bf16", avx512)
    assert form is None and forced_ and "lacks: avx512_bf16" in why
    form, _, why = native.chosen_form("avx512", avx2)
    assert form is None and "avx512bw" in why
    form, _, why = native.chosen_form("sse4", bf16)
    assert form is None and "not a CPU form" in why
    assert native.chosen_form("", frozenset({"sse4_2"}))[0] is None
    cpuinfo = "processor\t: 0\nflags\t\t: fpu avx2 fma f16c sse4_2\n"
    assert native.cpu_flags(cpuinfo) >= avx2 and native.runnable_forms(native.cpu_flags(cpuinfo)) \
        == ("avx2",)


def timed_choice(form: str):
    """bf16 projections: ``linear`` on a form without BF16 dot instructions; with them, torch's
    bf16 GEMM from WIDEN_ROWS rows on where it was timed faster (``dense`` docstring)."""
    if form != "avx512_bf16":
        return dense.linear
    return dense.decode_linear if dense.bf16_gemm_timing() < 1 else dense.mixed_linear


def test_the_timed_choice_follows_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense, "bf16_dot", lambda: True)
    for timing, choice in ((0.8, dense.decode_linear), (1.3, dense.mixed_linear)):
        monkeypatch.setattr(dense, "bf16_gemm_timing", lambda t=timing: t)
        assert dense.preferred_linear(torch.bfloat16) is choice, timing
    monkeypatch.setattr(dense, "bf16_dot", lambda: False)
    assert dense.preferred_linear(torch.bfloat16) is dense.linear
    for timing, choice in (((0.9, 1.5, 2.0), None), ((3.0, 0.9, 0.8), dense.decode_linear),
                           ((3.0, 1.9, 0.95), dense.decode_linear),
                           ((3.0, 2.0, 1.4), dense.linear)):
        monkeypatch.setattr(dense, "fp32_gemm_timing", lambda t=timing: t)
        assert dense.preferred_linear(torch.float32) is choice, timing
        # decode_linear's native rows: up to WIDEN_ROWS where it was the faster at 32 rows too
        rows = dense.WIDEN_ROWS if timing[1] > 1 else dense.DECODE_ROWS
        assert dense.fp32_decode_rows() == rows, timing
        for m, form in ((rows - 1, "native"), (rows, "torch")):
            assert dense.product_form(dense.decode_linear, torch.float32, m) == form, (timing, m)
        assert dense.product_form(dense.decode_linear, torch.float16, dense.DECODE_ROWS) \
            == "torch"  # (the fp32 timing moves fp32 weights' range alone)


def fp32_choice():
    small, _, large = dense.fp32_gemm_timing()
    return None if small <= 1 else dense.linear if large > 1 else dense.decode_linear


@pytest.mark.parametrize("form", HERE)
def test_forcing_a_form_and_saying_which_runs(form: str) -> None:
    with forced(form):
        st = native.status()
        assert st.available and st.isa == form and st.forced, st.reason
        assert st.form == native.FORM_DESCRIPTIONS[form]
        assert native.cpu_form() == f"{st.form}, forced by {native.ENV_FORM}"
        assert native.library().cpu_form() == form
        assert dense.preferred_linear(torch.bfloat16) is timed_choice(form)
        assert dense.preferred_linear(torch.float32) is fp32_choice()
    st = native.status()  # unforced: the fastest
    assert st.isa == HERE[0] and not st.forced and "(" in native.cpu_form()


def test_a_form_the_cpu_cannot_run_is_refused_with_the_reason() -> None:
    with forced("avx9"):
        st = native.status()
        assert not st.available and "not a CPU form" in st.reason
        assert native.cpu_form().startswith("none (")
    missing = set(native.FORMS) - set(HERE)
    for form in missing:
        with forced(form):
            assert "lacks" in native.status().reason


def test_the_environment_variable_is_read_at_start() -> None:
    form = HERE[-1]
    out = subprocess.run(
        [sys.executable, "-c", "from pagedhybrid.kernels import native; print(native.cpu_form())"],
        env={**os.environ, native.ENV_FORM: form}, capture_output=True, text=True, check=True,
        timeout=120)
    assert out.stdout.strip().splitlines()[-1] == \
        f"{native.FORM_DESCRIPTIONS[form]}, forced by {native.ENV_FORM}"


# -- each kernel in each form against a float64 reference ----------------------------------------


def _attention_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                         tables: list[list[int]], q_lens: list[int], past: list[int],
                         scale: float) -> torch.Tensor:
    hq, hkv, d = q.shape[1], kc.shape[2], q.shape[2]
    outs, row = [], 0
    for table, n, p in zip(tables, q_lens, past, strict=True):
        keys = kc[table].reshape(-1, hkv, d)[:p + n].double().repeat_interleave(hq // hkv, 1)
        vals = vc[table].reshape(-1, hkv, d)[:p + n].double().repeat_interleave(hq // hkv, 1)
        for i in range(n):
            s = torch.einsum("hd,khd->hk", q[row + i].double(), keys[:p + i + 1]) * scale
            outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vals[:p + i + 1]))
        row += n
    return torch.stack(outs)


CACHES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("cache", CACHES, ids=str)
# head_dim 256 as in every Qwen3.5: 8 query / 2 KV heads (0.8B, 2B), 24 / 4 (27B), and GQA 8:1
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (6, 3, 40), (8, 2, 256), (24, 4, 256),
                                              (8, 1, 256)])
def test_paged_attention(form: str, cache: torch.dtype, hq: int, hkv: int, d: int) -> None:
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(d + hq)
    bs, q_lens, past = 16, [1, 3, 1], [700, 20, 0]  # 700 crosses a KV split
    need = [-(-(p + n) // bs) for p, n in zip(past, q_lens, strict=True)]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(3)]
    pages = len(perm)
    if cache == torch.int8:
        kc, vc = (torch.randint(-100, 100, (pages, bs, hkv, d), generator=gen).to(cache)
                  for _ in "kv")
        qscale = 0.01  # scores of a sensible size on raw int8 values
    else:
        kc, vc = (torch.randn(pages, bs, hkv, d, generator=gen).to(cache) for _ in "kv")
        qscale = 1.0
    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=gen) * qscale
    width = max(need) + 1
    table = torch.full((3, width), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    out = torch.empty(n, hq, d)
    cu = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    lib.paged_attention(q, kc, vc, table, cu, torch.tensor(past, dtype=torch.int32),
                        torch.arange(3, dtype=torch.int32), out, d ** -0.5, native.KV_SPLIT)
    want = _attention_reference(q, kc, vc, tables, q_lens, past, d ** -0.5)
    # the bf16 pairs path (AVX512-BF16, head dims in 32-dim pairs) rounds q and P to bf16
    pairs = form == "avx512_bf16" and cache == torch.bfloat16 and d % 32 == 0
    tol = 2e-2 if pairs else 2e-5
    scale = want.abs().max().item()
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * scale)


def _gdn_reference(x: dict[str, torch.Tensor], init: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    s = init.double().clone()  # [B, Hv, Dv, Dk]
    hv, hk = x["v"].shape[1], x["q"].shape[1]
    q = x["q"].double().repeat_interleave(hv // hk, 1)
    k = x["k"].double().repeat_interleave(hv // hk, 1)
    g = -x["a_log"].double().exp() * F.softplus(x["a"].double() + x["dt_bias"].double())
    beta = torch.sigmoid(x["b"].double())
    s = s * g.exp()[..., None, None]
    u = beta[..., None] * (x["v"].double() - torch.einsum("bhvk,bhk->bhv", s, k))
    s = s + u[..., None] * k[:, :, None, :]
    return scale * torch.einsum("bhvk,bhk->bhv", s, q), s


@pytest.mark.parametrize("form", HERE)
# Qwen3.5's GDN layers: 16 key heads of 128 with 16 (0.8B / 2B), 32 (4B) or 48 (27B) value heads
# and the other paths of gdn_token: Dk of 1, 2 or 16 vectors with an odd Dv (the last row alone),
# Dk of no whole vectors (24) or of 3 / 6 (48: the scalar loops)
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 6, 128, 128), (1, 2, 24, 7),
                                                    (16, 16, 128, 128), (16, 32, 128, 128),
                                                    (16, 48, 128, 128), (1, 2, 32, 7),
                                                    (1, 1, 16, 1), (2, 2, 256, 3), (1, 2, 48, 6)])
def test_gated_delta_decode(form: str, hk: int, hv: int, dk: int, dv: int) -> None:
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(dk)
    b = 3
    x = {"q": F.normalize(torch.randn(b, hk, dk, generator=gen), dim=-1),
         "k": F.normalize(torch.randn(b, hk, dk, generator=gen), dim=-1),
         "v": torch.randn(b, hv, dv, generator=gen), "a": torch.randn(b, hv, generator=gen),
         "b": torch.randn(b, hv, generator=gen), "a_log": torch.randn(hv, generator=gen) * 0.5,
         "dt_bias": torch.randn(hv, generator=gen)}
    pool = torch.randn(5, hv, dv, dk, generator=gen)
    slots, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    init = pool[slots].clone()
    init[fresh] = 0
    out = torch.empty(b, hv, dv)
    got_pool = pool.clone()
    lib.gated_delta_decode(*x.values(), got_pool, slots, fresh, out, dk ** -0.5)
    want, state = _gdn_reference(x, init, dk ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool[slots].double(), state, rtol=1e-5, atol=1e-5)
    others = [1, 3]
    assert torch.equal(got_pool[others], pool[others])


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_causal_conv_decode(form: str, dtype: torch.dtype) -> None:
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(5)
    b, c, kk = 3, 70, 4
    x = torch.randn(b, c, generator=gen).to(dtype)
    w = torch.randn(c, kk, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype)
    pool = torch.randn(4, c, kk - 1, generator=gen).to(dtype)
    slots, fresh = torch.tensor([2, 0, 3]), torch.tensor([False, True, False])
    got_pool, y = pool.clone(), torch.empty_like(x)
    lib.causal_conv_decode(x, w, bias, got_pool, slots, fresh, y, True)
    window = torch.cat([pool[slots].double(), x.double()[:, :, None]], dim=2)  # [B, C, K]
    window[1, :, :-1] = 0
    pre = (window * w.double()).sum(-1) + bias.double()
    want = F.silu(pre)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    assert torch.equal(got_pool[slots], window[:, :, 1:].to(dtype))


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_linear_widens_weights_exactly(form: str, wdtype: torch.dtype) -> None:
    """fp32 FMAs on widened weights: close to float64, and bitwise the same for a row whether it
    runs alone (weights widened in registers) or among 37 (panels widened first)."""
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(6)
    m, k, n = 37, 203, 45
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(wdtype)
    out = torch.empty(m, n)
    lib.linear_invariant(x, w, out)
    want = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for r in (0, 17, 36):
        one = torch.empty(1, n)
        lib.linear_invariant(x[r:r + 1].contiguous(), w, one)
        assert torch.equal(one[0], out[r]), r


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 203, 45), (5, 64, 33), (16, 203, 45),
                                          (37, 600, 70), (100, 96, 16)])
def test_linear_fast_form(form: str, wdtype: torch.dtype, m: int, k: int, n: int) -> None:
    """``linear`` (decode rows: the streamed kernel; 16 rows on: packed panels, K blocks,
    partial micro-blocks and panels) against float64."""
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(wdtype)
    out = torch.full((m, n), float("nan"))
    lib.linear(x, w, out)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    if wdtype != torch.float32:  # activations and out in the weights' dtype too
        xw, outw = x.to(wdtype), torch.empty(m, n, dtype=wdtype)
        lib.linear(xw, w, outw)
        tol = 1e-2 if wdtype == torch.bfloat16 else 2e-3  # out rounded once to wdtype
        torch.testing.assert_close(outw.double(), xw.double() @ w.double().T, rtol=tol, atol=tol)
        wide = torch.empty(m, n)  # the rows widened exactly: fp32 rows give the same bits
        lib.linear(xw.float(), w, wide)
        assert torch.equal(outw, wide.to(wdtype))
        inv = torch.empty(m, n, dtype=wdtype)  # the invariant form rounds the same way
        lib.linear_invariant(xw, w, inv)
        one = torch.empty(1, n, dtype=wdtype)
        lib.linear_invariant(xw[-1:].contiguous(), w, one)
        assert torch.equal(one[0], inv[-1])


@pytest.mark.parametrize("form", HERE)
def test_pointwise(form: str) -> None:
    lib = native.form_library(form)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 8
    for op, fn in (("silu_invariant", F.silu), ("sigmoid_invariant", torch.sigmoid)):
        out = torch.empty_like(x)
        getattr(lib, op)(x, out)
        torch.testing.assert_close(out.double(), fn(x.double()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 4096, 4101, 151936])
def test_greedy_rows_is_argmax_or_minus_one(form: str, vocab: int) -> None:
    """The sampler's greedy pick is torch.argmax (first maximum on ties), and -1 for a row with
    a NaN, +inf or -inf anywhere -- in the vector body and in the tail; a row alone picks what
    it picks in the batch."""
    lib = native.form_library(form)
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g) * 5
    x[1] = 0.25  # every value tied: index 0
    x[2, vocab // 3:] = 9.0  # a tie starting inside the row
    x[3, vocab - 1] = float("nan")  # in the tail
    x[4, 0] = float("inf")
    x[5, vocab // 2] = -float("inf")
    x[6, vocab - 1] = 1e30  # the maximum in the tail
    out = lib.greedy_rows(x)
    assert out.dtype == torch.int64 and out.shape == (8,)
    want = x.argmax(dim=-1).masked_fill(~torch.isfinite(x).all(dim=-1), -1)
    assert out.tolist() == want.tolist()
    for r in range(8):
        assert lib.greedy_rows(x[r:r + 1].contiguous()).item() == out[r].item()


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 4096, 4101])
def test_a_packed_grammar_mask_picks_and_refuses_as_the_unpacked_one(form: str,
                                                                     vocab: int) -> None:
    """A grammar's packed mask (int32 [R, ceil(V / 32)]): greedy_rows takes the first maximum
    over the allowed tokens (-1 for a non-finite row or nothing allowed; bits past the
    vocabulary never count) and apply_token_bitmask_ writes -inf over exactly the refused
    tokens -- what masked_fill of the unpacked bool mask gives, in whole words, partial words
    and the tail."""
    lib = native.form_library(form)
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    x = (torch.randn(8, vocab, generator=g) * 4).round()  # ties within allowed tokens
    bits = torch.randint(-(1 << 31), 1 << 31, (8, words), generator=g).to(torch.int32)
    bits[0] = -1  # everything allowed
    bits[1] = 0  # nothing allowed
    bits[2] = 0
    bits[2, -1] = torch.tensor((vocab - 1) % 32).exp2().long().to(torch.int32)  # the last token
    x[3, 0] = float("nan")  # allowed or not, the row is refused
    bits[4, -1] = -1  # the tail's word all set, bits past the vocabulary too
    x[5] = 2.0  # all tied: the first allowed
    ok = unpack_bitmask(bits, vocab)
    want = x.masked_fill(~ok, -float("inf")).argmax(dim=-1)
    want[~ok.any(dim=-1) | ~torch.isfinite(x).all(dim=-1)] = -1
    assert lib.greedy_rows(x, bits).tolist() == want.tolist()
    assert greedy_rows(x.double(), bits).tolist() == want.tolist()  # torch's, for fp64
    y = x.clone()
    lib.apply_token_bitmask_(y, bits)
    masked = x.masked_fill(~ok, -float("inf"))
    assert torch.equal(y.nan_to_num(7.0), masked.nan_to_num(7.0))
    z = apply_token_bitmask_(x.double(), bits)  # torch's rule
    assert torch.equal(z.float().nan_to_num(7.0), masked.nan_to_num(7.0))


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 4096, 4101])
def test_top_rows_are_the_first_of_the_greedy_order(form: str, vocab: int) -> None:
    """A refused greedy row's candidates: the k best tokens of the rows asked for, by value then
    by id -- exactly the first k of the order greedy_rows picks in (a stable descending sort),
    ties across the vector body, the tail and the k-th place included; any row, any order, a
    row twice; the torch form where the library is not loaded gives the same."""
    lib = native.form_library(form)
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(6, vocab, generator=g) * 3).round()  # many ties
    x[1] = 0.5  # all tied: the first k ids
    x[2, vocab // 2:] = 40.0  # a tie run from the middle through the tail
    x[3, :vocab // 3] = -float("inf")
    x[4, -1] = 99.0  # the best in the tail
    rows = [5, 0, 2, 2, 4, 3, 1]
    vals, ids = x[rows].sort(dim=1, descending=True, stable=True)
    for k in sorted({1, min(8, vocab), vocab}):
        got_vals, got_ids = lib.top_rows(x, rows, k)
        assert got_ids.tolist() == ids[:, :k].tolist(), k
        assert torch.equal(got_vals, vals[:, :k]), k
        fb_vals, fb_ids = top_rows(x.double(), rows, k)  # the torch form
        assert fb_ids.tolist() == ids[:, :k].tolist() and torch.equal(fb_vals, vals[:, :k])
    assert lib.top_rows(x, [], 1)[1].shape == (0, 1)


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [7, 64, 256, 1000])
def test_norms(form: str, dtype: torch.dtype, d: int) -> None:
    """rms_norm (plain and offset), gated_rms_norm and l2_normalize against their formulas in
    float64, to one rounding of the output; each row is the same alone as in a batch; a bad
    argument is a ValueError naming the op and the argument."""
    lib = native.form_library(form)
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(9, d, generator=g) * 3).to(dtype)
    gate = (torch.randn(9, d, generator=g) * 4).to(dtype)
    w = (torch.randn(d, generator=g) * 0.5).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    x64, g64, w64 = x.double(), gate.double(), w.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    for offset in (True, False):
        out = torch.empty_like(x)
        lib.rms_norm(x, w, out, 1e-6, offset)
        want = normed * (1 + w64 if offset else w64)
        torch.testing.assert_close(out.double(), want, **tol)
        one = torch.empty_like(x[-1:])
        lib.rms_norm(x[-1:].contiguous(), w, one, 1e-6, offset)
        assert torch.equal(one[0], out[-1])
    out = torch.empty_like(x)
    lib.gated_rms_norm(x, gate, w, out, 1e-6)
    torch.testing.assert_close(out.double(), normed * w64 * F.silu(g64), **tol)
    l2 = torch.empty(x.shape, dtype=torch.float32)
    lib.l2_normalize(x, l2, 1e-6)
    want = x64 * torch.rsqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"pagedhybrid\.rms_norm: w: size\(0\)"):
        lib.rms_norm(x, w[:-1].contiguous(), torch.empty_like(x), 1e-6, True)
    with pytest.raises(ValueError, match=r"pagedhybrid\.l2_normalize: out: must be Float"):
        lib.l2_normalize(x, torch.empty(x.shape, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("form", HERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 64, 64), (1, 2, 24, 7),
                                                    (16, 48, 128, 128)])
def test_fused_gdn_decode_mixer_equals_the_separate_ops(form: str, dtype: torch.dtype, hk: int,
                                                        hv: int, dk: int, dv: int) -> None:
    """gdn_decode_mixer on row views of one merged projection computes every bit of its output
    and of both pools as causal_conv_decode, l2_normalize (q, k), gated_delta_decode, the
    rounding to the model dtype and gated_rms_norm do one after the other."""
    lib = native.form_library(form)
    gen = torch.Generator().manual_seed(hv * dk + dv)
    b, kk = 3, 4
    c, vd = 2 * hk * dk + hv * dv, hv * dv
    proj = torch.randn(b, c + vd + 2 * hv, generator=gen).to(dtype)  # [qkv | z | a | b]
    qkv, z = proj[:, :c], proj[:, c:c + vd]
    a, bb = proj[:, c + vd:c + vd + hv], proj[:, c + vd + hv:]
    w = (torch.randn(c, kk, generator=gen) * 0.5).to(dtype)
    cpool = torch.randn(5, c, kk - 1, generator=gen).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    pool = torch.randn(5, hv, dv, dk, generator=gen)
    nw = (torch.randn(dv, generator=gen) * 0.5 + 1).to(dtype)
    slots, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    scale = dk ** -0.5

    cp1, sp1 = cpool.clone(), pool.clone()
    mixed = torch.empty(b, c, dtype=dtype)
    lib.causal_conv_decode(qkv.contiguous(), w, None, cp1, slots, fresh, mixed, True)
    qn, kn = (torch.empty(b * hk, dk) for _ in "qk")
    lib.l2_normalize(mixed[:, :hk * dk].reshape(b * hk, dk).contiguous(), qn, 1e-6)
    lib.l2_normalize(mixed[:, hk * dk:2 * hk * dk].reshape(b * hk, dk).contiguous(), kn, 1e-6)
    core = torch.empty(b, hv, dv)
    lib.gated_delta_decode(qn.view(b, hk, dk), kn.view(b, hk, dk),
                           mixed[:, 2 * hk * dk:].float().reshape(b, hv, dv).contiguous(),
                           a.float().contiguous(), bb.float().contiguous(), a_log, dt_bias, sp1,
                           slots, fresh, core, scale)
    want = torch.empty(b * hv, dv, dtype=dtype)
    lib.gated_rms_norm(core.to(dtype).view(b * hv, dv), z.reshape(b * hv, dv), nw, want, 1e-6)

    cp2, sp2 = cpool.clone(), pool.clone()
    got = torch.empty(b, vd, dtype=dtype)
    lib.gdn_decode_mixer(qkv, z, a, bb, w, cp2, a_log, dt_bias, sp2, slots, fresh, nw, got, hk,
                         scale, 1e-6, 1e-6)
    assert torch.equal(got, want.view(b, vd))
    assert torch.equal(cp2, cp1) and torch.equal(sp2, sp1)


# -- the forms side by side: one result, to float noise -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_step_seam_agrees_with_the_reference_in_every_form(dtype: torch.dtype) -> None:
    """Attention, conv and gated delta as the model calls them (a decode + a short
    continuation), with the process forced into each form, against the reference step."""
    gen = torch.Generator().manual_seed(8)
    bs, hq, hkv, d = 16, 4, 2, 64
    meta = StepMetadata.build([1, 3, 1], [40, 5, 0], [[3, 0, 5], [2], [4]], [1, 3, 0],
                              block_size=bs, num_pages=6, num_slots=4)
    n = meta.num_tokens
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(6, bs, hkv, d, generator=gen).to(dtype) for _ in "kv")
    x = torch.randn(n, 24, generator=gen).to(dtype)
    cw = (torch.randn(24, 1, 4, generator=gen) * 0.5).to(dtype)
    cpool = torch.randn(4, 24, 3, generator=gen).to(dtype)
    hk, hv, dk, dv = 1, 2, 32, 16
    gq, gk = (F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1) for _ in "qk")
    gv = torch.randn(n, hv, dv, generator=gen)
    ga, gb = torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen)
    a_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    spool = torch.randn(4, hv, dv, dk, generator=gen)

    def run(mod: Any) -> list[torch.Tensor]:
        kc2, vc2, cp2, sp2 = kc.clone(), vc.clone(), cpool.clone(), spool.clone()
        att = mod.attention(q, k, v, kc2, vc2, meta, d ** -0.5)
        conv = mod.causal_conv(x, cw, cp2, meta, "silu")
        gdn = mod.gated_delta(gq, gk, gv, ga, gb, a_log, dt_bias, sp2, meta, dk ** -0.5)
        return [att, kc2, vc2, conv, cp2, gdn, sp2]

    want = run(ref_step)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for form in HERE:
        with forced(form):
            got = run(native_seam)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decode_linear_in_every_form(dtype: torch.dtype) -> None:
    """``dense.decode_linear`` (the native kernel below DECODE_ROWS rows, torch's GEMM from
    there on) and ``dense.mixed_linear`` (the widened fp32 GEMM from WIDEN_ROWS rows on) agree
    with torch's product."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(40, 264, generator=gen) * 0.1).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else (2e-3 if dtype == torch.float16 else 1e-5)
    for rows in (1, 3, dense.DECODE_ROWS - 1, dense.DECODE_ROWS, 40, dense.WIDEN_ROWS - 1,
                 dense.WIDEN_ROWS + 3):
        x = torch.randn(rows, 264, generator=gen).to(dtype)
        for form in HERE:
            for fn in (dense.decode_linear, dense.mixed_linear):
                with forced(form):
                    got = fn(x, w)
                assert got.dtype == dtype and got.shape == (rows, 40)
                torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=tol,
                                           atol=tol)


def test_bf16_pairs_are_exact_products_in_one_order_per_element() -> None:
    """bf16 rows against bf16 weights: every form's native kernels (decode_linear, linear,
    linear_invariant) agree with the float64 product within bf16 rounding; each row's result is
    the same bits whatever else is in the call (1 to 70 rows, K with and without a 32-element
    tail); on the avx512_bf16 form the pairs run by vdpbf16ps -- a subnormal activation counts
    as 0 there (the instruction flushes it), as it does in no widening form -- and decode_linear
    keeps the native kernel up to PAIR_ROWS rows."""
    gen = torch.Generator().manual_seed(31)
    for k in (64, 136, 1000):
        w = (torch.randn(72, k, generator=gen) * 0.1).bfloat16()
        x = torch.randn(70, k, generator=gen).bfloat16()
        want = x.double() @ w.double().T
        for form in HERE:
            with forced(form):
                alone = [dense.invariant_linear(x[r:r + 1], w) for r in range(len(x))]
                for rows in (1, 2, 5, 8, 9, 16, 33, 63, 70):
                    inv = dense.invariant_linear(x[:rows], w)
                    assert all(torch.equal(inv[r], alone[r][0]) for r in range(rows)), (form, k)
                    fast = dense.linear(x[:rows], w)
                    if rows < dense.PAIR_ROWS and form == "avx512_bf16":  # the same kernel
                        assert torch.equal(fast, inv), (form, k, rows)
                    for got in (inv, fast, dense.decode_linear(x[:rows], w)):
                        torch.testing.assert_close(got.double(), want[:rows], rtol=1e-2,
                                                   atol=1e-2)
                pairs = dense.product_form(dense.decode_linear, torch.bfloat16, 40) == "native"
                assert pairs == (form == "avx512_bf16")
                tiny = torch.zeros(1, k, dtype=torch.bfloat16)
                tiny[0, 0] = 2.0 ** -130  # subnormal in bf16
                big = torch.zeros(1, k, dtype=torch.bfloat16)
                big[0, 0] = 2.0 ** 100
                got = float(dense.invariant_linear(tiny, big)[0, 0])
                assert got == (0.0 if form == "avx512_bf16" else 2.0 ** -30), (form, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dense_linear_in_every_form(dtype: torch.dtype) -> None:
    """``dense.linear`` (the projection of bf16 models on forms without BF16 dot instructions)
    against torch's: fp32 accumulation, rounded once to the model dtype."""
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(72, 96, generator=gen) * 0.1).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for lead in ((2, 5), (3, 40)):  # the native kernel; 64 rows and more: widened chunks
        x = torch.randn(*lead, 96, generator=gen).to(dtype)
        want = (x.double() @ w.double().T)
        for form in HERE:
            with forced(form):
                got = dense.linear(x, w)
            assert got.dtype == dtype and got.shape == (*lead, 72)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
            torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=tol, atol=tol)
    x = torch.randn(70, 96, generator=gen)  # fp32 activations on bf16 / fp16 weights
    got = dense.linear(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_calls_from_many_python_threads_at_once() -> None:
    """The helper threads serve one call at a time; a call made while another runs computes on
    its own thread. Every result is the one a lone call gives (these kernels are deterministic:
    no reduction is split across threads)."""
    lib = native.library()
    gen = torch.Generator().manual_seed(10)
    x, w = torch.randn(40, 256, generator=gen), torch.randn(300, 256, generator=gen).bfloat16()
    xs = torch.randn(3, 256, generator=gen)
    want, want_s = torch.empty(40, 300), torch.empty(3, 300)
    lib.linear(x, w, want)
    lib.linear(xs, w, want_s)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(2, threads_before))
    bad: list[int] = []

    def worker(i: int) -> None:
        for _ in range(20):
            out, out_s = torch.empty(40, 300), torch.empty(3, 300)
            lib.linear(x, w, out)
            lib.linear(xs, w, out_s)
            if not (torch.equal(out, want) and torch.equal(out_s, want_s)):
                bad.append(i)

    try:
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        torch.set_num_threads(threads_before)
    assert not bad


@pytest.mark.parametrize("form", HERE)
def test_the_engine_multiplies_with_the_forms_preferred_linear(form: str, tmp_path) -> None:
    """A bf16 model on the native bundle projects with ``dense.linear`` where the form has no
    BF16 dot instructions (``decode_linear`` where it has), says so at start, and scores what the
    torch bundle scores."""
    import dataclasses

    from pagedhybrid.engine import Engine, EngineConfig
    from pagedhybrid.models.qwen35 import load
    from pagedhybrid.models.qwen35.synthetic import (
        random_weights,
        tiny_byte_config,
        write_checkpoint,
    )

    cfg = dataclasses.replace(tiny_byte_config(), num_hidden_layers=2,
                              layer_types=("linear_attention", "full_attention"),
                              tie_word_embeddings=False)
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=3))
    prompt, completion = list(range(5, 40)), list(range(60, 72))
    ref = Engine(load(tmp_path, dtype=torch.bfloat16), EngineConfig(backend="torch"))
    want = torch.tensor(ref.score([prompt], [completion])[0])
    with forced(form):
        engine = Engine(load(tmp_path, dtype=torch.bfloat16), EngineConfig(backend="native"))
        choice = timed_choice(form)
        mms = {m.matmul for m in engine.model.modules() if hasattr(m, "matmul")}
        assert mms == {choice}
        summary = engine.runner.kernel_summary()
        assert f"CPU form {native.FORM_DESCRIPTIONS[form]}" in summary, summary
        assert f"projections: dense.{choice.__name__}" in summary, summary
        assert ("timed at start" in summary) == (form == "avx512_bf16"), summary
        got = torch.tensor(engine.score([prompt], [completion])[0])
    assert torch.allclose(got, want, atol=0.1, rtol=0), (got - want).abs().max()
