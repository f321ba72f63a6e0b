"""Tool calls and reasoning through the real ``openai`` client (``serve/chat/format.py`` behind the
server): forced calls (``required``, a named function, one call when ``parallel_tool_calls`` is
false) streamed as OpenAI streams them (a header delta, then argument deltas) and equal to the
same answer whole, arguments valid for the function's schema, ``finish_reason: "tool_calls"``
(a named function called exactly once, as OpenAI and vLLM do; ``required`` at most
``MAX_PARALLEL_CALLS`` times); an answer cut by ``max_tokens`` anywhere: ``length``, no markup in
the content, a cut call with the arguments generated so far;
an assistant turn's calls and the tool's result go back through the chat template (the prompt
the server counts is the one ``/tokenize`` renders); reasoning split into ``reasoning_content``
when the template opened ``<think>``, none with ``enable_thinking`` false; and 400s naming the
field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import Server, start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.models.qwen35.synthetic import QWEN35_CHAT_TEMPLATE
from pagedhybrid.serve.chat.format import MAX_PARALLEL_CALLS
from pagedhybrid.serve.llm import LLM

VERSE = {"type": "function", "function": {
    "name": "find_verse", "description": "Find a verse of the Bible",
    "parameters": {"type": "object", "required": ["book", "chapter"], "properties": {
        "book": {"type": "string", "maxLength": 12},
        "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
        "testament": {"type": "string", "enum": ["old", "new"]}}}}}
PSALM = {"type": "function", "function": {
    "name": "sing_psalm", "parameters": {"type": "object", "required": ["number"],
                                         "properties": {"number": {"type": "integer",
                                                                   "minimum": 1,
                                                                   "maximum": 150}}}}}
ASK = [{"role": "user", "content": "Where is it written: In the beginning God created?"}]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def streamed_message(chunks) -> tuple[dict, str | None]:
    """OpenAI's stream folded into a message: content and reasoning joined, tool calls by
    index (the first delta of a call carries its id and name, the rest argument text)."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        msg["content"] += d.content or ""
        msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            call = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None,
                                                           "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None and tc.function.name is not None  # the header
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return msg, finish


SING = {"type": "function", "function": {"name": "sing_psalm"}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (VERSE, PSALM)}


@pytest.mark.parametrize(("choice", "parallel", "calls"), [
    ("required", True, (1, MAX_PARALLEL_CALLS)), ("required", False, (1, 1)),
    (SING, True, (1, 1)), (SING, False, (1, 1))])
