"""``LLM`` as vLLM's offline API (issue 51): the prompt forms ``generate`` takes, vLLM's
``RequestOutput`` / ``CompletionOutput``, ``SamplingParams``' ``n``, ``best_of``, ``stop``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``detokenize``, and ``score`` as the
loglikelihood lm-eval computes. On the built-in model (greedy, fp32)."""

from __future__ import annotations

import itertools

import pytest

from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.core.outputs import CompletionOutput, RequestOutput
from pagedhybrid.errors import ContractViolation
from pagedhybrid.models.qwen35 import default_model_dir
from pagedhybrid.serve.llm import LLM

TEXT = "And God said"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", max_num_seqs=8)


def greedy(llm: LLM, prompt: object, **kw: object) -> RequestOutput:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **kw})
    return llm.generate(prompt, params, use_progress=False)[0]  # type: ignore[arg-type]


def test_every_prompt_form_gives_the_same_answer_in_vllms_shape(llm: LLM) -> None:
    ids = llm.engine.tokenizer.encode(TEXT)
    forms = [TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids}]
    outs = llm.generate(forms, GREEDY, use_progress=False)
    assert [type(o) for o in outs] == [RequestOutput] * 4
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None]
    assert all(o.prompt_token_ids == tuple(ids) and o.finished for o in outs)
    first = outs[0].outputs[0]
    assert isinstance(first, CompletionOutput) and first.index == 0 and len(outs[0].outputs) == 1
    assert len(first.token_ids) == 24 and first.finish_reason == "length"
    assert first.text == llm.engine.tokenizer.decode(first.token_ids)
    assert first.cumulative_logprob is None and first.logprobs is None  # not asked
    for o in outs[1:]:
        assert o.outputs[0].token_ids == first.token_ids and o.outputs[0].text == first.text
    # one dict, not in a list, is one prompt: its text, not the key "prompt"
    assert greedy(llm, {"prompt": TEXT}).outputs[0].token_ids == first.token_ids


@pytest.mark.parametrize(("prompts", "where"), [
    ({"prompt": 5}, "prompts['prompt']"),
    ({"text": TEXT}, "prompts"),
    ({"prompt": TEXT, "prompt_token_ids": [1]}, "prompts"),
    ([TEXT, {"prompt_token_ids": ["a"]}], "prompts[1]['prompt_token_ids']"),
    ([TEXT, 1.5], "prompts[1]"),
    (42, "prompts"),
    ([], "prompts"),
])
def test_other_prompts_are_refused_naming_the_argument(llm: LLM, prompts: object,
                                                       where: str) -> None:
    with pytest.raises(ContractViolation) as err:
        llm.generate(prompts, GREEDY, use_progress=False)  # type: ignore[arg-type]
    assert err.value.where == where
    assert not llm.engine.has_unfinished_requests()


def test_n_and_best_of(llm: LLM) -> None:
    out = greedy(llm, TEXT, temperature=1.0, n=3, seed=5, logprobs=1)
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(out.sequences) == 3
    assert len({c.token_ids for c in out.outputs}) > 1  # three different samples
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(
            d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)))
    # sequence i of a seeded request is the request with seed + i
    again = greedy(llm, TEXT, temperature=1.0, seed=6, logprobs=1)
    assert again.outputs[0].token_ids == out.outputs[1].token_ids
    # best_of: the n best of best_of by cumulative logprob; no logprobs unless asked
    best = greedy(llm, TEXT, temperature=1.0, n=1, best_of=3, seed=5)
    assert len(best.outputs) == 1 and len(best.sequences) == 3
    assert best.outputs[0].logprobs is None and best.outputs[0].cumulative_logprob is None
    sums = [sum(d[t].logprob for d, t in zip(s.logprobs, s.token_ids, strict=True))
            for s in best.sequences]
    assert best.outputs[0].token_ids == best.sequences[sums.index(max(sums))].token_ids
    with pytest.raises(ContractViolation, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ContractViolation, match="'n'"):
        SamplingParams(n=0)


