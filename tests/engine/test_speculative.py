"""Speculative decoding in the engine: drafts verified in the packed step, states rolled back by
replaying the accepted tokens' compact state updates.

* greedy output with speculation equals greedy output without it -- bitwise, logprobs included,
  in batch-invariant mode; token for token with the default kernels -- with drafts forced right
  and forced wrong, chunked prefill and other requests in the same steps;
* a verify commit writes the prefix-cache checkpoints inside the accepted tokens (a later turn
  hits on them) and never caches a rejected token (A -> B -> A probes);
* temperature > 0 by rejection sampling: the tokens have exactly the target distribution
  (chi-square against the model's own probabilities), seeded runs repeat;
* stop conditions inside the accepted drafts, quantized KV pages, the n-gram drafter, the
  metrics and every refusal.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt_of

from pagedhybrid.engine import Engine, Request, SamplingParams, SequenceOutput
from pagedhybrid.engine.spec_decode.budget import DraftBudget
from pagedhybrid.engine.spec_decode.ngram import NgramIndex
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.models.qwen35 import Qwen35ForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
PROMPTS = [prompt_of(s, n) for s, n in ((1, 9), (2, 40), (3, 23), (4, 3))]


class Oracle:
    """Drafts of known continuations (``truth``), every ``wrong``-th draft token corrupted."""

    def __init__(self, truth: dict[str, Sequence[int]], wrong: int = 0) -> None:
        self.truth, self.wrong, self.n = truth, wrong, 0

    def propose(self, requests: Sequence[Request], k: int) -> None:
        for r in requests:
            want = list(self.truth[r.request_id][r.num_output_tokens:r.num_output_tokens + k])
            for i in range(len(want)):
                self.n += 1
                if self.wrong and self.n % self.wrong == 0:
                    want[i] = (want[i] + 1) % 256
            r.draft_ids = tuple(want)


class Fixed:
    """The same drafts for every request and step."""

    def __init__(self, drafts: Sequence[int]) -> None:
        self.drafts = tuple(drafts)

    def propose(self, requests: Sequence[Request], k: int) -> None:
        for r in requests:
            r.draft_ids = self.drafts[:k]


def run(engine: Engine, work: Sequence[tuple[list[int], SamplingParams]],
        ids: Sequence[str] | None = None) -> dict[str, SequenceOutput]:
    ids = list(ids or (f"r{i}" for i in range(len(work))))
    for rid, (p, params) in zip(ids, work, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, SequenceOutput] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
        engine.check_invariants()
    return out


def lps(out: SequenceOutput) -> list[float]:
    assert out.logprobs is not None
    return [d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)]


@pytest.mark.parametrize("wrong", [0, 2, 5])
@pytest.mark.parametrize("invariant", [True, False])
def test_greedy_output_is_unchanged(make_engine: Callable[..., Engine], wrong: int,
                                    invariant: bool) -> None:
    """Drafts right (wrong=0) or every 2nd / 5th token wrong, chunked prefills in the same
    steps: the tokens are greedy decoding's; batch-invariant mode keeps every logprob bit."""
    kw = dict(num_blocks=64, max_num_batched_tokens=24, batch_invariant=invariant,
              cache_fill=None)
    work = [(p, GREEDY) for p in PROMPTS]
    plain = make_engine(**kw)
    base = run(plain, work)
    spec = make_engine(speculative_config={"num_speculative_tokens": 5, "adaptive": False},
                       **kw)
    spec.drafter = Oracle({k: v.token_ids for k, v in base.items()}, wrong)
    got = run(spec, work)
    for k, want in base.items():
        assert got[k].token_ids == want.token_ids, k
        if invariant:
            assert lps(got[k]) == lps(want), k
    st = spec.stats.spec
    assert st.accepted_tokens > 20 and spec.stats.steps < plain.stats.steps  # it verified
    assert (st.accepted_tokens < st.draft_tokens) == bool(wrong)
    assert sum(st.accepted_per_pos) == st.accepted_tokens


