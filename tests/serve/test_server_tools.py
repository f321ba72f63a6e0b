"""Tool calls and reasoning through the real ``openai`` client (``engine/chat.py`` behind the
server): forced calls (``required``, a named function, one call when ``parallel_tool_calls`` is
false) streamed as OpenAI streams them (a header delta, then argument deltas) and equal to the
same answer whole, arguments valid for the function's schema, ``finish_reason: "tool_calls"``;
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

from pagedhybrid.engine import LLM, SamplingParams
from pagedhybrid.models.qwen35.synthetic import QWEN35_CHAT_TEMPLATE

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


@pytest.mark.parametrize(("choice", "parallel"), [
    ("required", True), ({"type": "function", "function": {"name": "sing_psalm"}}, False)])
def test_forced_calls_stream_as_openai_and_equal_the_whole_answer(server: Server,
                                                                  choice: object,
                                                                  parallel: bool) -> None:
    """Parallel calls: this model calls again and again until ``max_tokens`` (``length``; the
    cut call is closed with the arguments it completed); one call: ``tool_calls``."""
    c = client(server)
    kw = {"model": server.model, "messages": ASK, "tools": [VERSE, PSALM],
          "tool_choice": choice, "parallel_tool_calls": parallel, "temperature": 0,
          "max_tokens": 160}
    whole = c.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.content is None
    assert whole.choices[0].finish_reason == ("length" if parallel else "tool_calls")
    assert len(msg.tool_calls) >= 2 if parallel else len(msg.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (VERSE, PSALM)}
    for call in msg.tool_calls[:-1] if parallel else msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if not parallel:
            assert call.function.name == "sing_psalm"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed, finish = streamed_message(c.chat.completions.create(**kw, stream=True))
    assert finish == whole.choices[0].finish_reason and streamed["content"] == ""
    assert [(t["name"], t["arguments"]) for _, t in sorted(streamed["tool_calls"].items())] == \
        [(t.function.name, t.function.arguments) for t in msg.tool_calls]


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
