"""Chat turns in the Qwen3.5 format: tools, reasoning, and the grammars that force calls.

The Qwen3.5 chat format (``models/qwen35/chat_template.jinja``; vLLM's ``qwen3`` reasoning parser
and ``qwen3_coder`` tool parser read the same text) writes reasoning as
``<think>\\n...\\n</think>\\n\\n`` before the answer, and a function call as XML::

    <tool_call>
    <function=NAME>
    <parameter=ARGUMENT>
    VALUE
    </parameter>
    </function>
    </tool_call>

where a ``string`` argument's VALUE is its raw text and any other argument's VALUE is JSON.

* ``Tools.of(tools, tool_choice, parallel_tool_calls)`` -- OpenAI's ``tools`` list (function
  definitions, ``parameters`` an object schema of named properties) and ``tool_choice``
  (``none`` | ``auto`` | ``required`` | a named function), checked field by field
  (``ContractViolation`` naming the field: ``tools[1].function.parameters``, ``tool_choice``).
* ``thinking(prompt)`` -- whether the rendered prompt leaves a ``<think>`` open (the Qwen3.5
  template opens it in the generation prompt unless ``enable_thinking`` is false, when it writes
  an empty, closed one): the answer then starts inside the reasoning.
* ``constraint(structured, tools, thinking)`` -- the grammar of the answer: the structured
  output's (``StructuredOutputs.lark_body``) or, for ``tool_choice`` ``required`` or a named
  function, the tool calls' (every argument of the function's schema, required ones always,
  values valid for their property schema, arguments in schema order); when the prompt opened
  ``<think>``, free reasoning up to ``</think>`` comes first: grammars apply after the
  reasoning ends. The grammar ends the answer after its last allowed call
  (``Tools.max_calls``: one for a named function, as OpenAI and vLLM give, and for
  ``parallel_tool_calls`` false; at most ``MAX_PARALLEL_CALLS`` for ``required``, each
  followed by the model's choice of EOS or another call): nothing can follow it, so the engine
  ends the request (``grammar_end``, ``stop``, which the parser reports as ``tool_calls``).
* ``template_message(message)`` -- an OpenAI message as chat templates read it (tool calls'
  ``arguments`` parsed). Answers are split back into OpenAI's message by ``chat_parser``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedhybrid.engine.sample.structured import JSON_LAYOUT, StructuredOutputs
from pagedhybrid.errors import ContractViolation

OP = "chat"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_RE = re.compile(r"<function=([^>\n]*)>\n")
PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>\n(.*?)\n</parameter>\n", re.S)
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
# string arguments are raw text in the call; these keywords would need a regex over it
TEXT_KEYWORDS = ("pattern", "format")
MAX_TEXT = 1 << 16  # the longest minLength / maxLength a string argument may ask for
# the most calls ``required`` forces in one answer (parallel calls): a model that calls again
# and again (the built-in one does) still ends with ``tool_calls``, not at ``max_tokens``
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: Mapping[str, Any]  # an object schema ({"type": "object"} when none was given)
    description: str | None = None

    def properties(self) -> dict[str, Mapping[str, Any]]:
        return dict(self.parameters.get("properties") or {})

    def is_text(self, argument: str) -> bool:
        """Whether ``argument`` is written as raw text (a ``string`` property)."""
        return self.properties().get(argument, {}).get("type") == "string"

    def value(self, argument: str, raw: str) -> Any:
        """An argument's value from its text in the call: raw text for a ``string``
        property, else JSON (the raw text when it does not parse, as vLLM's parser does)."""
        return raw if self.is_text(argument) else json_or_text(raw)


@dataclass(frozen=True)
class Tools:
    """A request's tools and ``tool_choice`` (module docstring)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # none | auto | required | the name of one function
    parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[Any] | None, tool_choice: Any = None,
           parallel_tool_calls: bool | None = None) -> Tools | None:
        """OpenAI's fields checked (``ContractViolation`` naming the field); ``None`` when
        there are no tools."""
        choice = _choice(tool_choice)
        if not tools:
            if tools is not None and not isinstance(tools, Sequence):
                raise ContractViolation(OP, "tools", "must be a list of function tools", tools)
            if choice not in ("none", "auto"):
                raise ContractViolation(OP, "tool_choice", f"{choice!r} needs tools")
            return None
        parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
        names = [t.name for t in parsed]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ContractViolation(OP, f"tools[{i}].function.name",
                                        "names a function twice", name)
        if choice not in CHOICES and choice not in names:
            raise ContractViolation(OP, "tool_choice", f"names no function of tools "
                                    f"({names})", choice)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ContractViolation(OP, "parallel_tool_calls", "must be a bool",
                                    parallel_tool_calls)
        return cls(parsed, choice, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def parsed(self) -> bool:
        """Whether the answer's tool calls are parsed (not for ``tool_choice`` ``none``)."""
        return self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The functions a grammar makes the model call (none unless ``required`` or named)."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    @property
    def max_calls(self) -> int:
        """The most calls a forced answer makes: one for a named function or without
        ``parallel_tool_calls``, else ``MAX_PARALLEL_CALLS``."""
        return MAX_PARALLEL_CALLS if self.parallel and self.choice == "required" else 1

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def for_template(self) -> list[dict[str, Any]]:
        """The tools as the chat template reads them (OpenAI's shape)."""
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = dict(t.parameters)
            out.append({"type": "function", "function": fn})
        return out


def _choice(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise ContractViolation(OP, "tool_choice", f"must be one of {list(CHOICES)} or "
                                    "{'type': 'function', 'function': {'name': ...}}", value)
        return value
    fn = value.get("function") if isinstance(value, Mapping) else None
    if not (isinstance(value, Mapping) and value.get("type") == "function"
            and isinstance(fn, Mapping) and isinstance(fn.get("name"), str)
            and set(value) <= {"type", "function"}):
        raise ContractViolation(OP, "tool_choice", "must be one of "
                                f"{list(CHOICES)} or {{'type': 'function', 'function': "
                                "{'name': ...}}", value)
    return str(fn["name"])


def _tool(item: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, Mapping) or item.get("type") != "function":
        raise ContractViolation(OP, f"{where}.type", "must be 'function' (the only tool "
                                "type)", item.get("type") if isinstance(item, Mapping) else item)
    extra = sorted(set(item) - {"type", "function"})
    if extra:
        raise ContractViolation(OP, f"{where}.{extra[0]}", "is not a field of a function tool")
    fn = item.get("function")
    if not isinstance(fn, Mapping):
        raise ContractViolation(OP, f"{where}.function", "must be an object with a name")
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise ContractViolation(OP, f"{where}.function.{extra[0]}", "is not a field of a "
                                "function (name, description, parameters, strict)")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ContractViolation(OP, f"{where}.function.name", "must be 1-64 letters, digits, "
                                "'_', '.' or '-'", name)
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ContractViolation(OP, f"{where}.function.description", "must be a string", desc)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(params, f"{where}.function.parameters")
    return Tool(name, params, desc)


def _check_parameters(params: Any, where: str) -> None:
    """``parameters`` must be an object schema whose arguments the XML format can write."""
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ContractViolation(OP, where, "must be a JSON schema of type 'object' (the "
                                "function's named arguments)", params)
    props = params.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping)
                                                 for v in props.values()):
        raise ContractViolation(OP, f"{where}.properties", "must map argument names to "
                                "schemas", props)
    for name, schema in props.items():
        if not NAME_RE.match(name):
            raise ContractViolation(OP, f"{where}.properties", "argument names must be 1-64 "
                                    "letters, digits, '_', '.' or '-'", name)
        if schema.get("type") == "string":
            bad = [k for k in TEXT_KEYWORDS if k in schema]
            if bad:
                raise ContractViolation(OP, f"{where}.properties.{name}.{bad[0]}",
                                        "is not supported on a string argument (Qwen3.5 "
                                        "writes string arguments as raw text; use enum or "
                                        "minLength / maxLength)")
            for key in ("minLength", "maxLength"):
                n = schema.get(key, 0)
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TEXT:
                    raise ContractViolation(OP, f"{where}.properties.{name}.{key}",
                                            f"must be an integer in [0, {MAX_TEXT}]", n)
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in props
                                                 for r in required):
        raise ContractViolation(OP, f"{where}.required", "must list names of properties",
                                required)
    if params.get("additionalProperties") not in (None, False):
        raise ContractViolation(OP, f"{where}.additionalProperties", "must be false or "
                                "absent: a forced call writes only the declared arguments")


