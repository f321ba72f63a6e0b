"""``pagedhybrid serve`` through the real ``openai`` client and httpx: answers equal
``LLM.generate``, usage is exact, stop strings never leak, and every client mistake gets its
documented status and OpenAI error body while the server keeps serving."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import Server, flood, start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config, write_checkpoint
from pagedhybrid.serve.llm import LLM

PROMPT = "And it came to pass, when the king heard"


def greedy(llm: LLM, ids: list[int], n: int) -> list[int]:
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n),
                       use_progress=False)[0]
    return list(out.token_ids)


def client(server: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)


def test_completions_equal_llm_generate_streaming_or_not(server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    ids = tok.encode(PROMPT)
    want = greedy(llm, ids, 24)
    c = client(server)
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == tok.decode(want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), len(want), len(ids) + len(want))
    assert r.choices[0].finish_reason in ("length", "stop")
    by_ids = c.completions.create(model=server.model, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    pieces, usage, finish = [], None, None
    for ch in c.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                   temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        if ch.choices:
            pieces.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(pieces) == r.choices[0].text and finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == len(want)
    echo = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                temperature=0, echo=True, logprobs=2)
    assert echo.choices[0].text.startswith(PROMPT)
    lp = echo.choices[0].logprobs  # the prompt's tokens first (the very first has none)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])


def test_chat_equals_llm_generate_of_the_templated_prompt(server: Server, llm: LLM) -> None:
    tok = llm.engine.tokenizer
    messages = [{"role": "system", "content": "Answer in the words of the KJV."},
                {"role": "user", "content": "Recite Genesis 1:1."}]
    # the template writes the BOS itself; the chat endpoint adds no other special token
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    c = client(server)
    r = c.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                  max_completion_tokens=48, logprobs=True, top_logprobs=2)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=48),
                       use_progress=False)[0]
    assert r.choices[0].message.content == tok.decode(out.token_ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if out.finish_reason == "stop" else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out.token_ids)
    assert len(r.choices[0].logprobs.content) == len(out.token_ids)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=48, stream=True)
        if ch.choices)
    assert streamed == r.choices[0].message.content


def test_n_with_a_seed_is_reproducible_and_stop_strings_never_leak(server: Server,
                                                                   llm: LLM) -> None:
    c = client(server)
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0,
          "n": 3, "seed": 5}
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert len({x.text for x in a.choices}) > 1  # the choices are different samples
    assert a.usage.completion_tokens == 60
    tok = llm.engine.tokenizer
    full = tok.decode(greedy(llm, tok.encode(PROMPT), 30))
    stop = full[8:12]  # a string that the greedy answer contains
    cut = full[:full.find(stop)]
    for stream in (False, True):
        if stream:
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model=server.model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                stream=True) if ch.choices)
        else:
            r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=30,
                                     temperature=0, stop=[stop, "zzzz"])
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert text == cut and stop not in text
    # n samples that stop at different times: each choice ends exactly once, with its text
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for ch in c.completions.create(model=server.model, prompt=PROMPT, max_tokens=30,
                                   temperature=1.0, seed=3, n=4, stop=["e"], stream=True):
        for x in ch.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
            if x.finish_reason is not None:
                finishes.setdefault(x.index, []).append(x.finish_reason)
    assert sorted(finishes) == [0, 1, 2, 3] and all(len(f) == 1 for f in finishes.values()), \
        finishes
    assert all("e" not in t for t in texts.values()), texts
    first = greedy(llm, tok.encode(PROMPT), 3)
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0,
                             extra_body={"stop_token_ids": [first[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                             extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 8})
    assert r.usage.completion_tokens == 8


def test_stop_reason_and_the_stop_options_streamed_or_not(server: Server, llm: LLM) -> None:
    """vLLM's ``stop_reason`` in every choice (the stop string, the stop token id, or null),
    ``include_stop_str_in_output`` and ``skip_special_tokens``: the engine's own stop code
    (``LLM.generate`` gives the same text)."""
    c = client(server)
    tok = llm.engine.tokenizer
    full = tok.decode(greedy(llm, tok.encode(PROMPT), 30))
    stop = full[8:12]
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 30, "temperature": 0,
          "stop": [stop]}
    for include in (False, True):
        expect = llm.generate(PROMPT, SamplingParams(
            temperature=0.0, max_tokens=30, stop=[stop], include_stop_str_in_output=include),
            use_progress=False)[0].outputs[0]
        assert expect.stop_reason == stop
        extra = {"include_stop_str_in_output": include}
        r = c.completions.create(**kw, extra_body=extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expect.text, "stop")
        assert r.choices[0].stop_reason == stop
        chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True,
                                                               extra_body=extra) if ch.choices]
        assert "".join(x.text for x in chunks) == expect.text
        assert [(x.finish_reason, x.stop_reason) for x in chunks if x.finish_reason] == \
            [("stop", stop)]
    first = greedy(llm, tok.encode(PROMPT), 3)
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0,
                             extra_body={"stop_token_ids": [first[2]]})
    assert r.choices[0].stop_reason == first[2]
    assert r.choices[0].text == tok.decode(first[:2])
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].stop_reason is None
    messages = [{"role": "user", "content": "Who made the heaven?"}]
    chat = c.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                     max_tokens=40)
    answer = chat.choices[0].message.content
    assert answer and chat.choices[0].stop_reason is None
    cut = answer[3:6]
    chat = c.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                     max_tokens=40, stop=[cut])
    assert chat.choices[0].message.content == answer[:answer.index(cut)]
    assert (chat.choices[0].finish_reason, chat.choices[0].stop_reason) == ("stop", cut)
    last = [ch.choices[0] for ch in c.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=40, stop=[cut],
        stream=True) if ch.choices and ch.choices[0].finish_reason]
    assert [(x.finish_reason, x.stop_reason) for x in last] == [("stop", cut)]
    # special tokens: forced past EOS, shown only with skip_special_tokens false
    eos = llm.engine.eos_token_ids[-1]
    forced = {"logit_bias": {str(eos): 100}, "ignore_eos": True}
    hidden = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                  temperature=0, extra_body=forced)
    shown = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                 temperature=0,
                                 extra_body={**forced, "skip_special_tokens": False})
    assert hidden.choices[0].text == ""
    assert shown.choices[0].text == tok.decode([eos, eos], skip_special_tokens=False) != ""


BAD = [  # (description, request kwargs for httpx, status, param)
    ("malformed JSON", {"content": b"{not json", "headers": {"content-type":
                                                              "application/json"}}, 400, "body"),
    ("unknown model", {"json": {"model": "gpt-x", "prompt": "hi"}}, 404, "model"),
    ("empty prompt", {"json": {"prompt": ""}}, 400, "prompt"),
    ("empty token list", {"json": {"prompt": []}}, 400, "prompt"),
    ("token ids out of vocab", {"json": {"prompt": [1, 2, 10 ** 6]}}, 400, "prompt"),
    ("over max_model_len", {"json": {"prompt": "In the", "max_tokens": 10 ** 5}}, 400,
     "max_tokens"),
    ("negative temperature", {"json": {"prompt": "hi", "temperature": -1}}, 400, "temperature"),
    ("top_p 0", {"json": {"prompt": "hi", "top_p": 0}}, 400, "top_p"),
    ("n 0", {"json": {"prompt": "hi", "n": 0}}, 400, "n"),
    ("max_tokens 0", {"json": {"prompt": "hi", "max_tokens": 0}}, 400, "max_tokens"),
    ("wrong type", {"json": {"prompt": "hi", "max_tokens": "lots"}}, 400, "max_tokens"),
    ("too many logprobs", {"json": {"prompt": "hi", "logprobs": 99}}, 400, "logprobs"),
]


@pytest.mark.parametrize(("what", "kwargs", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
        server: Server, llm: LLM, what: str, kwargs: dict, status: int, param: str | None
        ) -> None:
    if "json" in kwargs:
        kwargs = {"json": {"model": server.model, **kwargs["json"]}}
    r = httpx.post(f"{server.url}/completions", timeout=60, **kwargs)
    assert r.status_code == status, (what, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, (what, err)
    good = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                             temperature=0)
    tok = llm.engine.tokenizer
    assert good.choices[0].text == tok.decode(greedy(llm, tok.encode(PROMPT), 5))


def test_bad_chat_requests_and_the_openai_client_errors(server: Server) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.model, max_tokens=10 ** 5,
                                  messages=[{"role": "user", "content": "hi"}])
    models = c.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_api_key_and_a_failing_request_fails_alone(tmp_path) -> None:
    """A byte-level checkpoint whose token 200 has a NaN embedding: a request holding it fails
    alone (500, its error); the next request is served."""
    cfg = dataclasses.replace(tiny_byte_config(), num_hidden_layers=2,
                              layer_types=("linear_attention", "full_attention"),
                              tie_word_embeddings=False)  # the NaN row is an input row only
    w = random_weights(cfg, 3)
    w["model.embed_tokens.weight"][200] = float("nan")
    write_checkpoint(tmp_path / "nan", cfg, w)
    s = start_server(tmp_path, str(tmp_path / "nan"), "--api-key", "sekret", name="nan-model")
    try:
        for key in ("wrong", None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(f"{s.url}/completions", headers=headers, timeout=60,
                           json={"model": s.model, "prompt": [65, 66]})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        c = client(s, "sekret")
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=s.model, prompt=[65, 200, 66], max_tokens=4)
        assert "non-finite" in e.value.body["message"]
        ok = c.completions.create(model=s.model, prompt=[65, 66, 67], max_tokens=1,
                                  temperature=0)
        assert ok.usage.completion_tokens == 1
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log.read_text()


def test_backpressure_refuses_with_503_and_drops_nothing_accepted(tmp_path) -> None:
    s = start_server(tmp_path, "--max-waiting", "2", "--max-num-seqs", "1")
    try:
        rs = flood(s, 12, max_tokens=40, timeout=120)
        codes = [r.status_code for r in rs]
        assert 503 in codes and 200 in codes, codes
        for r in rs:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_overloaded"
            else:  # nothing accepted was dropped
                assert r.json()["usage"]["completion_tokens"] == 40, r.text
        m = s.metrics()
        assert m["pagedhybrid:num_requests_running"] == 0
        assert m["pagedhybrid:num_requests_waiting"] == 0
        assert m["pagedhybrid:request_success_total"] == codes.count(200)
        assert m["pagedhybrid:generation_tokens_total"] == 40 * codes.count(200)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_server_answers_as_without_and_counts_drafts(tmp_path, llm: LLM,
                                                                 method: str) -> None:
    """``--speculative-config`` (vLLM's JSON): n-gram drafts, or the built-in model's MTP head,
    on a repetitive prompt leave the greedy answers -- plain and streamed, through the openai
    client -- as ``LLM.generate`` gives them without speculation, and /metrics counts the
    drafts vLLM's way. A bad config stops the server at start, naming the key."""
    extra = ', "prompt_lookup_min": 1' if method == "ngram" else ""
    spec = f'{{"method": "{method}", "num_speculative_tokens": 4{extra}, "adaptive": false}}'
    s = start_server(tmp_path, "--max-num-seqs", "4", "--speculative-config", spec)
    try:
        tok = llm.engine.tokenizer
        prompt = "the king heard it, and the king said: " * 3 + "the king"
        want = tok.decode(greedy(llm, tok.encode(prompt), 32))
        c = client(s)
        r = c.completions.create(model=s.model, prompt=prompt, max_tokens=32, temperature=0)
        assert r.choices[0].text == want and r.usage.completion_tokens == 32
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=s.model, prompt=prompt, max_tokens=32, temperature=0, stream=True)
            if ch.choices)
        assert streamed == want
        m = s.metrics()
        drafts = m["pagedhybrid:spec_decode_num_draft_tokens_total"]
        accepted = m["pagedhybrid:spec_decode_num_accepted_tokens_total"]
        assert m["pagedhybrid:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
        assert m["pagedhybrid:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
        assert m["pagedhybrid:generation_tokens_total"] == 64
    finally:
        assert s.stop() == 0
    bad = subprocess.run([sys.executable, "-m", "pagedhybrid", "serve", "--speculative-config",
                          '{"num_speculative_tokens": 9}'], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr, bad.stderr


def test_structured_outputs_through_the_openai_client(server: Server) -> None:
    """``response_format`` json_schema through the real openai client's
    ``beta.chat.completions.parse`` with a pydantic model (parsed, schema-valid), json_object,
    and vLLM's ``guided_choice`` / ``guided_regex`` extras on completions, streamed and not --
    the KJV model knows no JSON: the grammar alone makes the answers valid."""
    import json
    import re

    from pydantic import BaseModel, Field

    class Verse(BaseModel):
        book: str = Field(max_length=12)
        chapter: int = Field(ge=1, le=150)
        kept: bool

    c = client(server)
    msgs = [{"role": "user", "content": "Recite Genesis 1:1."}]
    for seed in (1, 2):
        r = c.beta.chat.completions.parse(model=server.model, messages=msgs,
                                          response_format=Verse, max_tokens=64, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        verse = r.choices[0].message.parsed
        assert isinstance(verse, Verse) and 1 <= verse.chapter <= 150
    r = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=64, seed=3,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    choices = ["Moses", "Aaron"]
    r2 = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, seed=4,
                              extra_body={"guided_choice": choices})
    assert r2.choices[0].text in choices
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=12, seed=5, stream=True,
        extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"}) if ch.choices)
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", streamed), streamed