def test_stop_strings_end_the_text_in_the_engine(llm: LLM) -> None:
    plain = greedy(llm, TEXT).outputs[0]
    stop = plain.text[9:13]
    assert stop.strip() and plain.text.index(stop) >= 1
    cut = plain.text.index(stop)
    out = greedy(llm, TEXT, stop=[stop, "zzqx"]).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (plain.text[:cut], "stop", stop)
    assert len(out.token_ids) < len(plain.token_ids)
    assert plain.token_ids[:len(out.token_ids)] == out.token_ids
    kept = greedy(llm, TEXT, stop=stop, include_stop_str_in_output=True).outputs[0]
    assert kept.text == plain.text[:cut + len(stop)] and kept.stop_reason == stop
    # the engine's per-step text only grows and never shows the stop string
    texts = [o.text for o in llm.stream(TEXT, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == plain.text[:cut] and all(stop not in t for t in texts)


def test_stop_token_ids_name_the_token_and_leave_the_text(llm: LLM) -> None:
    plain = greedy(llm, TEXT).outputs[0]
    tid = plain.token_ids[5]
    out = greedy(llm, TEXT, stop_token_ids=[tid]).outputs[0]
    k = plain.token_ids.index(tid)
    assert out.token_ids == plain.token_ids[:k + 1] and out.stop_reason == tid
    assert out.text == llm.engine.tokenizer.decode(plain.token_ids[:k])
    both = greedy(llm, TEXT, stop_token_ids=[tid], include_stop_str_in_output=True)
    assert both.outputs[0].text == llm.engine.tokenizer.decode(plain.token_ids[:k + 1])


def test_detokenize_and_skip_special_tokens(llm: LLM) -> None:
    plain = greedy(llm, TEXT).outputs[0]
    ids_only = greedy(llm, TEXT, detokenize=False).outputs[0]
    assert ids_only.token_ids == plain.token_ids and ids_only.text == ""
    with pytest.raises(ContractViolation, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)
    special = llm.engine.eos_token_ids[-1]  # forced twice past EOS
    forced = {"logit_bias": {special: 100.0}, "max_tokens": 2}
    skipped = greedy(llm, TEXT, **forced).outputs[0]
    shown = greedy(llm, TEXT, skip_special_tokens=False, **forced).outputs[0]
    assert skipped.token_ids == shown.token_ids == (special, special)
    assert skipped.text == ""
    assert shown.text == llm.engine.tokenizer.decode([special] * 2, skip_special_tokens=False)
    assert shown.text


def test_score_of_text_is_lm_evals_continuation(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    ctx, cont = "In the beginning", " God created"
    by_text = llm.score([ctx], [cont])[0]
    by_ids = llm.score([tok.encode(ctx)], [tok.encode(cont, add_special_tokens=False)])[0]
    assert len(by_text) == len(tok.encode(cont, add_special_tokens=False)) == len(by_ids)
    assert by_text == by_ids
    # a text completion after token ids: no special tokens either
    assert llm.score([tok.encode(ctx)], [cont])[0] == by_ids
    # the context's trailing space moves onto the completion, as lm-eval moves it
    assert llm.score([ctx + " "], ["God created"])[0] == by_text
    # the sum is the greedy engine's logprob of the same tokens after the same prompt
    ids = tok.encode(ctx)
    forced = tok.encode(cont, add_special_tokens=False)
    out = llm.generate([ids + forced[:1]], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0), use_progress=False)[0]
    assert out.prompt_logprobs[-1][forced[0]].logprob == pytest.approx(by_text[0], abs=1e-4)


def test_prompt_logprobs_after_a_cached_prefix_are_all_there(llm: LLM) -> None:
    """A prompt whose prefix is in the prefix cache still gets every prompt logprob (it reads
    no cached prefix), the same as in an engine that never saw the prefix."""
    ids = llm.engine.tokenizer.encode((default_model_dir() / "heldout.txt").read_text()[:3000])
    assert len(ids) > 400
    llm.generate([ids[:300]], GREEDY, use_progress=False)  # the prefix is cached now
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate([ids], params, use_progress=False)[0]
    assert out.num_cached_tokens == 0
    assert llm.generate([ids], GREEDY, use_progress=False)[0].num_cached_tokens >= 256
    assert out.prompt_logprobs[0] is None and all(d is not None for d in out.prompt_logprobs[1:])
    fresh = LLM(None, dtype="float32", max_num_seqs=8).generate(
        [ids], params, use_progress=False)[0]
    assert [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)] == \
        [d[t].logprob for d, t in zip(fresh.prompt_logprobs[1:], ids[1:], strict=True)]
