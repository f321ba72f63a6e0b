"""int8 / int4 weights: the format (``weightquant``) and the native kernels (``csrc/quant.cpp``).

* format: spellings parse and bad ones are refused naming the option; codes are MatMulNBits'
  layout (element 2j in the low nibble), round to nearest with the float16 scale the runtimes
  multiply by; each element within half a step of its weight; a zero block; a scale past
  float16 refused naming the tensor;
* kernels vs ``reference_linear`` (the activations quantised as the kernels quantise them, the
  weights dequantised, float64): every format, fp32 / bf16 / fp16 activations, K not a multiple
  of the block, M = 1..33; the integer form is batch-invariant (a row's bits do not depend on
  the other rows); the prefill form (dequantised chunks and the fp32 GEMM) vs
  dequantise-then-matmul; ``quant_dequantize`` equals ``dequantize`` bit for bit;
* the engine's order (``group_rows``: groups of 16 rows, a spec ending in " grouped" here): the
  same bytes back (``ungroup``); the kernels on it vs the reference on every CPU form, each
  element the same bits on every form (a fused layer's call mixing grouped weights and weights
  in rows: tests/models/test_qwen35_packed.py, bit for bit against the modules).
"""

from __future__ import annotations

import pytest
import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native import form_library, quant, runnable_forms, status
from pagedhybrid.weightquant import (
    QuantizedWeight,
    WeightFormat,
    dequantize,
    group_rows,
    quantize,
    quantize_rows,
    reference_linear,
    ungroup,
    unpack_codes,
)

FORMATS = ["int8", "int8:32", "int8:64:asym", "int4", "int4:64", "int4:128", "int4:32:asym",
           "int4:256:asym", "int4:channel"]
GROUPED = [f"{spec} grouped" for spec in [*FORMATS, "int8:channel:asym"]]  # as the engine


def held(w: torch.Tensor, spec: str) -> QuantizedWeight:
    """``w`` quantised in ``spec``; a spec ending in " grouped" in the engine's order."""
    name, _, order = spec.partition(" ")
    q = quantize(w, WeightFormat.parse(name))
    if order:
        q = group_rows(q)
        assert q.grouped
    return q
SHAPES = [(1, 256, 64), (2, 32, 3), (3, 96, 17), (5, 200, 33), (17, 1000, 70), (33, 160, 9)]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert status().available, status().reason  # make test builds the extension first


def test_spellings() -> None:
    assert WeightFormat.parse("int4") == WeightFormat(4, 32, True)
    assert WeightFormat.parse("INT8") == WeightFormat(8, 0, True)
    assert WeightFormat.parse("int4:128:asym") == WeightFormat(4, 128, False)
    assert WeightFormat.parse("int8:channel:asym") == WeightFormat(8, 0, False)
    for spec in FORMATS:
        assert WeightFormat.parse(WeightFormat.parse(spec).name) == WeightFormat.parse(spec)
    for bad in ("int3", "int4:48", "int4:32:sym", "fp8", "int4:32:asym:x", ""):
        with pytest.raises(ContractViolation, match="'quantization' must be int8 or int4"):
            WeightFormat.parse(bad)
    with pytest.raises(ContractViolation, match="'block' must be one of"):
        WeightFormat(4, 48)


def test_codes_are_matmulnbits_layout_and_round_to_nearest() -> None:
    w = torch.tensor([[0.0, 1.0, -2.0, 3.0] * 8 + [0.5] * 32])  # [1, 64]: two blocks of 32
    q = quantize(w, WeightFormat.parse("int4"))
    assert q.codes.shape == (1, 2, 16) and q.scales.shape == (1, 2) and q.zeros is None
    s = q.scales[0, 0].float().item()
    assert s == pytest.approx(3.0 / -8.0, rel=1e-3)  # the largest element lands on code 0
    codes = unpack_codes(q)[0, 0]
    want = torch.round(w[0, :32] / s) + 8
    assert torch.equal(codes.float(), want.clamp(0, 15))
    assert q.codes[0, 0, 0].item() == codes[0].item() | (codes[1].item() << 4)  # 2j low nibble
    assert torch.equal(q.codes[0, 1], torch.full((16,), 0, dtype=torch.uint8))  # 0.5 -> code 0
    zero = quantize(torch.zeros(3, 40), WeightFormat.parse("int8:32:asym"))
    assert not zero.scales.float().any() and torch.equal(dequantize(zero), torch.zeros(3, 40))
    with pytest.raises(ContractViolation, match=r"'layers\.0\.w' has a block whose scale exceeds"):
        quantize(torch.full((2, 32), 1e6), WeightFormat.parse("int4"), "layers.0.w")
    with pytest.raises(ContractViolation, match="'w' must be finite"):
        quantize(torch.tensor([[float("nan")] * 32]), WeightFormat.parse("int8"), "w")