def test_stop_conditions_inside_accepted_drafts(make_engine: Callable[..., Engine]) -> None:
    """A stop token, EOS-free max_tokens and max_model_len reached inside a verified chunk end
    the request exactly where decoding one token at a time would."""
    base = run(make_engine(num_blocks=64), [(PROMPTS[1], GREEDY)])["r0"].token_ids
    stop = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                          stop_token_ids=(base[6],))
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for params, want in ((stop, base[:base.index(base[6]) + 1]), (short, base[:5])):
        engine = make_engine(num_blocks=64, speculative_config={"num_speculative_tokens": 7,
                                                                "adaptive": False})
        engine.drafter = Oracle({"r0": base})
        out = run(engine, [(PROMPTS[1], params)])["r0"]
        assert list(out.token_ids) == list(want)
        assert engine.blocks.num_owned == 0 and engine.states.num_free == engine.states.capacity


def test_verify_commits_write_checkpoints_and_never_cache_rejected_tokens(
        make_engine: Callable[..., Engine]) -> None:
    """A -> B -> A: turn 2 of A hits on a checkpoint that only a verify commit wrote (inside
    the accepted tokens of the answer); B, which shares A's prompt but diverges where drafts
    were rejected, and A again give what they give without speculation."""
    kw = dict(block_size=16, num_blocks=96, state_checkpoint_interval=16, max_num_seqs=2,
              num_state_checkpoints=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a = prompt_of(21, 20)
    b = a[:17] + prompt_of(22, 9)
    plain = make_engine(**kw)
    ref_a = run(plain, [(a, params)], ["a"])["a"].token_ids
    ref_b = run(plain, [(b, params)], ["b"])["b"].token_ids
    turn2 = a + list(ref_a) + prompt_of(23, 5)
    ref_2 = run(plain, [(turn2, params)], ["a2"])["a2"]

    spec = make_engine(speculative_config={"num_speculative_tokens": 6, "adaptive": False},
                       **kw)
    spec.drafter = Oracle({"a": ref_a, "b": ref_b, "a2": ref_2.token_ids, "a3": ref_a}, 3)
    assert run(spec, [(a, params)], ["a"])["a"].token_ids == ref_a
    assert spec.stats.spec.accepted_tokens > 0 and \
        spec.stats.spec.accepted_tokens < spec.stats.spec.draft_tokens
    assert spec.prefix_cache_stats()["checkpoints_written"] >= 3  # 16, 32 (prompt), 48 ...
    assert run(spec, [(b, params)], ["b"])["b"].token_ids == ref_b
    got = run(spec, [(turn2, params)], ["a2"])["a2"]
    # 59 computed tokens of turn 1 (prompt + answer - 1): checkpoints up to 48 came from commits
    assert got.num_cached_tokens == 48 and got.token_ids == ref_2.token_ids
    assert run(spec, [(a, params)], ["a3"])["a3"].token_ids == ref_a


def test_quantized_pages(make_engine: Callable[..., Engine], tmp_path: Path,
                         tiny_model: Qwen35ForCausalLM) -> None:
    from pagedhybrid.calibrate_kv import channel_amax, scales_from_amax
    from pagedhybrid.kvquant import KV_DTYPES, save_scales

    amax, _ = channel_amax(tiny_model, prompt_of(99, 300), 256)
    path = save_scales(tmp_path / "s.safetensors",
                       scales_from_amax(amax, KV_DTYPES["int8"], "per-channel"),
                       KV_DTYPES["int8"], "per-channel")
    kw = dict(num_blocks=64, kv_cache_dtype="int8", kv_scales=str(path), batch_invariant=True)
    work = [(p, GREEDY) for p in PROMPTS[:3]]
    base = run(make_engine(**kw), work)
    spec = make_engine(speculative_config={"num_speculative_tokens": 4, "adaptive": False},
                       **kw)
    spec.drafter = Oracle({k: v.token_ids for k, v in base.items()}, 3)
    got = run(spec, work)
    assert all(lps(got[k]) == lps(base[k]) and got[k].token_ids == base[k].token_ids
               for k in base)


def _probs(model: Qwen35ForCausalLM, prefix: list[int], temperature: float, top_k: int
           ) -> torch.Tensor:
    logits, _ = model.forward_dense(torch.tensor([prefix]))
    row = logits[0, -1].double() / temperature
    keep = row.topk(top_k).indices
    p = torch.zeros_like(row)
    p[keep] = torch.softmax(row[keep], 0)
    return p


def test_rejection_sampling_keeps_the_target_distribution(
        make_engine: Callable[..., Engine], tiny_model: Qwen35ForCausalLM) -> None:
    """4000 seeded requests whose 2nd and 3rd tokens are verified against fixed drafts (the
    most likely 2nd token after the most likely 1st, twice): the joint frequency of (token 1,
    token 2) matches p(t1) p(t2 | t1) of the model (chi-square), and seeded runs repeat."""
    prompt = prompt_of(31, 6)
    temp, top_k, n = 0.9, 4, 4000
    p1 = _probs(tiny_model, prompt, temp, top_k)
    top = p1.argsort(descending=True).tolist()
    likely = int(_probs(tiny_model, [*prompt, top[0]], temp, top_k).argmax())
    params = [SamplingParams(temperature=temp, top_k=top_k, max_tokens=3, ignore_eos=True,
                             seed=s) for s in range(n)]

    def sample() -> tuple[list[tuple[int, ...]], Engine]:
        engine = make_engine(num_blocks=n // 2 + 64, max_num_seqs=n, num_state_slots=n,
                             max_num_batched_tokens=8 * n, enable_prefix_caching=False,
                             speculative_config={"num_speculative_tokens": 2,
                                                 "adaptive": False})
        engine.drafter = Fixed([likely, likely])
        outs = run(engine, [(prompt, p) for p in params])
        return [outs[f"r{i}"].token_ids for i in range(n)], engine

    toks, engine = sample()
    st = engine.stats.spec
    assert 0 < st.accepted_tokens < st.draft_tokens  # both branches were taken
    cells = Counter((t[0], t[1]) for t in toks)
    chi2, dof = 0.0, -1
    for t1 in top[:top_k]:
        p2 = _probs(tiny_model, [*prompt, t1], temp, top_k)
        for t2 in p2.argsort(descending=True)[:top_k].tolist():
            expected = n * float(p1[t1]) * float(p2[t2])
            chi2 += (cells.get((t1, t2), 0) - expected) ** 2 / expected
            dof += 1
    assert sum(cells.values()) == n and all(c[0] in top[:top_k] for c in cells)
    # P(chi2 > mean + 4.5 sd) is far below 1e-3 for these dof; a wrong accept / residual rule
    # (e.g. always keeping the draft) is off by thousands
    assert chi2 < dof + 4.5 * math.sqrt(2 * dof), (chi2, dof)
    again, _ = sample()
    assert again == toks


def test_ngram_index_proposes_what_followed_the_latest_earlier_match() -> None:
    """k tokens: what followed the latest earlier occurrence of the longest matching suffix,
    the loop from there to the end repeated when fewer follow."""
    idx = NgramIndex(2, 4)
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert idx.lookup(toks, 3) == (5, 7, 1)  # [1 2 3] last seen before at 5..7
    toks += [5, 7]
    assert idx.lookup(toks, 2) == (1, 2)  # [3 5 7] at 7..9
    assert NgramIndex(2, 3).lookup([4, 5, 6], 3) == ()  # no earlier occurrence
    assert NgramIndex(1, 1).lookup([8, 3, 8], 3) == (3, 8, 3)  # the period [3 8] repeated
    assert NgramIndex(2, 2).lookup([7, 7, 7], 4) == (7, 7, 7, 7)  # a one-token loop


def test_ngram_drafts_leave_the_tokens_unchanged(make_engine: Callable[..., Engine]
                                                      ) -> None:
    """The real drafter (windows down to one token) on a repetitive prompt: it drafts, and the
    tokens are those of decoding without it."""
    motif = prompt_of(41, 12)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = make_engine(num_blocks=64)
    want = run(base, [(motif * 4, params)])["r0"].token_ids
    spec = make_engine(num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "adaptive": False})
    assert run(spec, [(motif * 4, params)])["r0"].token_ids == want
    assert spec.stats.spec.drafts > 0


