"""The batch-invariant kernels, each against the batch: bitwise, never a tolerance (except vs the
float references, which they must also approximate).

* ``linear_invariant``: a row's output is the same for every row count, offset and thread count,
  and close to ``F.linear`` (torch's GEMM rows drift with the batch: shown too);
* ``silu`` / ``sigmoid``: an element's bits do not depend on the tensor's size, its place in it or
  the thread count (torch's do: its scalar tail rounds otherwise -- shown too);
* ``gated_delta_varlen`` / ``causal_conv_varlen``: one call over a whole chunk equals, bit for
  bit, the decode kernel run token after token, and approximates the chunked / stream forms; a
  sequence's rows do not depend on its place in the packed stream or its state slot;
* the native paged attention: a row of a prefill chunk equals the same row computed as a decode.

Head dims and widths are drawn beyond multiples of 16 (the vector width): their tails too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedhybrid.kernels.native import KV_SPLIT, status


@pytest.fixture(autouse=True)
def _native_kernels_built() -> None:
    """``make test`` builds the extension: a missing or stale build fails here, loudly."""
    assert status().available, status().reason


def lib():  # type: ignore[no-untyped-def]
    from pagedhybrid.kernels.native import library

    return library()


@pytest.mark.parametrize(("n", "k"), [(96, 64), (37, 1000), (258, 33)])
def test_linear_rows_do_not_depend_on_the_batch(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(70, k, generator=gen)
    full = torch.empty(70, n)
    lib().linear_invariant(x, w, full)
    for m, off, threads in ((1, 0, 1), (1, 33, 2), (3, 5, 2), (17, 50, 1), (64, 6, 2)):
        torch.set_num_threads(threads)
        part = torch.empty(m, n)
        lib().linear_invariant(x[off:off + m].contiguous(), w, part)
        assert torch.equal(part, full[off:off + m]), (m, off, threads)
    torch.set_num_threads(2)
    ref = F.linear(x.double(), w.double())
    assert (full.double() - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


# (1024, 4096): oneDNN splits K for this shape; (32000, 1024): an LM head; (24, 1024): a narrow
# GDN gate projection; (258, 64): the tiny test models
@pytest.mark.parametrize(("n", "k"), [(1024, 4096), (32000, 1024), (24, 1024), (258, 64)])
def test_bf16_linear_rows_do_not_depend_on_the_batch(n: int, k: int) -> None:
    """The bf16 seam (fixed oneDNN tiles): any rows, at any position, equal the rows alone."""
    from pagedhybrid.kernels.native.invariant import ROW_TILE, linear

    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(3 * ROW_TILE, k, generator=gen).bfloat16()
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(x.shape[0])])
    for m in (1, 2, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 7):
        rows = torch.randperm(x.shape[0], generator=gen)[:m]
        assert torch.equal(linear(x[rows], w), alone[rows]), m
    ref = F.linear(x.double(), w.double())
    assert (alone.double() - ref).abs().max() <= 1e-2 * max(1.0, ref.abs().max().item())


def test_torch_linear_rows_do_drift_with_the_batch() -> None:
    """Why the mode needs its own GEMM: torch's row results change with the row count."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(1024, 1000, generator=gen), torch.randn(128, 1000, generator=gen)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 16, 64))


WIDTHS = [4, 8, 12, 20, 24, 100]  # Dv (or hd) per token row: most are not whole vectors


@pytest.mark.parametrize("width", WIDTHS)
def test_silu_and_sigmoid_rows_do_not_depend_on_the_batch(width: int) -> None:
    from pagedhybrid.kernels.native.invariant import sigmoid, silu

    gen = torch.Generator().manual_seed(width)
    x = torch.randn(700, 4, width, generator=gen) * 6  # [T, heads, width], > 32768 elements
    threads = torch.get_num_threads()
    try:
        for fn, ref in ((silu, F.silu), (sigmoid, torch.sigmoid)):
            full = fn(x)
            for m, off, nt in ((1, 0, 1), (1, 699, 2), (3, 517, 2), (37, 40, 1), (400, 3, 2)):
                torch.set_num_threads(nt)
                assert torch.equal(fn(x[off:off + m]), full[off:off + m]), (fn, m, off, nt)
            torch.set_num_threads(threads)
            want = ref(x.double())
            assert ((full.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()
            xb = x.bfloat16()  # bf16 in, fp32 math, one rounding to bf16 out
            assert fn(xb).dtype == torch.bfloat16
            assert (fn(xb).float() - ref(xb.float())).abs().max() <= 2 ** -7 * x.abs().max()
    finally:
        torch.set_num_threads(threads)
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 100.0, -100.0, 1e4, -1e4,
                         float("inf"), float("nan")])
    assert torch.allclose(silu(edge), F.silu(edge), rtol=1e-6, atol=0, equal_nan=True)
    assert torch.allclose(sigmoid(edge), torch.sigmoid(edge), rtol=1e-6, atol=0,
                          equal_nan=True)


