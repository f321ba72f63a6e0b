"""Chat answers in the Qwen3.5 format (``serve/chat/format.py``) and ``LLM.chat``.

* the parser: reasoning opened by the prompt or by the model, never closed, or absent; content;
  XML tool calls (and Qwen3's JSON calls) with arguments converted by the function's schema; a
  call inside the reasoning is kept; malformed and unfinished calls; ``parallel_tool_calls``
  false -- the expected message of each case, and the same message however the text is chunked
  (a streamed answer and the whole answer parse identically);
* forced calls (``tool_choice`` ``required`` and named) on the built-in model for generated
  parameter schemas: every call names a given function and its arguments validate
  (``jsonschema``) -- the model knows no tools: the grammar alone makes them valid;
* grammars apply after the reasoning: under a prompt that opened ``<think>`` every token is
  allowed until ``</think>``, then only the structured output's; with the Qwen3.5 template,
  ``enable_thinking`` false answers in JSON and an unclosed reasoning is all reasoning;
* refusals by field.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedhybrid.engine import Engine, SamplingParams, load_engine
from pagedhybrid.engine.core.request import InvalidRequest
from pagedhybrid.engine.sample.structured import Grammars, StructuredOutputs, allowed_tokens
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native.sampling import unpack_bitmask
from pagedhybrid.models.qwen35.synthetic import QWEN35_CHAT_TEMPLATE
from pagedhybrid.serve.chat.format import (
    MAX_PARALLEL_CALLS,
    Tools,
    constraint,
    template_message,
    thinking,
)
from pagedhybrid.serve.chat.parser import ChatParser
from pagedhybrid.serve.llm import LLM

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}
VERSE = {"type": "function", "function": {
    "name": "find_verse", "parameters": {"type": "object", "required": ["book", "chapter"],
                                         "properties": {
                                             "book": {"type": "string", "maxLength": 10},
                                             "chapter": {"type": "integer", "minimum": 1,
                                                         "maximum": 150}}}}}
TOOLS = Tools.of([WEATHER, VERSE])
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}

# (thinking, tools, text, expected message without ids)
CASES = [
    ("template-opened", True, TOOLS, "I should look.\n</think>\n\nLet me check.\n\n" + CALL,
     {"content": "Let me check.", "reasoning_content": "I should look.",
      "tool_calls": [PARIS]}),
    ("model-opened", False, None, "<think>\nhmm\n</think>\n\nIn the beginning",
     {"content": "In the beginning", "reasoning_content": "hmm"}),
    ("no think", False, TOOLS, "And God said", {"content": "And God said"}),
    ("a tag cut short is not content", False, TOOLS, "And God said <tool",
     {"content": "And God said"}),
    ("a call cut before its name", False, TOOLS, "Let me see.\n\n<tool_call>\n<f",
     {"content": "Let me see."}),
    ("tags are text without tools", False, None, "And God said <tool",
     {"content": "And God said <tool"}),
    ("never closed", True, TOOLS, "still thinking\nabout it",
     {"content": None, "reasoning_content": "still thinking\nabout it"}),
    ("call inside think", True, TOOLS, "I will call " + CALL,
     {"content": None, "reasoning_content": "I will call", "tool_calls": [PARIS]}),
    ("two calls", False, TOOLS, CALL + "\n\n" + CALL.replace("Paris", "Rome"),
     {"content": None, "tool_calls": [PARIS, {"name": "get_weather", "arguments":
                                               '{"city": "Rome", "days": 3}'}]}),
    ("qwen3 json call", False, TOOLS,
     '<tool_call>\n{"name": "find_verse", "arguments": {"book": "Ruth", "chapter": 1}}\n'
     "</tool_call>", {"content": None, "tool_calls": [
         {"name": "find_verse", "arguments": '{"book": "Ruth", "chapter": 1}'}]}),
    ("not a call", False, TOOLS, "<tool_call>oops</tool_call> after",
     {"content": "<tool_call>oops</tool_call> after"}),
    ("cut in an argument's name", False, TOOLS,
     CALL[:CALL.index("<parameter=days>")] + "<parameter=da",
     {"content": None, "tool_calls": [{"name": "get_weather",
                                       "arguments": '{"city": "Paris", "da'}]}),
    ("cut in a string value", False, TOOLS, CALL[:CALL.index("ris\n")],
     {"content": None, "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Pa'}]}),
    ("cut in a value's closing tag", False, TOOLS, CALL[:CALL.index("ameter>\n<parameter=d")],
     {"content": None, "tool_calls": [{"name": "get_weather",
                                       "arguments": '{"city": "Paris'}]}),
    ("cut after a call's name", False, TOOLS, CALL[:CALL.index("\n<parameter")],
     {"content": None, "tool_calls": [{"name": "get_weather", "arguments": ""}]}),
    ("cut while the call closes", False, TOOLS, CALL[:CALL.index("ction>\n</tool_call>")],
     {"content": None, "tool_calls": [PARIS]}),
    ("cut in a json call", False, TOOLS,
     '<tool_call>\n{"name": "find_verse", "arguments": {"book": "Ru',
     {"content": None, "tool_calls": [{"name": "find_verse", "arguments": '{"book": "Ru'}]}),
    ("string stays text", False, TOOLS, CALL.replace("Paris", "[1, 2]"),
     {"content": None, "tool_calls": [{"name": "get_weather",
                                       "arguments": '{"city": "[1, 2]", "days": 3}'}]}),
    ("tool_choice none", False, Tools.of([WEATHER], "none"), CALL, {"content": CALL}),
    ("one call only", False, Tools.of([WEATHER], "auto", False), CALL + "\n\n" + CALL,
     {"content": None, "tool_calls": [PARIS]}),
]


def shown(message: dict) -> dict:
    out = {k: v for k, v in message.items() if k != "role"}
    if "tool_calls" in out:
        assert all(c["id"].startswith("call_") and c["type"] == "function"
                   for c in out["tool_calls"])
        out["tool_calls"] = [c["function"] for c in out["tool_calls"]]
    return out


@pytest.mark.parametrize(("case", "opened", "tools", "text", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_parser_splits_an_answer_however_it_is_chunked(case: str, opened: bool,
                                                       tools: Tools | None, text: str,
                                                       expected: dict) -> None:
    whole = ChatParser(opened, tools)
    whole.feed(text, final=True)
    assert shown(whole.message()) == expected
    rng = random.Random(case)
    for _ in range(40):
        p, at, streamed = ChatParser(opened, tools), 0, {"content": "",
                                                         "reasoning_content": ""}
        args: dict[int, str] = {}
        while at <= len(text):
            step = rng.randint(1, 7)
            delta = p.feed(text[at:at + step], final=at + step > len(text))
            at += step
            for key in streamed:
                streamed[key] += delta.get(key, "")
            for item in delta.get("tool_calls", []):
                args[item["index"]] = args.get(item["index"], "") + item["function"][
                    "arguments"]
        assert shown(p.message()) == expected
        assert streamed["content"] == (expected["content"] or "")
        assert streamed["reasoning_content"] == expected.get("reasoning_content", "")
        assert [args[i] for i in sorted(args)] == [c["arguments"] for c in
                                                   expected.get("tool_calls", [])]
    if tools is not None and not tools.parallel:
        assert whole.done and whole.finish_reason("length") == "tool_calls"


ROME = CALL.replace("Paris", "Rome")
ANSWER = "Let me check.\n\n" + CALL + "\n\n" + ROME  # the calls' arguments: PARIS, then Rome's


def test_an_answer_cut_anywhere_keeps_what_was_generated_and_no_markup() -> None:
    """Every prefix of an answer with two calls, as ``max_tokens`` may cut it: the content is a
    prefix of the answer's (never markup: no ``<``), each call names its function and its
    arguments are a prefix of the whole call's (the JSON text generated so far), streamed or
    whole; a cut answer ends with ``length``."""
    full = ChatParser(False, TOOLS)
    full.feed(ANSWER, final=True)
    want = [(c.name, c.arguments) for c in full.calls]
    assert want == [("get_weather", PARIS["arguments"]),
                    ("get_weather", '{"city": "Rome", "days": 3}')]
    for n in range(len(ANSWER)):
        whole = ChatParser(False, TOOLS)
        whole.feed(ANSWER[:n], final=True)
        msg = whole.message()
        content = msg["content"] or ""
        assert "Let me check.".startswith(content.rstrip()), (ANSWER[:n], content)
        assert len(whole.calls) <= len(want) and whole.finish_reason("length") == "length"
        for call, (name, args) in zip(whole.calls, want, strict=False):
            assert call.name == name and args.startswith(call.arguments), (ANSWER[:n], call)
        if n > ANSWER.index("ris\n") and whole.calls:  # cut inside the first call's value
            assert whole.calls[-1].arguments != "{}"
        streamed, p, args_of = "", ChatParser(False, TOOLS), {}
        for at in range(0, n + 1, 5):
            delta = p.feed(ANSWER[at:min(at + 5, n)], final=at + 5 >= n)
            streamed += delta.get("content", "")
            for item in delta.get("tool_calls", []):
                args_of[item["index"]] = args_of.get(item["index"], "") + \
                    item["function"]["arguments"]
            if at + 5 >= n:
                break
        assert streamed == content
        assert [args_of[i] for i in sorted(args_of)] == [c.arguments for c in whole.calls]


def test_the_cut_arguments_are_what_the_model_wrote() -> None:
    cut = ChatParser(False, TOOLS)
    cut.feed(CALL[:CALL.index("ris\n")], final=True)
    assert cut.calls[0].arguments == '{"city": "Pa'  # not "{}": the call is unfinished
    cut = ChatParser(False, TOOLS)
    cut.feed(CALL[:CALL.index("\n</parameter>\n<parameter=days>")] + "\n</para", final=True)
    assert cut.calls[0].arguments == '{"city": "Paris'  # the closing tag's start is markup
    unknown = ChatParser(False, TOOLS)
    unknown.feed("<tool_call>\n<function=other>\n<parameter=xs>\n[1, 2", final=True)
    assert unknown.calls[0].arguments == '{"xs": [1, 2'  # JSON as written


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(None, num_blocks=256, max_num_seqs=16)


LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(0, 40).map(lambda n: {"type": "integer", "minimum": -n, "maximum": n}),
    st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["north", "south", "x y"]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"type": "string", "enum": v}),
    st.just({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 3}),
    st.just({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
             "additionalProperties": False}),
)
PARAMETERS = st.dictionaries(st.sampled_from(["place", "count", "mode", "tags", "opt"]), LEAF,
                             min_size=0, max_size=4).flatmap(
    lambda props: st.lists(st.sampled_from(sorted(props) or ["-"]), unique=True).map(
        lambda req: {"type": "object", "properties": props,
                     "required": [r for r in req if r in props]}))


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=PARAMETERS, seed=st.integers(0, 2 ** 31), named=st.booleans())
def test_forced_calls_always_name_a_tool_and_validate(engine: Engine, params: dict, seed: int,
                                                      named: bool) -> None:
    tools = [{"type": "function", "function": {"name": "act", "parameters": params}}, WEATHER]
    choice = {"type": "function", "function": {"name": "act"}} if named else "required"
    (out,) = LLM(engine=engine).chat(ASK, SamplingParams(temperature=1.0, seed=seed,
                                                         max_tokens=200),
                                     tools=tools, tool_choice=choice,
                                     parallel_tool_calls=False, use_progress=False)
    assert out.finish_reason == "tool_calls", out.outputs[0].text
    msg = out.outputs[0].message
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    for call in msg["tool_calls"]:
        fn = call["function"]
        assert fn["name"] in (("act",) if named else ("act", "get_weather"))
        schema = params if fn["name"] == "act" else WEATHER["function"]["parameters"]
        jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_one_call_when_parallel_calls_are_off_and_tool_results_render(engine: Engine) -> None:
    llm = LLM(engine=engine)
    (out,) = llm.chat(ASK, SamplingParams(temperature=1.0, seed=3, max_tokens=120),
                      tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                      use_progress=False)
    assert out.finish_reason == "tool_calls" and len(out.outputs[0].message["tool_calls"]) == 1
    assert out.outputs[0].text.endswith("</tool_call>")  # the grammar allows one call, then EOS
    call = out.outputs[0].message["tool_calls"][0]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    text = engine.tokenizer.apply_chat_template(
        [template_message(m) for m in turn], tools=Tools.of([WEATHER]).for_template())
    args = json.loads(call["function"]["arguments"])
    assert f"<parameter=city>\n{args['city']}\n</parameter>" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and "get_weather" in text
    (answer,) = llm.chat(turn, SamplingParams(temperature=0.0, max_tokens=8), tools=[WEATHER],
                         use_progress=False)
    assert answer.prompt_token_ids == tuple(engine.tokenizer.encode(
        text, add_special_tokens=False))


PSALM = {"type": "function", "function": {"name": "sing_psalm", "parameters": {
    "type": "object", "required": ["number"], "properties": {
        "number": {"type": "integer", "minimum": 1, "maximum": 150}}}}}
SING = {"type": "function", "function": {"name": "sing_psalm"}}
PSALM_CALL = ("<tool_call>\n<function=sing_psalm>\n<parameter=number>\n23\n</parameter>\n"
              "</function>\n</tool_call>")


@pytest.mark.parametrize(("choice", "parallel", "calls"), [
    (SING, None, 1), ("required", False, 1), ("required", None, MAX_PARALLEL_CALLS)])
def test_forced_grammars_end_after_the_calls_they_allow(engine: Engine, choice: object,
                                                        parallel: bool | None,
                                                        calls: int) -> None:
    """After the last call a forced grammar allows (one for a named function, as OpenAI
    gives, or without parallel calls; ``MAX_PARALLEL_CALLS`` for ``required``) only EOS can
    follow; before it, another call may."""
    tok, vocab = engine.tokenizer, engine.model.config.vocab_size
    eos = tuple(tok.eos_token_ids)
    spec = constraint(None, Tools.of([WEATHER, PSALM], choice, parallel), thinking=False)
    m = Grammars(tok, vocab, eos).matcher(spec)
    for i in range(calls):
        assert m.consume_tokens(tok.encode(("\n\n" if i else "") + PSALM_CALL,
                                           add_special_tokens=False))
        allowed = unpack_bitmask(allowed_tokens([m], vocab, eos), vocab)[0]
        others = [t for t in allowed.nonzero().flatten().tolist() if t not in eos]
        assert bool(others) == (i + 1 < calls), (i, [tok.decode([t]) for t in others])


def test_named_and_required_calls_end_as_openai_ends_them(engine: Engine) -> None:
    """The built-in model calls again and again where it may: a named function is called
    once, ``required`` at most ``MAX_PARALLEL_CALLS`` times, and both end with
    ``tool_calls``, never at ``max_tokens``."""
    llm, greedy = LLM(engine=engine), SamplingParams(temperature=0.0, max_tokens=1200)
    (named,) = llm.chat(ASK, greedy, tools=[WEATHER, PSALM], tool_choice=SING,
                        use_progress=False)
    assert named.finish_reason == "tool_calls" and named.outputs[0].message["content"] is None
    assert [c["function"]["name"] for c in named.outputs[0].message["tool_calls"]] == ["sing_psalm"]
    (req,) = llm.chat(ASK, greedy, tools=[WEATHER, PSALM], tool_choice="required",
                      use_progress=False)
    assert req.finish_reason == "tool_calls" and req.outputs[0].message["content"] is None
    assert 1 <= len(req.outputs[0].message["tool_calls"]) <= MAX_PARALLEL_CALLS
    assert req.outputs[0].text.endswith("</tool_call>")


def test_a_call_cut_by_max_tokens_keeps_its_partial_arguments(engine: Engine) -> None:
    """``max_tokens`` anywhere in a forced answer: ``length``, no markup in ``content``, each
    call's arguments a prefix of the uncut call's (as OpenAI returns a cut call)."""
    llm = LLM(engine=engine)
    kw = {"tools": [WEATHER, PSALM], "tool_choice": "required", "use_progress": False}
    (full,) = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=1200), **kw)
    want = [(c["function"]["name"], c["function"]["arguments"])
            for c in full.outputs[0].message["tool_calls"]]
    first = len(engine.tokenizer.encode(full.outputs[0].text[:full.outputs[0].text.index(
        "</tool_call>")], add_special_tokens=False))  # about the first call's tokens
    partial = 0
    for n in range(1, first + 24, 3):
        (cut,) = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=n), **kw)
        msg = cut.outputs[0].message
        assert cut.finish_reason == "length" and not msg["content"], msg
        for call, (name, args) in zip(msg.get("tool_calls", []), want, strict=False):
            assert call["function"]["name"] == name
            assert args.startswith(call["function"]["arguments"]), (call, args)
            partial += call["function"]["arguments"] not in ("", args)
    assert partial  # some cut fell inside the arguments, and they were kept


def test_grammars_apply_after_the_reasoning(engine: Engine) -> None:
    """Every token is allowed inside the reasoning, only JSON after ``</think>``."""
    tok, vocab = engine.tokenizer, engine.model.config.vocab_size
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"]})
    m = Grammars(tok, vocab).matcher(constraint(spec, None, thinking=True))
    # every token of text (not the special ones, nor a byte that cannot begin a character)
    text = [t for t in range(vocab) if tok.decode([t]) and "\ufffd" not in tok.decode([t])]
    for t in tok.encode("{not json} at all", add_special_tokens=False):
        free = unpack_bitmask(allowed_tokens([m], vocab), vocab)[0]
        assert bool(free[text].all())  # free text, any text token
        assert m.consume_token(t)
    assert m.consume_tokens(tok.encode("</think>\n\n", add_special_tokens=False))
    allowed = unpack_bitmask(allowed_tokens([m], vocab), vocab)[0]
    assert allowed.sum() < vocab // 8  # JSON now: '{' and the tokens that begin it
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed.nonzero().flatten()
               .tolist())
    assert thinking("<|im_start|>assistant\n<think>\n")
    assert not thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen35_template_reasoning_and_enable_thinking(engine: Engine) -> None:
    """The built-in model under the Qwen3.5 template: with thinking on (the template opens
    ``<think>``) the model never closes it, so its whole answer is reasoning; with
    ``enable_thinking`` false the answer is content, and a JSON schema holds from its start."""
    tok = engine.tokenizer
    own = tok.chat_template
    tok.chat_template = QWEN35_CHAT_TEMPLATE.read_text()
    try:
        llm, greedy = LLM(engine=engine), SamplingParams(temperature=0.0, max_tokens=24)
        (opened,) = llm.chat(ASK, greedy, use_progress=False)
        assert opened.outputs[0].message["content"] is None and opened.finish_reason == "length"
        assert opened.outputs[0].message["reasoning_content"] == opened.outputs[0].text.strip()
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
        (closed,) = llm.chat(ASK, SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                                 structured_outputs={"json": schema}),
                             chat_template_kwargs={"enable_thinking": False},
                             use_progress=False)
        assert "reasoning_content" not in closed.outputs[0].message
        assert closed.finish_reason == "stop"
        jsonschema.validate(json.loads(closed.outputs[0].message["content"]), schema)
    finally:
        tok.chat_template = own


@pytest.mark.parametrize(("tools", "choice", "field"), [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}], None,
     "tools[0].function.parameters.properties.s.pattern"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}], None,
     "tools[0].function.parameters.required"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "extra": 1}}], None,
     "tools[0].function.extra"),
])
def test_bad_tools_are_refused_by_field(tools: list | None, choice: object, field: str) -> None:
    with pytest.raises(ContractViolation) as info:
        Tools.of(tools, choice)
    assert info.value.where == field


def test_bad_chat_combinations_are_refused_by_field(engine: Engine) -> None:
    with pytest.raises(ContractViolation) as info:
        constraint(StructuredOutputs(json_object=True), Tools.of([WEATHER], "required"), False)
    assert info.value.where == "tool_choice"
    with pytest.raises(ContractViolation) as info:
        template_message({"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
            "messages[2]")
    assert info.value.where == "messages[2].tool_calls[0].function.arguments"
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}
    with pytest.raises(InvalidRequest, match="strnig"):
        LLM(engine=engine).chat(ASK, SamplingParams(max_tokens=4), tools=[bad],
                                tool_choice="required", use_progress=False)
    assert not engine.has_unfinished_requests()