def test_speculation_turns_off_for_large_batches_and_ineligible_requests(
        make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(num_blocks=64, max_num_seqs=4, speculative_config={
        "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    engine.drafter = Fixed([1, 2, 3])
    run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=4)) for p in PROMPTS])
    assert engine.stats.spec.drafts == 0  # 4 running > 2
    engine = make_engine(num_blocks=64, speculative_config={"num_speculative_tokens": 3,
                                                            "adaptive": False})
    engine.drafter = Fixed([1, 2, 3])
    run(engine, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4,
                                             repetition_penalty=1.2))])
    assert engine.stats.spec.drafts == 0  # penalised rows depend on the tokens before them


@pytest.mark.parametrize(("config", "field"), [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 8}, "num_speculative_tokens"),
    ({"method": "eagle"}, "method"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_token": 3}, "num_speculative_token"),
])
def test_bad_speculative_config_is_refused_by_field(make_engine: Callable[..., Engine],
                                                    config: dict, field: str) -> None:
    with pytest.raises(ContractViolation, match=field):
        make_engine(num_blocks=16, speculative_config=config)


def test_the_reference_bundle_cannot_verify(make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(UnsupportedConfiguration, match="speculative decoding needs"):
        make_engine(num_blocks=16, backend="reference", enable_prefix_caching=False,
                    speculative_config={"num_speculative_tokens": 2})


def test_torch_bundle_verifies_too(make_engine: Callable[..., Engine]) -> None:
    work = [(p, GREEDY) for p in PROMPTS[:2]]
    base = run(make_engine(num_blocks=64, backend="torch"), work)
    spec = make_engine(num_blocks=64, backend="torch",
                       speculative_config={"num_speculative_tokens": 3, "adaptive": False})
    spec.drafter = Oracle({k: v.token_ids for k, v in base.items()}, 4)
    got = run(spec, work)
    assert all(got[k].token_ids == base[k].token_ids for k in base)
    assert spec.stats.spec.accepted_tokens > 0


def _budget(a: float, b: float, v: float = 0.0) -> DraftBudget:
    budget = DraftBudget()
    for rows in (1, 4, 9, 16, 2, 30, 5, 12):
        budget.observe(rows, a + b * rows, False)
        budget.observe(rows + 1, a + b * (rows + 1) + v, True)
    return budget


def test_the_draft_budget_keeps_drafts_that_pay_for_their_rows(
        make_engine: Callable[..., Engine]) -> None:
    """The step-time model (a + b rows, + v on a verify step, fitted) and each request's
    acceptance decide: a weights-bound step (a >> b rows) keeps a good guesser's drafts, a
    compute-bound one (a large batch, a ~ 0) keeps none, and a request whose guesses keep
    failing loses its drafts first; without a recent verify step the likeliest request's drafts
    are kept (one request's rows: a scout, never the whole batch's). In the engine the budget
    trims what the drafter proposed."""
    good, bad = (Request(x, (1,), SamplingParams(), 0, torch.Generator()) for x in "gb")
    good.spec_accepted, bad.spec_rejections = 30, 30  # p ~ 0.97 and ~ 0.06
    assert _budget(10e-3, 0.5e-3, 1e-3).fit() == pytest.approx((10e-3, 0.5e-3, 1e-3))
    for budget, batch, want in ((_budget(10e-3, 0.5e-3), 1, (4, 0)),  # weights-bound, batch 1
                                (_budget(0.1e-3, 2e-3), 16, (0, 0)),  # compute-bound, batch 16
                                (DraftBudget(), 16, (4, 0))):  # no fit: the likeliest explores
        for r in (good, bad):
            r.draft_ids = (1, 2, 3, 4)
        budget.trim([good, bad], batch)
        assert (len(good.draft_ids), len(bad.draft_ids)) == want, (batch, want)
    steady = _budget(0.1e-3, 2e-3)
    steady.observe(40, 1.0, True)  # one slow first call does not tilt the fit
    assert steady.fit() == pytest.approx((0.1e-3, 2e-3, 0.0))
    for _ in range(DraftBudget.WINDOW):  # steps of one kind: the other's are remembered ...
        steady.observe(16, 0.1e-3 + 2e-3 * 16, False)
    assert steady.fit() == pytest.approx((0.1e-3, 2e-3, 0.0))
    for _ in range(DraftBudget.REMEMBER):  # ... not for ever: explore again
        steady.observe(16, 0.1e-3 + 2e-3 * 16, False)
    assert steady.fit() is None
    engine = make_engine(num_blocks=64, speculative_config={"num_speculative_tokens": 3})
    engine.drafter = Fixed([1, 2, 3])
    engine.draft_budget = _budget(0.1e-3, 2e-3)  # as if every row cost 2 ms: never worth it
    engine.draft_budget.observe = lambda rows, seconds, verifying: None  # (keep the fit)
    run(engine, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))])
    assert engine.stats.spec.drafts == 0