def test_torch_silu_rows_do_drift_with_the_batch() -> None:
    """Why the mode needs its own SiLU: a value head of 5 dims x 3 heads is 15 elements per
    token -- a multiple of neither AVX2's 8 lanes nor AVX-512's 16 -- so a token alone runs
    torch's scalar tail, the same token elsewhere its vector loop, and the two round
    differently (with 16 elements a token, AVX2 has no tail and the drift shows only with
    AVX-512)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(33, 3, 5, generator=gen) * 6
    full = F.silu(z)
    assert any(not torch.equal(F.silu(z[t:t + 1]), full[t:t + 1]) for t in range(33))


def _gdn_inputs(t: int, b: int = 2, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8,
                seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    return {"q": q, "k": k, "v": torch.randn(t, hv, dv, generator=gen),
            "a": torch.randn(t, hv, generator=gen), "b": torch.randn(t, hv, generator=gen),
            "a_log": torch.randn(hv, generator=gen) * 0.5,
            "dt_bias": torch.randn(hv, generator=gen)}


@pytest.mark.parametrize(("dk", "dv"), [(16, 8), (4, 24), (24, 4), (7, 12), (128, 100)])
def test_recurrent_prefill_equals_decode_token_by_token(dk: int, dv: int) -> None:
    lens = [7, 1, 12]
    n = sum(lens)
    x = _gdn_inputs(n, dk=dk, dv=dv)
    hv = 4
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    pool = torch.randn(5, hv, dv, dk)
    slots = torch.tensor([3, 0, 4])
    fresh = torch.tensor([True, False, False])
    a_pool = pool.clone()
    out = torch.empty(n, hv, dv)
    lib().gated_delta_varlen(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"],
                             a_pool, slots, fresh, cu, out, 0.25)
    b_pool = pool.clone()
    step = torch.empty(n, hv, dv)
    for i in range(max(lens)):  # decode steps: token i of every sequence still running
        seqs = [s for s in range(3) if i < lens[s]]
        rows = torch.tensor([int(cu[s]) + i for s in seqs])
        o = torch.empty(len(seqs), hv, dv)
        lib().gated_delta_decode(
            x["q"][rows].contiguous(), x["k"][rows].contiguous(), x["v"][rows].contiguous(),
            x["a"][rows].contiguous(), x["b"][rows].contiguous(), x["a_log"], x["dt_bias"],
            b_pool, slots[seqs].contiguous(), fresh[seqs] & (i == 0), o, 0.25)
        step[rows] = o
    assert torch.equal(out, step) and torch.equal(a_pool, b_pool)
    # and the recurrence is the contract's (the reference, to float noise)
    from pagedhybrid.ops import gated_delta_net

    init = pool[slots].clone()
    init[fresh] = 0
    ref, final = gated_delta_net(x["q"], x["k"], x["v"], cu, x["a"], x["b"], init, x["a_log"],
                                 x["dt_bias"], gate_activation="qwen", beta_activation="sigmoid",
                                 qk_l2_norm=0, scale=0.25)
    assert (ref - out).abs().max() < 1e-5 and (final - a_pool[slots]).abs().max() < 1e-5


@pytest.mark.parametrize(("dk", "dv"), [(16, 16), (4, 24), (24, 4), (9, 20)])
def test_recurrent_rows_do_not_depend_on_their_place(dk: int, dv: int) -> None:
    """A sequence's outputs and final state are the same bits at any offset of the packed stream
    and in any state slot (rows and state rows of odd widths sit at other alignments)."""
    hv, length = 4, 5
    x = _gdn_inputs(length, dk=dk, dv=dv, seed=2)
    init = torch.randn(hv, dv, dk, generator=torch.Generator().manual_seed(3))

    def run(off: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(off)
        # another sequence's `off` tokens first
        t = {k: torch.cat([torch.randn(off, *v.shape[1:], generator=gen), v])
             for k, v in x.items() if k in ("q", "k", "v", "a", "b")}
        pool = torch.randn(8, hv, dv, dk, generator=gen)
        pool[slot] = init
        out = torch.empty(off + length, hv, dv)
        lib().gated_delta_varlen(t["q"], t["k"], t["v"], t["a"], t["b"], x["a_log"], x["dt_bias"],
                                 pool, torch.tensor([(slot + 1) % 8, slot]),
                                 torch.tensor([False, False]),
                                 torch.tensor([0, off, off + length], dtype=torch.int32), out,
                                 dk ** -0.5)
        return out[off:], pool[slot]

    out0, state0 = run(0, 0)
    for off, slot in ((1, 3), (2, 6), (3, 1), (5, 7)):
        out, state = run(off, slot)
        assert torch.equal(out, out0) and torch.equal(state, state0), (off, slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_equals_decode_token_by_token(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    lens, c, kk = [5, 1, 9], 24, 4
    n = sum(lens)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    x = torch.randn(n, c, generator=gen).to(dtype)
    w = torch.randn(c, kk, generator=gen).to(dtype)
    pool = torch.randn(4, c, kk - 1, generator=gen).to(dtype)
    slots, fresh = torch.tensor([2, 0, 3]), torch.tensor([False, True, False])
    a_pool, y = pool.clone(), torch.empty_like(x)
    lib().causal_conv_varlen(x, w, None, a_pool, slots, fresh, cu, y, True)
    b_pool, y2 = pool.clone(), torch.empty_like(x)
    for i in range(max(lens)):
        seqs = [s for s in range(3) if i < lens[s]]
        rows = torch.tensor([int(cu[s]) + i for s in seqs])
        o = torch.empty(len(seqs), c, dtype=dtype)
        lib().causal_conv_decode(x[rows].contiguous(), w, None, b_pool, slots[seqs].contiguous(),
                                 fresh[seqs] & (i == 0), o, True)
        y2[rows] = o
    assert torch.equal(y, y2) and torch.equal(a_pool, b_pool)


@pytest.mark.parametrize(("d", "dtype"), [(64, torch.float32), (24, torch.float32),
                                          (7, torch.float32), (40, torch.bfloat16),
                                          (100, torch.float32)])
def test_attention_row_of_a_prefill_chunk_equals_its_decode(d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    hq, hkv, bs, total = 8, 2, 16, KV_SPLIT + 90  # crosses a KV split
    pages = -(-total // bs)
    kc = torch.randn(pages + 2, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(pages + 2, bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(pages + 2, generator=gen)[:pages].to(torch.int32)[None]
    q = torch.randn(40, hq, d, generator=gen)  # the last 40 positions as one chunk
    out = torch.empty(40, hq, d)
    lib().paged_attention(q, kc, vc, table, torch.tensor([0, 40], dtype=torch.int32),
                          torch.tensor([total - 40], dtype=torch.int32),
                          torch.tensor([0], dtype=torch.int32), out, d ** -0.5, KV_SPLIT)
    for i in (0, 7, 39):  # the same query row as a decode at its position
        one = torch.empty(1, hq, d)
        lib().paged_attention(q[i:i + 1].contiguous(), kc, vc, table,
                              torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([total - 40 + i], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32), one, d ** -0.5, KV_SPLIT)
        assert torch.equal(one[0], out[i]), i
    # and the rows are attention over keys 0..p (any head dim: the tail dims count too)
    keys = kc[table[0].long()].reshape(-1, hkv, d)[:total].double()  # [total, Hkv, D]
    vals = vc[table[0].long()].reshape(-1, hkv, d)[:total].double()
    for i in (0, 39):
        p = total - 40 + i
        kh = keys[:p + 1].repeat_interleave(hq // hkv, dim=1)  # [p+1, Hq, D]
        vh = vals[:p + 1].repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), kh) * d ** -0.5, dim=-1)
        want = torch.einsum("hk,khd->hd", w, vh)
        assert (out[i].double() - want).abs().max() < 1e-5, i
