"""One generation request through the engine: its sampling parameters, one engine request per
choice (``n``, or ``best_of`` candidates: ``SamplingParams.sequences``), then the wait for every
choice or the stream of their chunks. A client that disconnects, streaming or not, aborts its
requests at once (a task waits on the connection's disconnect event). A request whose computation
fails fails alone: 500 with its error when not streaming; when streaming, a last chunk with
``finish_reason: "error"`` and an error object after it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.sample.structured import StructuredOutputs, check
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.core import Closing, EngineRefusal, Refused
from pagedhybrid.serve.protocol import ApiError
from pagedhybrid.serve.responses import Choice, Job, Responses, sse
from pagedhybrid.serve.state import ServerState

MAX_CHOICES = 2048  # prompts x (best_of or n) of one request


def sampling_params(state: ServerState, body: Any, job: Job, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """The request's parameters (its ``n`` / ``best_of``: ``sequences()`` gives each choice's
    engine request); a value the engine refuses -> 400."""
    max_tokens, spec = job.max_tokens, job.structured
    if body.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", "min_tokens")
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed, n=body.n, best_of=getattr(body, "best_of", None),
            max_tokens=max_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
            stop=body.stop_strings(), include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if body.repetition_penalty is None
                                else body.repetition_penalty),
            logit_bias=body.logit_bias_ids(), bad_words=tuple(body.bad_words or ()),
            structured_outputs=spec)
        params.check_vocab(state.vocab_size)
    except ContractViolation as exc:
        raise ApiError(400, f"{exc.where} {exc.rule}", exc.where) from None
    return params


def check_grammar(spec: StructuredOutputs, source: str) -> None:
    """A grammar llguidance refuses is a 400 naming the client's field, before the engine sees
    the request (llguidance's check needs no tokenizer; the engine compiles the grammar)."""
    try:
        check(spec)
    except ContractViolation as exc:
        raise ApiError(400, f"{source} {exc.rule}", source) from None


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the ASGI server reports ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def _wait_all(request: Request, state: ServerState, sink: asyncio.Queue[Any],
                    choices: dict[str, Choice]) -> None:
    """Collect outputs until every choice is done; a client disconnect raises ``ClientGone``."""
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while not all(c.done for c in choices.values()):
            get = asyncio.ensure_future(sink.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ClientGone
            _apply(state, get.result(), choices)
    finally:
        gone.cancel()


def _refusal(item: EngineRefusal) -> ApiError:
    exc = item.error
    if isinstance(exc, Closing):
        return _unavailable(str(exc))
    if isinstance(exc, Refused):  # the core named the field
        return ApiError(400, str(exc), exc.what)
    return ApiError(500, f"internal error while admitting the request: {exc}", None,
                    "internal_error", "server_error")


def _apply(state: ServerState, item: Any, choices: dict[str, Choice]
           ) -> tuple[Choice, str] | None:
    """Apply one engine item to its choice: (choice, new safe text), or None for an output of a
    choice that is already done (a stop string ended it; its abort output is stale)."""
    if isinstance(item, EngineRefusal):
        raise _refusal(item)
    c = choices[item.request_id]
    if c.done:
        return None
    try:
        delta, stopped = c.update(item)
    except Exception as exc:  # detokenisation of this choice failed: it fails alone
        c.error, c.finish_reason, delta, stopped = (
            f"detokenisation failed: {type(exc).__name__}: {exc}", "error", "", False)
    if stopped or (c.done and not item.finished):
        state.core.abort(c.request_id)
    now = time.perf_counter()
    m = state.metrics
    if item.new_token_ids:
        if c.last_token_time is None:
            m.ttft.labels(model_name=m.model_name).observe(now - c.arrival)
        else:
            m.itl.labels(model_name=m.model_name).observe(
                (now - c.last_token_time) / max(1, len(item.new_token_ids)))
        c.last_token_time = now
    if c.done:
        m.e2e.labels(model_name=m.model_name).observe(now - c.arrival)
    return c, delta


def _unavailable(why: str) -> ApiError:
    return ApiError(503, why, None, "service_unavailable", "server_error")


def _error_chunk(state: ServerState, c: Choice) -> ApiError:
    if state.core.closing is not None and c.error == state.core.closing:
        return _unavailable(f"choice {c.index} was cut short: {c.error}")
    return ApiError(500, f"the computation of choice {c.index} failed: {c.error}", None,
                    "computation_failed", "server_error")


async def generate(state: ServerState, request: Request, body: Any, job: Job
                   ) -> Response:
    """Submit one engine request per choice, then wait for them all or stream their chunks."""
    sink: asyncio.Queue[Any] = asyncio.Queue()
    out = await _submit(state, body, job, sink)
    choices = out.choices

    def cleanup() -> None:
        for c in choices.values():
            if not c.done:
                state.core.abort(c.request_id)

    if body.stream:
        return StreamingResponse(_events(state, out, sink, body.stream_options, cleanup),
                                 media_type="text/event-stream")
    try:
        await _wait_all(request, state, sink, choices)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening
    finally:
        cleanup()
    failed = [c for c in choices.values() if c.error]
    if failed:
        raise _error_chunk(state, failed[0])
    return JSONResponse(out.final_response(out.pick(body.n)))


async def _submit(state: ServerState, body: Any, job: Job, sink: asyncio.Queue[Any]
                  ) -> Responses:
    """Check the request against the server's limits and submit its choices' engine requests
    (their outputs arrive on ``sink``); the ``Responses`` that will shape the answer."""
    n = body.n
    best_of = getattr(body, "best_of", None) or n
    if len(job.prompts) * best_of > MAX_CHOICES:
        raise ApiError(400, f"prompts x {'best_of' if best_of > n else 'n'} = "
                       f"{len(job.prompts) * best_of} exceeds {MAX_CHOICES} choices",
                       "best_of" if best_of > n else "n")
    prompt_k = [k for k in (body.prompt_logprobs,
                            job.logprobs if job.echo_logprobs else None) if k is not None]
    if job.structured is not None:  # llguidance's check, off the event loop
        await asyncio.to_thread(check_grammar, job.structured, job.structured_field)
    params = sampling_params(state, body, job, job.logprobs,
                             max(prompt_k) if prompt_k else None).sequences()
    if state.core.closing is not None:
        raise _unavailable(state.core.closing)
    if state.max_waiting is not None and \
            state.core.num_waiting() + len(job.prompts) * best_of > state.max_waiting:
        raise ApiError(503, f"the server has {state.max_waiting} requests waiting; retry "
                       "later", None, "server_overloaded", "server_error")
    rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
    choices: dict[str, Choice] = {}
    for p_i, ids in enumerate(job.prompts):
        for i in range(best_of):
            sub = f"{rid}-{p_i}-{i}"
            choices[sub] = Choice(p_i * best_of + i, sub, state.tokenizer, job.echo_only,
                                  parser=job.parser())
            state.core.submit(sub, ids, params[i], sink)
    opts = body.stream_options
    return Responses(rid, state.model_name, state.tokenizer, job, choices, best_of,
                     body.prompt_logprobs, bool(opts and opts.continuous_usage_stats))


async def _events(state: ServerState, out: Responses, sink: asyncio.Queue[Any], opts: Any,
                  cleanup: Callable[[], None]) -> AsyncIterator[str]:
    """The streamed answer: each choice's chunks as its outputs come, an error chunk (and the
    error) for a failed choice, usage when asked, ``[DONE]``; ``cleanup`` aborts what is left."""
    job, choices = out.job, out.choices
    try:
        if job.chat:
            for c in sorted(choices.values(), key=lambda c: c.index):
                yield out.chunk(out.entry(c.index, "", None, None, role=True))
        while not all(c.done for c in choices.values()):
            try:
                applied = _apply(state, await sink.get(), choices)
            except ApiError as exc:
                yield sse(exc.body())
                break
            if applied is None:
                continue
            c, delta = applied
            if not job.chat and job.echo_texts and not c.echoed:
                c.echoed = True
                yield out.chunk(out.entry(c.index, *out.echo_part(c), None))
            if c.error:
                yield out.chunk(out.entry(c.index, "", None, "error"))
                yield sse(_error_chunk(state, c).body())
                break
            entry = out.stream_entry(c, delta)
            if entry is not None:
                yield out.chunk(entry)
        else:  # every choice done, none failed
            if opts and opts.include_usage:
                yield out.chunk(usage=True)
        yield "data: [DONE]\n\n"
    finally:
        cleanup()