def test_a_lone_stream_probes_for_the_decode_cost() -> None:
    """A lone request whose every step verifies k drafts gives the fit no decode step: one step
    in PROBE_EVERY runs without drafts until the fit has MIN_SPREAD of them; then the verify
    steps' extra time (charged to their extra rows: every verify step has the same count)
    counts against the drafts -- a request whose drafts are mostly rejected loses them (but
    for one step in EXPLORE, which measures it again), a good guesser keeps them."""
    a, b, v = 4e-3, 0.2e-3, 3e-3
    budget, kept = DraftBudget(), []
    poor = Request("p", (1,), SamplingParams(), 0, torch.Generator())
    poor.spec_accepted, poor.spec_rejections = 5, 25  # p ~ 0.22
    for _ in range(100):
        poor.draft_ids = (1, 2, 3)
        budget.trim([poor], 1)
        kept.append(len(poor.draft_ids))
        n = len(poor.draft_ids)
        budget.observe(1 + n, a + b * (1 + n) + (v if n else 0.0), n > 0)
    # drafts kept until MIN_SPREAD probes give the decode cost (one noisy step is no fit)
    assert kept[:20] == [3, 3, 3, 3] + [0, 3, 3, 3] * DraftBudget.MIN_SPREAD
    # (no spread within a kind: the verify steps' extra time is charged to their extra rows)
    assert budget.fit() == pytest.approx((a - v / 3, b + v / 3, 0.0))
    # then the fit says: not worth it for this request -- but for a re-check on a step whose
    # count is a multiple of EXPLORE once it was cut EXPLORE steps in a row
    assert [i for i, n in enumerate(kept) if i >= 20 and n] == [64, 96]
    good = Request("g", (1,), SamplingParams(), 0, torch.Generator())
    good.spec_accepted = 30
    good.draft_ids = (1, 2, 3)
    budget.trim([good], 1)
    assert len(good.draft_ids) == 3


