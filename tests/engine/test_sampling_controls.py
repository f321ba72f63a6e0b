"""Sampling controls against small references of vLLM's definitions on fixed logits, their
batch independence (bitwise), seeded reproducibility, and the engine's typed refusals."""

from __future__ import annotations

import math

import pytest
import torch

from pagedhybrid.engine.core.request import InvalidRequest
from pagedhybrid.engine.sample.sampler import (
    GREEDY,
    SamplingParams,
    _filtered_probs,
    bad_word_bans,
    bad_words_token_ids,
    process_logits,
    sample,
    wrap_seed,
)
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.llm import LLM


class History:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids = prompt, output


def reference_processed(logits: list[float], p: SamplingParams, prompt: list[int],
                        output: list[int], banned: list[int]) -> list[float]:
    """vLLM v1, written out per token: logit bias, bans, repetition, frequency, presence."""
    out = list(logits)
    for t, b in p.logit_bias:
        out[t] += b
    for t in banned:
        out[t] = -math.inf
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen and p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else \
                out[t] * p.repetition_penalty
        n = output.count(t)
        out[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def reference_min_p(logits: list[float], t: float, min_p: float) -> list[float]:
    z = [x / t for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    keep = [x if x >= min_p * max(e) else 0.0 for x in e]
    s = sum(keep)
    return [x / s for x in keep]


CONTROLS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.6),
    SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, logit_bias={3: 5.5, 11: -100.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3,
                   presence_penalty=0.2, logit_bias={0: 1.0}),
]


@pytest.mark.parametrize("p", CONTROLS, ids=range(len(CONTROLS)))
def test_processed_logits_match_vllm_definitions(p: SamplingParams) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, generator=g)
    hist = [History([1, 2, 2, 5], [5, 7, 7, 7]), History([0], []), History([9, 9], [3, 1, 3])]
    banned = [[4], [], [6, 8]]
    got = process_logits(logits, [p] * 3, hist, banned)
    for r in range(3):
        want = reference_processed(logits[r].tolist(), p, hist[r].prompt_token_ids,
                                   hist[r].output_token_ids, banned[r])
        assert got[r].tolist() == pytest.approx(want, abs=1e-5)
    toks = sample(logits, [p] * 3, [torch.Generator()] * 3, hist, banned)
    assert [t.token_id for t in toks] == got.argmax(-1).tolist()
    # logprobs stay those of the raw distribution
    lp = sample(logits[:1], [SamplingParams(**{**p.__dict__, "logprobs": 0})],
                [torch.Generator()], hist[:1], banned[:1])[0]
    (tok, v), = lp.logprobs.items()
    assert v.logprob == pytest.approx(float(logits[0].log_softmax(-1)[tok]), abs=1e-6)


@pytest.mark.parametrize(("t", "min_p"), [(1.0, 0.1), (0.7, 0.5), (1.5, 0.05), (1.0, 1.0)])
def test_min_p_matches_its_definition(t: float, min_p: float) -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    got = _filtered_probs(logits, torch.full((4,), t), torch.zeros(4, dtype=torch.int64),
                          torch.ones(4), torch.full((4,), min_p))
    for r in range(4):
        assert got[r].tolist() == pytest.approx(reference_min_p(logits[r].tolist(), t, min_p),
                                                abs=1e-6)


def test_rows_are_bitwise_independent_of_the_batch_and_seeded_runs_repeat() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 64, generator=g)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=7,
                             repetition_penalty=1.3, frequency_penalty=0.5,
                             logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=1.2, seed=8), GREEDY,
              SamplingParams(temperature=0.5, min_p=0.3, seed=9)]
    hist = [History([1, 2, 3], [4, 4, 9]), History([5], [5, 6]), History([7], []),
            History([8], [8]), History([1], [2])]
    banned = [[3], [], [10, 11], [], [0]]
    whole = process_logits(logits, params, hist, banned)
    for r in range(5):
        alone = process_logits(logits[r:r + 1], params[r:r + 1], hist[r:r + 1], banned[r:r + 1])
        assert torch.equal(alone[0], whole[r])

    def run(rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(p.seed or 0) for p in params]
        out = []
        for _ in range(10):
            toks = sample(logits[rows], [params[r] for r in rows], [gens[r] for r in rows],
                          [hist[r] for r in rows], [banned[r] for r in rows])
            out.append(toks[rows.index(0)].token_id)
        return out

    assert run([0]) == run([2, 0, 4]) == run([4, 3, 2, 1, 0])


