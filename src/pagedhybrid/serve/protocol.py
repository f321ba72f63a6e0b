"""OpenAI request bodies (pydantic, one typed model per endpoint) and the OpenAI error object.

``CompletionRequest`` (``POST /v1/completions``) and ``ChatCompletionRequest``
(``POST /v1/chat/completions``) take OpenAI's fields plus vLLM's extras in the body. Every field
is typed (strictly: a value of another JSON type is refused, not converted) and range-checked
here (integers in their ranges, int64 seeds, floats finite, text valid Unicode); what needs the
model (token ids inside the vocabulary, ``top_k`` up to the vocabulary, prompt + ``max_tokens``
within ``max_model_len``) is checked by the handler against it. A field
is either implemented or refused: unknown fields, and known OpenAI fields this server does not
implement (``suffix``), are a 400 naming the field. ``tools`` / ``tool_choice`` and tool
messages follow ``serve/chat/format.py``. ``response_format``
(``json_object`` / ``json_schema``) and vLLM's ``structured_outputs`` / ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` constrain the output by a grammar
(``engine/sample/structured.py``); one of them per request. ``ApiError`` is every refusal: an HTTP
status and OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from pagedhybrid.engine.sample.sampler import INT64, MAX_LOGIT_BIAS, MAX_PENALTY
from pagedhybrid.engine.sample.structured import StructuredOutputs
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.chat.format import Tools, template_message

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; also logprobs / prompt_logprobs here
MAX_N = 128  # OpenAI's limit for n (and best_of here)
# every request model: unknown fields refused, and values of their JSON type only (no "0.5" for a
# number, no 0 / "true" for a boolean: what the OpenAPI document's types say)
STRICT = ConfigDict(extra="forbid", strict=True)


class Error(BaseModel):
    """OpenAI's error object (what ``param`` names: the request field at fault, ``body`` for the
    body as a whole, or null)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every refusal (``ApiError``): ``{"error": Error}``."""

    error: Error


class Health(BaseModel):
    """``GET /health``: ``ok`` (200), or ``degraded`` / ``error`` (503: the engine process is
    degraded or gone)."""

    status: Literal["ok", "degraded", "error"]


class ApiError(Exception):
    """A refusal with OpenAI's error body (``ErrorResponse``)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=Error(message=self.message, type=self.kind, param=self.param,
                                         code=self.code)).model_dump()


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text (a lone surrogate at character "
                         f"{exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(strict=True, ge=INT64[0], le=INT64[1])]
Count = Annotated[int, Field(strict=True, ge=0, le=INT64[1])]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64[1])]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_PENALTY, le=MAX_PENALTY)]
LogprobCount = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag", "grammar", "regex"]


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = STRICT

    model: Text
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[Text, Annotated[float, Field(allow_inf_nan=False, ge=-MAX_LOGIT_BIAS,
                                                  le=MAX_LOGIT_BIAS)]] | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT64[1])] | None = None
    min_p: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False, gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[NonEmptyText] | None = None
    prompt_logprobs: LogprobCount | None = None
    structured_outputs: dict[Text, Any] | None = None
    guided_json: dict[Text, Any] | Text | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None

    @model_validator(mode="after")
    def _shared_rules(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true",
                           "stream_options")
        if self.response_format is not None and self.response_format.type not in (
                "text", "json_object", "json_schema"):
            raise ApiError(400, f"response_format type {self.response_format.type!r} is not "
                           "supported; use 'text', 'json_object' or 'json_schema' (or the "
                           "structured_outputs / guided_* extras)", "response_format")
        return self

    def structured(self) -> tuple[StructuredOutputs | None, str]:
        """The request's grammar (``engine/sample/structured.py``) and the field it came from:
        ``response_format`` (``json_object``; ``json_schema``'s ``schema``, ``strict`` or
        not: the output always follows it), vLLM's ``structured_outputs`` or one ``guided_*``
        extra. More than one of them is a 400 naming the second."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            js = (rf.model_extra or {}).get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema "
                               "object", "response_format")
            found.append(("response_format", {"json": js["schema"]}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        if not found:
            return None, ""
        if len(found) > 1:
            raise ApiError(400, f"{found[1][0]} cannot be combined with {found[0][0]}: give one "
                           "grammar", found[1][0])
        name, value = found[0]
        try:
            return StructuredOutputs.of(value), name
        except ContractViolation as exc:
            raise ApiError(400, f"{name}: '{exc.where}' {exc.rule}", name) from None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with its keys (token ids written as strings) as ints."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise ApiError(400, "logit_bias keys must be token ids (integers written as "
                               "strings)", "logit_bias") from None
            if not 0 <= tid <= INT64[1]:
                raise ApiError(400, "logit_bias keys must be token ids >= 0", "logit_bias")
            out[tid] = value
        return out


Prompt = (NonEmptyText | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[NonEmptyText], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Count | None = 16
    logprobs: LogprobCount | None = None
    echo: bool = False
    best_of: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    suffix: Text | None = None
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's BOS etc. on text prompts

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.suffix:
            raise ApiError(400, "suffix is not supported: this model has no fill-in-the-middle "
                           "mode", "suffix")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ApiError(400, "best_of must be >= n", "best_of")
            if self.stream and self.best_of > self.n:
                raise ApiError(400, "best_of > n cannot be streamed", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: the prompt's "
                           "logprobs alone)", "max_tokens")
        return self

    def prompts(self) -> tuple[list[str], list[list[int]] | None]:
        """(texts, token-id prompts): texts when the prompt is text, else the id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p], None
        if isinstance(p[0], str):
            return list(p), None  # type: ignore[arg-type]
        if isinstance(p[0], list):
            return [], [list(x) for x in p]  # type: ignore[union-attr]
        return [], [list(p)]  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = STRICT

    name: Text
    arguments: Text  # the JSON text of an object


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the API returned it."""

    model_config = STRICT

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # ``_roles`` in the OpenAPI document too (what a client or a fuzzer builds from it)
    model_config = ConfigDict(**STRICT, json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
         "else": {"properties": {"tool_call_id": {"type": "null"}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "else": {"properties": {"tool_calls": {"type": "null"},
                                 "reasoning_content": {"type": "null"}}}}]})

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None  # vLLM: an earlier turn's reasoning

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ApiError(400, "a tool message needs the tool_call_id it answers", "messages")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ApiError(400, "tool_call_id belongs to tool messages", "messages")
        if self.role != "assistant" and (self.tool_calls is not None
                                         or self.reasoning_content is not None):
            raise ApiError(400, "tool_calls and reasoning_content belong to assistant "
                           "messages", "messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self, where: str) -> dict[str, Any]:
        """The message as chat templates read it (``chat.template_message``)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        try:
            return template_message(msg, where)
        except ContractViolation as exc:
            raise ApiError(400, f"{exc.where} {exc.rule}", exc.where) from None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=INT64[1])] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=INT64[1])] | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM extra
    # vLLM extras: the template writes its own special tokens, so none are added by default;
    # chat_template_kwargs reach the template (e.g. {"enable_thinking": false})
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        check_template_kwargs(self.chat_template_kwargs)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        self.tool_spec()
        return self

    def tool_spec(self) -> Tools | None:
        return tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)


def tool_spec(tools: list[dict[str, Any]] | None, choice: Any = None,
              parallel: bool | None = None) -> Tools | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked (``chat.Tools``)."""
    try:
        return Tools.of(tools, choice, parallel)
    except ContractViolation as exc:
        raise ApiError(400, f"{exc.where} {exc.rule}", exc.where) from None


TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` may not replace what the server itself gives the template."""
    taken = sorted(set(kwargs or ()) & set(TEMPLATE_VARIABLES))
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}: use the "
                       "request's own fields", "chat_template_kwargs")


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered by the template."""

    model_config = STRICT

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered with the messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", "prompt")
        if self.tools is not None and self.messages is None:
            raise ApiError(400, "tools are rendered with messages", "tools")
        check_template_kwargs(self.chat_template_kwargs)
        self.tool_spec()
        return self

    def tool_spec(self) -> Tools | None:
        return tool_spec(self.tools)

    def special_tokens(self) -> bool:
        return self.messages is None if self.add_special_tokens is None \
            else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: Text | None = None
    tokens: list[TokenId]