def test_a_large_batch_is_scouted_and_widened_a_step_at_a_time() -> None:
    """On a batch of 16 the budget never bets the whole batch on two row counts: without a
    verify step one request scouts; a fit from 16-row decodes and 19-row verifies (no spread
    within a kind: their difference is charged to the rows) keeps drafts only up to twice the
    widest verify step's rows; a batch that outgrew them can still draft one request's
    rows; and a re-check reopens one request's drafts, not every cut one's."""
    def batch(n: int, accepted: int, rejected: int) -> list[Request]:
        out = []
        for i in range(n):
            r = Request(f"r{i}", (1,), SamplingParams(), 0, torch.Generator())
            r.spec_accepted, r.spec_rejections = accepted, rejected
            r.draft_ids = (1, 2, 3)
            out.append(r)
        return out

    budget = DraftBudget()
    for _ in range(8):
        budget.observe(16, 15e-3, False)
    reqs = batch(16, 30, 1)
    budget.trim(reqs, 16)
    assert sorted(len(r.draft_ids) for r in reqs) == [0] * 15 + [3]  # one scout
    for _ in range(DraftBudget.MIN_SPREAD):
        budget.observe(19, 15.3e-3, True)
    assert budget.fit() == pytest.approx((15e-3 - 16 * 0.1e-3, 0.1e-3, 0.0))
    reqs = batch(16, 30, 1)
    budget.trim(reqs, 16)  # every draft would pay (0.1 ms a row); 2 * 19 - 16 rows are trusted
    assert sum(len(r.draft_ids) for r in reqs) == 22
    lone = DraftBudget()  # fitted on a lone stream's steps (1 and 4 rows), then 16 requests
    for _ in range(DraftBudget.MIN_SPREAD):
        lone.observe(1, 10e-3, False)
        lone.observe(4, 10.3e-3, True)
    reqs = batch(16, 30, 1)
    lone.trim(reqs, 16)
    assert sum(len(r.draft_ids) for r in reqs) == 3  # one request's worth, to measure
    poor, kept = batch(16, 1, 30), []  # p ~ 0.06: cut, but for re-checks
    for _ in range(2 * DraftBudget.EXPLORE):
        for r in poor:
            r.draft_ids = (1, 2, 3)
        budget.trim(poor, 16)
        kept.append(sum(1 for r in poor if r.draft_ids))
        budget.count += 1  # (the fit stands: no new steps observed)
    assert sorted(set(kept)) == [0, 1] and sum(kept) == 1  # one re-check of one request