def template_message(message: Mapping[str, Any], where: str = "messages") -> dict[str, Any]:
    """An OpenAI chat message as chat templates read it: each tool call's ``arguments`` (JSON
    text in OpenAI's messages) parsed into a mapping, as the Qwen3.5 template writes them one
    argument at a time (``ContractViolation`` naming the call when it is not an object)."""
    out = dict(message)
    calls = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ContractViolation(OP, f"{where}.tool_calls[{j}].function", "must name the "
                                    "function called", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ContractViolation(OP, f"{where}.tool_calls[{j}].function.arguments",
                                        f"must be the JSON text of an object ({exc})") from None
        if not isinstance(args, Mapping):
            raise ContractViolation(OP, f"{where}.tool_calls[{j}].function.arguments",
                                    "must be a JSON object", args)
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": dict(args)}})
    if calls:
        out["tool_calls"] = calls
    return out


def thinking(prompt: str) -> bool:
    """Whether ``prompt`` ends inside an opened ``<think>`` (the answer starts reasoning)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# -- grammars -----------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)


def _value_rule(tool: Tool, name: str, schema: Mapping[str, Any], rule: str) -> list[str]:
    """Rule ``rule``: argument ``name``'s value and the line that closes it."""
    end = "\n</parameter>\n"
    if not tool.is_text(name):
        sub = dict(schema)
        for key in ("$defs", "definitions"):  # references inside a property resolve at the root
            if key in tool.parameters:
                sub[key] = tool.parameters[key]
        sub["x-guidance"] = JSON_LAYOUT
        return [f"{rule}: %json {json.dumps(sub)} {_lit(end)}"]
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return [f"{rule}: " + " | ".join(_lit(f"{v}{end}") for v in values)]
    low, high = schema.get("minLength", 0), schema.get("maxLength", "")
    return [f"{rule}[suffix={_lit(end)}]: /(?s:.{{{low},{high}}})/"]


def _tool_rules(tools: Tools) -> list[str]:
    """Lark rules ``calls`` of the forced functions (module docstring)."""
    rules, fns = [], []
    for i, tool in enumerate(tools.forced):
        required = set(tool.parameters.get("required", ()))
        parts = []
        for j, (name, schema) in enumerate(tool.properties().items()):
            rule = f"f{i}_a{j}"
            rules.append(f"{rule}: {_lit(f'<parameter={name}>' + chr(10))} {rule}_v")
            rules += _value_rule(tool, name, schema, f"{rule}_v")
            parts.append(rule if name in required else f"{rule}?")
        rules.append(f"f{i}: {_lit(f'<function={tool.name}>' + chr(10))} {' '.join(parts)} "
                     f"{_lit('</function>' + chr(10))}")
        fns.append(f"f{i}")
    rules.append(f"call: {_lit(CALL_OPEN + chr(10))} ({' | '.join(fns)}) {_lit(CALL_CLOSE)}")
    more = tools.max_calls - 1
    rules.append(f'calls: call ("\\n\\n" call){{0,{more}}}' if more else "calls: call")
    return rules


def constraint(structured: StructuredOutputs | None, tools: Tools | None,
               thinking: bool) -> StructuredOutputs | None:
    """The answer's grammar (module docstring); ``None`` when nothing constrains it."""
    if tools is not None and tools.parsed and tools.forced:
        if structured is not None:
            raise ContractViolation(OP, "tool_choice", f"{tools.choice!r} forces a tool call; "
                                    "it cannot be combined with a structured output")
        rules, body = _tool_rules(tools), "calls"
    elif structured is None or not thinking:
        return structured
    else:
        rules, body = [], structured.lark_body()
    if thinking:
        rules.append(f'reasoning[suffix={_lit(THINK_CLOSE)}]: /(?s:.*)/')
        body = f'reasoning "\\n\\n" {body}'
    return StructuredOutputs(grammar="\n".join([f"start: {body}", *rules]))


def json_or_text(raw: str) -> Any:
    """``raw`` parsed as JSON, or ``raw`` itself when it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw
