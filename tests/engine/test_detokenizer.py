"""The incremental detokeniser: any chunking of any token sequence ends with exactly
``tokenizer.decode`` of the whole sequence, each step's text only grows, and it never decodes
more than a short window (O(new tokens) a step)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.core.detokenizer import IncrementalDetokenizer
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.tokenizer import ByteTokenizer
from pagedhybrid.serve.llm import LLM

TOK = load_tokenizer(default_model_dir())
TEXT = "In the beginning — God créa 天地 ∑ 😀 and the earth was without form. "


class CountingTokenizer:
    def __init__(self, inner: object) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_ends_with_the_full_decode(data: st.DataObject) -> None:
    tok = data.draw(st.sampled_from([TOK, ByteTokenizer()]))
    if data.draw(st.booleans()):
        ids = tok.encode(TEXT * 2, add_special_tokens=False)
    else:
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=80))
    d = IncrementalDetokenizer(tok)
    i, seen = 0, ""
    while i < len(ids):
        k = data.draw(st.integers(1, 4))
        d.add(ids[i:i + k])
        i += k
        assert d.text.startswith(seen)  # text only grows
        seen = d.text
    d.finish()
    assert d.text == tok.decode(ids)


def test_each_step_decodes_a_short_window() -> None:
    ids = TOK.encode(TEXT * 20, add_special_tokens=False)
    counting = CountingTokenizer(TOK)
    d = IncrementalDetokenizer(counting)
    for t in ids:
        d.add([t])
    d.finish()
    assert d.text == TOK.decode(ids)
    assert counting.decoded < 12 * len(ids)  # a full re-decode per step would be ~len^2 / 2


def test_engine_text_is_the_decode_of_its_tokens() -> None:
    llm = LLM(None, max_num_seqs=4)
    outs = llm.generate(["And God said", "Then Jesus went up"],
                        SamplingParams(temperature=1.0, seed=3, max_tokens=40),
                        use_progress=False)
    for o in outs:
        assert o.text == TOK.decode(o.token_ids)


def test_the_engines_deltas_add_up_to_its_outputs() -> None:
    """``SequenceOutput.delta()`` -- what the server carries to HTTP -- adds up, report after
    report, to the engine's whole output: the new text (stop strings held back and cut), the
    new tokens and their logprobs; the prompt's ids come with the first delta only and its
    logprobs exactly once."""
    llm = LLM(None, max_num_seqs=4)
    engine = llm.engine
    cases = {"a": SamplingParams(temperature=1.0, seed=5, max_tokens=30, logprobs=2,
                                 prompt_logprobs=1),
             "b": SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."]),
             "c": SamplingParams(temperature=1.0, seed=9, max_tokens=25, logprobs=0,
                                 include_stop_str_in_output=True, stop=["e"])}
    for rid, params in cases.items():
        engine.add_request(rid, "And God said", params)
    got: dict[str, list] = {rid: [] for rid in cases}
    final = {}
    for out in engine.stream():
        got[out.request_id].append(out.delta())
        if out.finished:
            final[out.request_id] = out
    for rid, deltas in got.items():
        whole = final[rid]
        assert [d.prompt_token_ids is not None for d in deltas] == \
            [True] + [False] * (len(deltas) - 1)
        assert deltas[0].prompt_token_ids == whole.prompt_token_ids
        assert all(d.num_prompt_tokens == len(whole.prompt_token_ids) for d in deltas)
        assert "".join(d.new_text for d in deltas) == whole.text
        assert sum((d.new_token_ids for d in deltas), ()) == whole.token_ids
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert deltas[-1].finish_reason == whole.finish_reason
        assert deltas[-1].stop_reason == whole.stop_reason
        if cases[rid].logprobs is None:
            assert all(d.new_logprobs is None for d in deltas)
        else:
            assert sum((d.new_logprobs for d in deltas), ()) == whole.logprobs
        sent = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
        assert sent == ([whole.prompt_logprobs] if cases[rid].prompt_logprobs else [])
    assert final["b"].stop_reason in (" the", ".")  # the stop string cut the text
