"""Chat answers in the Qwen3.5 format (``engine/chat.py``) and ``LLM.chat``.

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

from pagedhybrid.engine import LLM, Engine, SamplingParams, load_engine
from pagedhybrid.engine.chat import Tools, constraint, template_message, thinking
from pagedhybrid.engine.chat_parser import ChatParser
from pagedhybrid.engine.request import InvalidRequest
from pagedhybrid.engine.structured import Grammars, StructuredOutputs, allowed_tokens
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native.sampling import unpack_bitmask
from pagedhybrid.models.qwen35.synthetic import QWEN35_CHAT_TEMPLATE

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
    ("no think", False, TOOLS, "And God said <tool", {"content": "And God said <tool"}),
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
    ("unfinished call", False, TOOLS, CALL[:CALL.index("<parameter=days>")] + "<parameter=da",
     {"content": None, "tool_calls": [{"name": "get_weather",
                                       "arguments": '{"city": "Paris"}'}]}),
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
    assert out.finish_reason == "tool_calls", out.output.text
    assert out.message["content"] is None and len(out.message["tool_calls"]) == 1
    for call in out.message["tool_calls"]:
        fn = call["function"]
        assert fn["name"] in (("act",) if named else ("act", "get_weather"))
        schema = params if fn["name"] == "act" else WEATHER["function"]["parameters"]
        jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_one_call_when_parallel_calls_are_off_and_tool_results_render(engine: Engine) -> None:
    llm = LLM(engine=engine)
    (out,) = llm.chat(ASK, SamplingParams(temperature=1.0, seed=3, max_tokens=120),
                      tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                      use_progress=False)
    assert out.finish_reason == "tool_calls" and len(out.message["tool_calls"]) == 1
    assert out.output.text.endswith("</tool_call>")  # the grammar allows one call, then EOS
    call = out.message["tool_calls"][0]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    text = engine.tokenizer.apply_chat_template(
        [template_message(m) for m in turn], tools=Tools.of([WEATHER]).for_template())
    args = json.loads(call["function"]["arguments"])
    assert f"<parameter=city>\n{args['city']}\n</parameter>" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and "get_weather" in text
    (answer,) = llm.chat(turn, SamplingParams(temperature=0.0, max_tokens=8), tools=[WEATHER],
                         use_progress=False)
    assert answer.output.prompt_token_ids == tuple(engine.tokenizer.encode(
        text, add_special_tokens=False))


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
        assert opened.message["content"] is None and opened.finish_reason == "length"
        assert opened.message["reasoning_content"] == opened.output.text.strip()
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
        (closed,) = llm.chat(ASK, SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                                 structured_outputs={"json": schema}),
                             chat_template_kwargs={"enable_thinking": False},
                             use_progress=False)
        assert "reasoning_content" not in closed.message and closed.finish_reason == "stop"
        jsonschema.validate(json.loads(closed.message["content"]), schema)
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