@pytest.mark.parametrize("spec", FORMATS)
def test_dequantised_weights_are_within_a_step(spec: str) -> None:
    fmt = WeightFormat.parse(spec)
    w = torch.randn(24, 200, generator=torch.Generator().manual_seed(1)) * 0.05
    q = quantize(w, fmt)
    step = q.scales.float().abs().repeat_interleave(q.block, dim=1)[:, :200]
    err = (dequantize(q) - w).abs()
    # half a step; one where a level can be clamped away (symmetric int4's +8, an asymmetric
    # range shifted by its rounded zero point)
    bound = step * (0.5 if fmt.bits == 8 and fmt.symmetric else 1.0) * 1.01 + 1e-6  # (fp16 scale)
    assert (err <= bound).all()
    rel = ((dequantize(q) - w).norm() / w.norm()).item()
    assert rel < (0.01 if fmt.bits == 8 else 0.12)


@pytest.mark.parametrize("spec", FORMATS + GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference(spec: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for m, k, n in SHAPES:
        n = -(-n // 16) * 16 if spec.endswith("grouped") else n  # (groups of 16 rows)
        q = held(torch.randn(n, k, generator=gen) * 0.05, spec)
        x = torch.randn(m, k, generator=gen).to(dtype)
        want = reference_linear(x.float(), q).double()
        got = quant.invariant_linear(x, q)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32 sums; one rounding to 16 bits
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, (spec, m, k, n, dtype, err.item())


@pytest.mark.parametrize("form", runnable_forms())
@pytest.mark.parametrize("spec", ["int4", "int4:32:asym", "int4:64", "int8", "int8:32",
                                  "int8:64:asym"])
def test_every_cpu_form_matches_the_reference(form: str, spec: str) -> None:
    """Each CPU form this machine runs (the AVX-512 forms take 4-bit blocks of 32 as 512-bit
    quads of sub-blocks, the zero points' correction in the same loop; then the 16-block
    groups' leftover quads, a pair and a last sub-block; 8-bit codes per channel, in blocks of
    32 and with zero points) against the reference, K from 1 to 33 sub-blocks across those
    boundaries, M = 1..6; a row's bits are its bits alone."""
    fmt = WeightFormat.parse(spec)
    lib = form_library(form)
    gen = torch.Generator().manual_seed(9)
    for k in (32, 96, 200, 640, 1000, 1056):
        q = quantize(torch.randn(37, k, generator=gen) * 0.05, fmt)
        x = torch.randn(6, k, generator=gen)
        out = torch.full((6, 37), float("nan"))
        lib.quant_linear(x, q.codes, q.scales, q.zeros, fmt.bits, out)
        want = reference_linear(x, q).double()
        err = (out.double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, (form, spec, k, err.item())
        for r in (0, 3, 5):
            one = torch.empty(1, 37)
            lib.quant_linear(x[r:r + 1].contiguous(), q.codes, q.scales, q.zeros, fmt.bits, one)
            assert torch.equal(one[0], out[r]), (form, spec, k, r)


@pytest.mark.parametrize("spec", GROUPED)
def test_grouped_codes_are_the_same_bytes(spec: str) -> None:
    """Line j of a block: 16 rows' four bytes, row i at 4i (8-bit: elements 4j ..; 4-bit:
    element 8j + t low and 8j + 4 + t high in byte t); scales and zero points by group; back
    byte for byte; a weight whose N is not a multiple of 16 stays in rows."""
    q = held(torch.randn(48, 200, generator=torch.Generator().manual_seed(11)), spec.split()[0])
    g = group_rows(q)
    nb, block = q.scales.shape[1], q.block
    assert g.codes.shape == (3, nb, block * q.fmt.bits // 32, 64) and g.shape == q.shape
    assert g.block == block and g.scales.shape == (3, nb, 16)
    row, e = 21, block - 7  # group 1, row 5; the last block's element e
    line, at = g.codes[1, nb - 1, :, 4 * 5:4 * 5 + 4], unpack_codes(q)[row, nb - 1]
    if q.fmt.bits == 8:
        assert line[e // 4, e % 4] == at[e]
    else:
        t = e % 8
        assert (line[e // 8, t % 4] >> (4 * (t // 4))) & 0x0F == at[e]
    assert g.scales[1, nb - 1, 5] == q.scales[row, nb - 1]
    back = ungroup(g)
    for got, want in zip(back, q, strict=True):
        assert (got is None and want is None) or (
            torch.is_tensor(got) and torch.equal(got, want)) or got == want
    assert torch.equal(dequantize(g), dequantize(q))
    assert torch.equal(unpack_codes(g), unpack_codes(q))
    odd = held(torch.randn(8, 64), spec.split()[0])
    assert group_rows(odd) is odd and group_rows(g) is g


@pytest.mark.parametrize("form", runnable_forms())
@pytest.mark.parametrize("spec", ["int8 grouped", "int8:64:asym grouped", "int4 grouped",
                                  "int4:32:asym grouped", "int4:128 grouped"])
def test_grouped_codes_on_every_cpu_form(form: str, spec: str) -> None:
    """vpdpbusd on 16 rows at a time (the VNNI forms) or 8 with vpmaddubsw: each element the
    reference's within fp32 accumulation, its bits its own whatever M, the same on every form
    (the forms do each element's float operations in one order); K past whole blocks."""
    lib, base = form_library(form), form_library(runnable_forms()[-1])
    gen = torch.Generator().manual_seed(10)
    for n, k in ((48, 1000), (16, 32), (16, 96), (32, 1056)):
        q = held(torch.randn(n, k, generator=gen) * 0.05, spec)
        x = torch.randn(6, k, generator=gen)
        out, ref = torch.full((6, n), float("nan")), torch.full((6, n), float("nan"))
        lib.quant_linear(x, q.codes, q.scales, q.zeros, q.fmt.bits, out)
        base.quant_linear(x, q.codes, q.scales, q.zeros, q.fmt.bits, ref)
        want = reference_linear(x, q).double()
        assert ((out.double() - want).abs().max() / want.abs().max()) < 1e-5, (form, n, k)
        assert torch.equal(out, ref), (form, runnable_forms()[-1], n, k)
        for r in (0, 5):
            one = torch.empty(1, n)
            lib.quant_linear(x[r:r + 1].contiguous(), q.codes, q.scales, q.zeros, q.fmt.bits, one)
            assert torch.equal(one[0], out[r]), (form, n, k, r)


def test_the_activation_codes_are_the_kernels() -> None:
    """A weight of one-hot rows reads single activation codes back: q * d exactly."""
    k = 64
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    eye = torch.eye(k)
    q = quantize(eye, WeightFormat.parse("int8:32"))  # codes 127 / 255 and 128, scale 1/127
    xq, d = quantize_rows(x)
    want = (xq.float().view(3, -1, 32) * d[..., None]).flatten(1) @ dequantize(q).T
    got = quant.invariant_linear(x, q)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:32:asym", *GROUPED])
def test_the_integer_form_is_batch_invariant(spec: str) -> None:
    gen = torch.Generator().manual_seed(4)
    q = held(torch.randn(48, 300, generator=gen) * 0.05, spec)
    x = torch.randn(70, 300, generator=gen)
    full = quant.invariant_linear(x, q)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(30, 63), slice(69, 70)):
        assert torch.equal(quant.invariant_linear(x[rows], q), full[rows]), rows
    assert torch.equal(quant.invariant_linear(x.flip(0), q), full.flip(0))


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:128:asym", *GROUPED])
def test_the_prefill_form_is_dequantise_then_matmul(spec: str) -> None:
    gen = torch.Generator().manual_seed(5)
    q = held(torch.randn(304, 130, generator=gen) * 0.05, spec)
    x = torch.randn(quant.DEQUANT_ROWS + 9, 130, generator=gen)
    want = x.double() @ dequantize(q).double().T
    got = quant.linear(x, q)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    # below DEQUANT_ROWS rows the fast form is the integer kernel
    assert torch.equal(quant.linear(x[:5], q), quant.invariant_linear(x[:5], q))


@pytest.mark.parametrize("spec", FORMATS + GROUPED)
def test_dequantize_op_equals_dequantize(spec: str) -> None:
    from pagedhybrid.kernels.native import library

    q = held(torch.randn(16, 100, generator=torch.Generator().manual_seed(6)), spec)
    out = torch.empty(5, 100)
    library().quant_dequantize(q.codes, q.scales, q.zeros, q.fmt.bits, 3, out)
    assert torch.equal(out, dequantize(q)[3:8])