def test_a_newcomer_is_judged_by_recent_verdicts() -> None:
    """A request without verdicts of its own starts from the engine's recent acceptance (0.9
    before any), and its own verdicts take over."""
    budget = DraftBudget()
    fresh = Request("f", (1,), SamplingParams(), 0, torch.Generator())
    assert budget.acceptance(fresh) == pytest.approx(0.9)
    for _ in range(200):  # drafts lately: one in four kept, then a rejection
        budget.judge(1, True)
        budget.judge(0, True)
    assert budget.acceptance(fresh) == pytest.approx(1 / 3, abs=0.02)
    fresh.spec_accepted = 60  # its own guesses are good
    assert budget.acceptance(fresh) > 0.95


def test_position_costs_stop_a_chain_where_it_stops_paying() -> None:
    """A cost per opened draft position (the MTP head's catch-up and chain steps): on a
    weights-bound batch-1 step cheap positions are opened, one that costs more than the
    expected tokens it and the positions after it are worth is not (nor anything past it), and
    a first position too dear for anyone leaves every request without drafts (the MTP drafter
    then skips its head)."""
    good = Request("g", (1,), SamplingParams(), 0, torch.Generator())
    good.spec_accepted = 30  # p ~ 0.97
    budget = _budget(10e-3, 0.5e-3)
    for costs, want in (((), 4), ((1e-3, 1e-3, 1e-3), 4), ((1e-3, 1e-3, 30e-3), 2),
                        ((50e-3,), 0)):
        good.draft_ids = (1, 2, 3, 4)
        budget.trim([good], 1, costs)
        assert len(good.draft_ids) == want, costs
