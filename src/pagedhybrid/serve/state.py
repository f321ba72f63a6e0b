"""The server's state and the checks every route makes: the API key (401), the model name
(404), a prompt against the model (empty, token ids outside the vocabulary, prompt + max_tokens
over max_model_len: 400)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedhybrid.serve.core import EngineClient
from pagedhybrid.serve.metrics import ServerMetrics
from pagedhybrid.serve.protocol import ApiError


@dataclass
class ServerState:
    core: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None
    max_waiting: int | None = None  # None: requests queue (vLLM's behaviour)
    root: str = ""  # the checkpoint folder (``/v1/models`` ``root``)
    created: int = field(default_factory=lambda: int(time.time()))


def check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {state.api_key}":
        raise ApiError(401, "Incorrect API key provided.", None, "invalid_api_key")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def check_prompt(state: ServerState, ids: list[int], max_tokens: int, param: str) -> None:
    if not ids:
        raise ApiError(400, f"{param} is empty", param)
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(400, f"{param} holds token ids outside the vocabulary "
                       f"[0, {state.vocab_size}): {bad[:5]}", param)
    if len(ids) + max_tokens > state.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} "
                       f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                       f"({len(ids)} in the prompt, {max_tokens} for the completion).",
                       "max_tokens", "context_length_exceeded")