def test_bad_words_follow_vllms_rule() -> None:
    vocab = {"hello": [10], " hello": [11], "big dog": [20, 21], " big dog": [22, 21],
             "cat": [30], " cat": [30]}
    seqs = bad_words_token_ids(["hello", "big dog", "cat"], lambda s: vocab[s])
    assert seqs == ((10,), (11,), (20, 21), (22, 21), (30,))
    assert sorted(bad_word_bans(seqs, [1, 2])) == [10, 11, 30]  # single tokens: always
    assert sorted(bad_word_bans(seqs, [1, 20])) == [10, 11, 21, 30]  # "big" was just generated


def test_params_refuse_out_of_range_values_naming_the_field() -> None:
    for kw, field in (({"seed": 2 ** 63}, "seed"), ({"seed": -(2 ** 63) - 1}, "seed"),
                      ({"top_k": -2}, "top_k"), ({"top_k": 2 ** 64}, "top_k"),
                      ({"min_p": 1.5}, "min_p"), ({"presence_penalty": math.nan},
                                                  "presence_penalty"),
                      ({"frequency_penalty": 2.5}, "frequency_penalty"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"logit_bias": {1: math.inf}}, "logit_bias"),
                      ({"logit_bias": {1: 101}}, "logit_bias"),
                      ({"bad_words": (" ",)}, "bad_words"),
                      ({"temperature": math.inf}, "temperature")):
        with pytest.raises(ContractViolation) as e:
            SamplingParams(**kw)
        assert e.value.where == field, kw
    assert wrap_seed(2 ** 63 - 1 + 1) == -(2 ** 63) and wrap_seed(5) == 5


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, max_num_seqs=8)


def test_engine_refuses_ids_outside_the_vocabulary_and_keeps_running(llm: LLM) -> None:
    vocab = llm.engine.model.config.vocab_size
    for kw, field in (({"stop_token_ids": (vocab,), "min_tokens": 2}, "stop_token_ids"),
                      ({"logit_bias": {vocab + 5: 1.0}}, "logit_bias"),
                      ({"top_k": vocab + 1}, "top_k")):
        with pytest.raises(InvalidRequest) as e:
            llm.engine.add_request("bad", [1, 2, 3], SamplingParams(**kw))
        assert e.value.what == field
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["In the beginning"], SamplingParams(temperature=0.0, max_tokens=4),
                       use_progress=False)[0]
    assert len(out.token_ids) == 4


def test_engine_applies_the_controls(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    prompt = "And the LORD said unto Moses"
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12),
                         use_progress=False)[0].token_ids
    word = tok.decode(plain[:1]).strip()
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                   bad_words=(word,)),
                          use_progress=False)[0].token_ids
    seqs = bad_words_token_ids([word], lambda s: tok.encode(s, add_special_tokens=False))
    singles = {s[0] for s in seqs if len(s) == 1}
    assert singles and not singles & set(banned)
    pen = 1.5
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, logprobs=20,
                                                frequency_penalty=pen),
                       use_progress=False)[0]
    assert out.token_ids != plain
    for i, (tok_id, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        before = out.token_ids[:i]  # each pick is the argmax of raw logprob - pen * count

        def score(t: int, lps: dict = lps, before: tuple = before) -> float:
            return lps[t].logprob - pen * before.count(t)

        assert all(score(tok_id) >= score(t) - 1e-5 for t in lps)
        assert score(tok_id) >= min(v.logprob for v in lps.values()) - 1e-5  # beats the rest


def test_controls_stay_bitwise_in_batch_invariant_mode() -> None:
    inv = LLM(None, max_num_seqs=8, batch_invariant=True)
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=10, logprobs=2, top_k=50,
                       min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.3, logit_bias={100: 3.0}, bad_words=("the",),
                       ignore_eos=True)
    prompt = "And the LORD said unto Moses"
    alone = inv.generate([prompt], p, use_progress=False)[0]
    others = ["In the beginning", "Then Jesus went up", "And it came to pass, when"]
    batched = inv.generate([others[0], prompt, *others[1:]],
                           [SamplingParams(max_tokens=12, seed=i) for i in range(1)] + [p] + [
                               SamplingParams(temperature=0.0, max_tokens=7,
                                              repetition_penalty=1.1)] * 2,
                           use_progress=False)[1]
    assert batched.token_ids == alone.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in batched.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in alone.logprobs]
