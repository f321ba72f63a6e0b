"""Sampler: greedy, temperature / top-k / top-p against a direct formulation, seeds, logprobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedhybrid.engine.sample.sampler import (
    DRAW_BLOCK,
    DRAW_DIRECT,
    GREEDY,
    SamplingParams,
    _filtered_probs,
    draw,
    sample,
)
from pagedhybrid.errors import ContractViolation


def reference_probs(logits: list[float], t: float, k: int, p: float) -> list[float]:
    """Direct per-row formulation: sort, keep top-k, keep the smallest prefix with mass >= p."""
    v = len(logits)
    scaled = [x / t for x in logits]
    order = sorted(range(v), key=lambda i: -scaled[i])
    keep = order[: k if k > 0 else v]
    z = sum(math.exp(scaled[i]) for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= p:
            break
        kept.append(i)
        mass += math.exp(scaled[i]) / z
    z2 = sum(math.exp(scaled[i]) for i in kept)
    return [math.exp(scaled[i]) / z2 if i in kept else 0.0 for i in range(v)]


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6),
                                           (0.5, 5, 0.8), (2.0, -1, 0.3), (1.0, 100, 0.95)])
def test_filtered_probs_match_direct_formulation(t: float, k: int, p: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=g, dtype=torch.float64).float()
    got = _filtered_probs(logits, torch.full((4,), t), torch.full((4,), k, dtype=torch.int64),
                          torch.full((4,), p))
    for row in range(4):
        want = reference_probs(logits[row].double().tolist(), t, k, p)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)


def test_top_p_over_a_flat_wide_row_widens_its_search() -> None:
    """A near-flat 5000-token row: the top-p prefix is longer than the first topk width (1024),
    so the search widens; the result is the sort-based formulation's."""
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(4)).mul_(0.05)
    logits[1, :10] += 10.0  # the second row peaked: its prefix fits the first width
    got = _filtered_probs(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64),
                          torch.tensor([0.9, 0.9]))
    for row in range(2):
        want = reference_probs(logits[row].double().tolist(), 1.0, 0, 0.9)
        assert got[row].tolist() == pytest.approx(want, abs=1e-6)
    assert int((got[0] > 0).sum()) > 1024 and int((got[1] > 0).sum()) <= 1024


@pytest.mark.parametrize(("name", "params", "copies"), [
    ("greedy", SamplingParams(temperature=0.0), 0),
    ("greedy with logprobs", SamplingParams(temperature=0.0, logprobs=5), 0),
    ("top-k, top-p, min-p", SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                           logprobs=2), 1),
    ("top-p alone", SamplingParams(temperature=1.0, top_p=0.95), 1),
])
def test_sampling_at_248k_allocates_at_most_one_working_copy(
        name: str, params: SamplingParams, copies: int) -> None:
    """At Qwen3.5's vocabulary (248,320) a step's sampling allocates no ``[rows, V]`` fp32
    buffer for greedy rows and logprobs, and one (the working copy) for random rows: the draw
    works on sums of blocks and one block a row. (The sort-based sampler allocated 14.)"""
    from torch.profiler import ProfilerActivity, profile

    rows, vocab = 8, 248_320
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(4.0)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    first = sample(logits, [params] * rows, gens)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        again = sample(logits, [params] * rows, gens)
    big = [(e.name, e.self_cpu_memory_usage) for e in prof.events()
           if e.self_cpu_memory_usage >= rows * vocab * 4]
    assert len(big) == copies, (name, big)
    assert len(again) == len(first) == rows
    if params.greedy:
        assert [t.token_id for t in again] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [2 * DRAW_BLOCK + 300, DRAW_DIRECT + DRAW_BLOCK + 300])