def test_forced_calls_stream_as_openai_and_equal_the_whole_answer(server: Server,
                                                                  choice: object,
                                                                  parallel: bool,
                                                                  calls: tuple[int, int]
                                                                  ) -> None:
    """This model calls again and again where the grammar lets it: ``required`` with parallel
    calls still ends (at most ``MAX_PARALLEL_CALLS`` calls), a named function is called
    exactly once (parallel calls allowed or not), one call without parallel calls; every
    answer ends with ``tool_calls``, not ``length``, and no markup reaches the content."""
    c = client(server)
    kw = {"model": server.model, "messages": ASK, "tools": [VERSE, PSALM],
          "tool_choice": choice, "parallel_tool_calls": parallel, "temperature": 0,
          "max_tokens": 1200}
    whole = c.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.content is None
    assert whole.choices[0].finish_reason == "tool_calls"
    assert calls[0] <= len(msg.tool_calls) <= calls[1]
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if choice == SING:
            assert call.function.name == "sing_psalm"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed, finish = streamed_message(c.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and streamed["content"] == ""
    assert [(t["name"], t["arguments"]) for _, t in sorted(streamed["tool_calls"].items())] == \
        [(t.function.name, t.function.arguments) for t in msg.tool_calls]


def test_calls_cut_by_max_tokens_keep_their_partial_arguments(server: Server) -> None:
    """``max_tokens`` anywhere in the first call and the start of the second: ``length``, no
    markup (``<tool_call``, ``</tool_call``, a prefix of them) in the content, streamed or
    not, and each call's arguments a prefix of the uncut call's -- the JSON text generated so
    far, not ``{}`` (OpenAI returns a cut call so); the stream says the same."""
    c = client(server)
    kw = {"model": server.model, "messages": ASK, "tools": [VERSE, PSALM],
          "tool_choice": "required", "temperature": 0}
    full = c.chat.completions.create(**kw, max_tokens=1200)
    want = [(t.function.name, t.function.arguments) for t in full.choices[0].message.tool_calls]
    assert len(want) >= 2, want  # the built-in model calls again: the cuts reach the second
    first = c.chat.completions.create(**{**kw, "parallel_tool_calls": False}, max_tokens=1200)
    n_first = first.usage.completion_tokens  # the first call's tokens
    partial = 0
    for n in [*range(2, n_first, 4), *range(n_first, n_first + 16)]:
        whole = c.chat.completions.create(**kw, max_tokens=n)
        ch = whole.choices[0]
        assert ch.finish_reason == "length" and not ch.message.content, (n, ch.message)
        got = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        for (name, args), (want_name, want_args) in zip(got, want, strict=False):
            assert name == want_name and want_args.startswith(args), (n, got, want)
            partial += args not in ("", want_args)
        streamed, finish = streamed_message(c.chat.completions.create(**kw, max_tokens=n,
                                                                      stream=True))
        assert finish == "length" and streamed["content"] == "", (n, streamed)
        assert [(t["name"], t["arguments"]) for _, t in
                sorted(streamed["tool_calls"].items())] == got
    assert partial  # some cut fell inside the arguments, and they were kept


@pytest.mark.parametrize("written", ["In the beginning <tool_c",
                                     "In the beginning\n\n<tool_call>\n<fun"])
def test_a_tag_cut_short_never_reaches_the_content(server: Server, written: str) -> None:
    """``tool_choice`` auto, the model made (by ``guided_regex``) to end its answer inside
    ``<tool_call>`` markup: the content is the text before it, streamed or not."""
    c = client(server)
    kw = {"model": server.model, "messages": ASK, "tools": [VERSE, PSALM], "temperature": 0,
          "max_tokens": 64, "extra_body": {"guided_regex": written}}
    whole = c.chat.completions.create(**kw).choices[0]
    streamed, finish = streamed_message(c.chat.completions.create(**kw, stream=True))
    assert whole.message.content == streamed["content"] == "In the beginning"
    assert not whole.message.tool_calls and not streamed["tool_calls"]
    assert whole.finish_reason == finish == "stop"


def test_one_call_then_the_tool_result_goes_back_through_the_template(server: Server,
                                                                      llm: LLM) -> None:
    c = client(server)
    first = c.chat.completions.create(model=server.model, messages=ASK, tools=[VERSE],
                                      tool_choice="required", parallel_tool_calls=False,
                                      temperature=1.0, seed=7, max_tokens=200)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Genesis 1:1"}]
    rendered = httpx.post(f"{server.base}/tokenize", timeout=60, json={
        "messages": turn, "tools": [VERSE], "return_token_strs": True}).json()
    text = "".join(rendered["token_strs"])
    assert "<tool_response>\nGenesis 1:1\n</tool_response>" in text
    assert "<function=find_verse>" in text and '"find_verse"' in text  # the call and the tools
    answer = c.chat.completions.create(model=server.model, messages=turn, tools=[VERSE],
                                       temperature=0, max_tokens=16)
    assert answer.usage.prompt_tokens == rendered["count"]
    want = llm.generate([rendered["tokens"]], SamplingParams(temperature=0.0, max_tokens=16),
                        use_progress=False)[0]
    assert answer.choices[0].message.content == llm.engine.tokenizer.decode(want.token_ids)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_each_of_n_choices_is_parsed_alone(server: Server) -> None:
    r = client(server).chat.completions.create(
        model=server.model, messages=ASK, tools=[VERSE], tool_choice="required",
        parallel_tool_calls=False, n=3, seed=11, temperature=1.0, max_tokens=200)
    assert len(r.choices) == 3
    ids = set()
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), VERSE["function"]["parameters"])
        ids.add(call.id)
    assert len(ids) == 3  # every call its own id


BAD = [  # (fields, param)
    ({"tools": [VERSE], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [VERSE, VERSE]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}]},
     "tools[0].function.parameters.properties.s.pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "intger"}}}}}], "tool_choice": "required"},
     "tool_choice"),
    ({"tools": [VERSE], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tool_requests_are_400_naming_the_field(server: Server, fields: dict,
                                                    param: str) -> None:
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, (fields, r.text)
    assert r.json()["error"]["param"] == param, r.json()


def test_reasoning_content_with_the_qwen35_template(tmp_path) -> None:
    """The built-in model under the Qwen3.5 template (``--chat-template``): the template opens
    ``<think>`` and this model never closes it, so the whole answer is ``reasoning_content``
    (content null), streamed or not; ``enable_thinking`` false closes it in the prompt and the
    answer is content, and a JSON schema then holds from the answer's start."""
    s = start_server(tmp_path, "--chat-template", str(QWEN35_CHAT_TEMPLATE))
    try:
        c = client(s)
        kw = {"model": s.model, "messages": ASK, "temperature": 0, "max_tokens": 24}
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert msg.content is None and reasoning and r.choices[0].finish_reason == "length"
        streamed, _ = streamed_message(c.chat.completions.create(**kw, stream=True))
        assert streamed["reasoning_content"] == reasoning and streamed["content"] == ""
        off = c.chat.completions.create(**kw, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}})
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {}) or \
            off.choices[0].message.model_extra["reasoning_content"] is None
        assert off.choices[0].message.content
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                         "maximum": 99}},
                  "required": ["n"], "additionalProperties": False}
        js = c.chat.completions.create(**{**kw, "max_tokens": 40}, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        jsonschema.validate(json.loads(js.choices[0].message.content), schema)
        bad = httpx.post(f"{s.url}/chat/completions", timeout=60, json={
            "model": s.model, "messages": ASK, "max_tokens": 4, "guided_json": "{not json"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_json"
    finally:
        assert s.stop() == 0