def test_draw_follows_the_odds_and_never_takes_a_zero(vocab: int) -> None:
    """``draw`` (one float64 uniform a row: the inverse CDF, for a large vocabulary over block
    sums and then one block): frequencies follow unnormalised odds spread over blocks with a
    partial last block, a token of probability 0 is never drawn (not at a block's edge
    either), and a seeded row draws the same token alone or in a batch."""
    odds = torch.zeros(vocab)
    where = [0, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK + 17, vocab - 1]
    odds[where] = torch.tensor([3.0, 1.0, 2.0, 0.5, 1.5])  # sum 8, never normalised
    gen = torch.Generator().manual_seed(3)
    n = 8000
    got = torch.cat([draw(odds.expand(8, vocab), [gen] * 8) for _ in range(n // 8)])
    assert set(got.tolist()) <= set(where)
    for token, w in zip(where, odds[where].tolist(), strict=True):
        freq = float((got == token).float().mean())
        assert abs(freq - w / 8.0) < 4 * math.sqrt(w / 8.0 * (1 - w / 8.0) / n), (token, freq)
    last = torch.zeros(1, vocab)
    last[0, -1] = 1e-30  # the whole mass on the last token, tiny
    assert draw(last, [torch.Generator().manual_seed(0)]).tolist() == [vocab - 1]
    rows = torch.rand(5, vocab, generator=torch.Generator().manual_seed(1))
    alone = [int(draw(rows[i:i + 1], [torch.Generator().manual_seed(i)])[0]) for i in range(5)]
    batch = draw(rows, [torch.Generator().manual_seed(i) for i in range(5)]).tolist()
    assert batch == alone


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [GREEDY] * 5, [torch.Generator()] * 5)
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()
    assert all(o.logprobs is None for o in out)


def test_a_packed_grammar_mask_bounds_every_kind_of_row() -> None:
    """``allowed`` comes packed (int32 [B, ceil(V / 32)]): greedy rows take the argmax over the
    allowed tokens, penalized and random rows only ever draw allowed ones, an unmasked row (all
    bits set) is untouched, and a greedy row whose mask allows nothing comes back None (its
    request fails alone: the runner names the grammar)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 70, generator=g)
    ok = torch.zeros(5, 70, dtype=torch.bool)
    ok[0, [3, 40, 69]] = True
    ok[1] = True
    ok[2, [5, 6]] = True
    ok[3, 33:38] = True
    bits = torch.zeros(5, 96, dtype=torch.int64)
    bits[:, :70] = ok.long()
    packed = (bits.view(5, 3, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    masked = logits.masked_fill(~ok, -float("inf"))
    out = sample(logits, [GREEDY] * 5, [torch.Generator()] * 5, allowed=packed)
    assert [o and o.token_id for o in out] == [*masked[:4].argmax(-1).tolist(), None]
    hot = SamplingParams(temperature=5.0, seed=2)
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    for _ in range(40):
        out = sample(logits[:4], [hot, GREEDY, pen, hot], [torch.Generator()] * 4,
                     history=[SimpleNamespace(prompt_token_ids=[], output_token_ids=t)
                              for t in ([], [], [5], [])], allowed=packed[:4])
        assert all(ok[i, o.token_id] for i, o in enumerate(out)), out
        assert out[1].token_id == logits[1].argmax().item()
    assert {sample(logits[3:4], [hot], [torch.Generator().manual_seed(s)],
                   allowed=packed[3:4])[0].token_id for s in range(60)} == set(range(33, 38))


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=1)
    want = reference_probs(logits[0].tolist(), 0.8, 4, 0.9)
    g = torch.Generator().manual_seed(1)
    n = 4000
    counts = [0] * 6
    for _ in range(n):
        counts[sample(logits, [params], [g])[0].token_id] += 1
    for c, w in zip(counts, want, strict=True):
        # 5 standard deviations of a binomial count
        assert abs(c / n - w) <= 5 * math.sqrt(max(w * (1 - w), 1e-9) / n) + 1e-9, (counts, want)


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g)
    mine = SamplingParams(temperature=1.0, seed=123)

    def run(rows: list[int], steps: int = 20) -> list[int]:
        gens = [torch.Generator().manual_seed(123 if r == 1 else 1000 + r) for r in rows]
        params = [mine if r == 1 else SamplingParams(temperature=0.5 + r) for r in rows]
        seq = []
        for _ in range(steps):
            out = sample(logits[rows], params, gens)
            seq.append(out[rows.index(1)].token_id)
        return seq

    alone = run([1])
    assert run([0, 1, 2]) == alone
    assert run([2, 1]) == alone
    assert len(set(alone)) > 3  # really random, not greedy


def test_logprobs_are_topk_of_the_model_distribution() -> None:
    logits = torch.randn(2, 25, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=5.0, logprobs=0, seed=0)]
    out = sample(logits, params, [torch.Generator().manual_seed(0)] * 2)
    lp = logits.log_softmax(-1)
    top = lp[0].topk(3)
    assert list(out[0].logprobs) == top.indices.tolist()
    for rank, (tok, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                        strict=True)):
        assert out[0].logprobs[tok].logprob == pytest.approx(v, abs=1e-6)
        assert out[0].logprobs[tok].rank == rank + 1
    # logprobs=0: only the sampled token, with its rank in the raw distribution
    (tok,) = out[1].logprobs
    assert tok == out[1].token_id
    assert out[1].logprobs[tok].logprob == pytest.approx(float(lp[1, tok]), abs=1e-6)
    assert out[1].logprobs[tok].rank == int((lp[1] > lp[1, tok]).sum()) + 1


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
                                {"top_k": -2}, {"max_tokens": 0}, {"logprobs": -1},
                                {"temperature": float("nan")}])
def test_bad_params_are_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ContractViolation, match=next(iter(kw))):
        SamplingParams(**kw)
