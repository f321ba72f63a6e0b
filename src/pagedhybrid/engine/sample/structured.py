"""Structured outputs: grammar-constrained decoding with llguidance (vLLM's ``structured_outputs``).

* ``StructuredOutputs`` -- vLLM's field names, exactly one set: ``json`` (a JSON schema: a dict
  or its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (a list of
  strings) or ``grammar`` (a Lark grammar in llguidance's dialect). ``lark_body()`` is the spec
  as the body of a Lark rule (``%json {...}``, a regex, alternatives, ``%lark {...}``: what
  ``chat.constraint`` composes after a reasoning prefix) and ``grammar_text()`` the llguidance
  grammar of it; JSON is laid out compactly (``JSON_LAYOUT``); schema keywords llguidance does
  not implement are refused (not ignored).
* ``Grammars(tokenizer, vocab_size)`` -- llguidance's view of the engine's tokenizer (a
  ``tokenizer.json`` through the ``tokenizers`` library, or the 256-byte tokenizer of the test
  checkpoints; word-shaped token slices, ``WORD_SLICES``, beside its own) and
  ``matcher(spec)``: a new matcher of the spec's grammar, each distinct grammar compiled once
  (a request deep-copies the compiled matcher). A grammar llguidance refuses -- a malformed
  schema, an unsupported keyword, a regex that does not compile, a Lark error -- raises
  ``ContractViolation`` with llguidance's message (the engine and the server name their own
  field).
* ``check(spec)`` -- llguidance's check of a grammar, no tokenizer needed (front ends: the server,
  ``LLM``); ``GrammarCompiler`` -- the engine's: grammars compiled on a thread of their own (the
  request waits in the queue until its matcher is ready, never the batch; a grammar that does
  not compile fails its request alone).
* ``allowed_tokens(matchers, vocab, eos, rows, at)`` -- each matcher fills its row of one int32
  bitmask ``[S, ceil(V / 32)]`` (llguidance's layout), which the sampler reads packed
  (``sampling.sample(allowed=)``: the greedy pick over the allowed tokens, or ``-inf`` over
  the refused ones, in one native pass). ``consume`` advances a matcher by the sampled token;
  ``try_consume`` advances it by a token picked without the mask where the grammar allows that
  token (``step_sampling.sample_requests`` masks a row whose mask may come after its pick only
  when its grammar refuses the pick: ``SamplingParams.masks_after_pick``).

Why llguidance: it is what onnxruntime-genai 0.18 constrains with; its wheel depends on nothing
(xgrammar 0.2.9 requires torch, transformers and triton), and its masks are computed lazily per
step from the current lexer state (no per-grammar precompilation of the vocabulary), which keeps
compilation of a schema in the order of a millisecond on this CPU.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedhybrid.errors import ContractViolation, from_mapping
from pagedhybrid.kernels.native.sampling import unpack_bitmask

OP = "StructuredOutputs"
# JSON is written compactly, one space after "," and ":" (xgrammar's any_whitespace=False
# layout): free whitespace lets a weak model wander in blanks until max_tokens
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_NICE = 19  # the grammar thread's nice value, where SCHED_IDLE is refused
# Token slices llguidance adds in bulk where the lexer allows all of them (its own are JSON
# string pieces): the word shapes of a BPE vocabulary -- lower-case and capitalised, with and
# without the leading space -- and digit runs. A regex or Lark class over letters then costs a
# bit-or per slice instead of a walk of those tokens (batch 16 of `[a-z ]{300}`: 0.51 -> 0.22 ms a
# step, `[A-Za-z0-9 ,.]{300}` 0.59 -> 0.22 ms, JSON unchanged). Longer bounds ({1,12}) are not
# taken by llguidance's subsumption check and gain nothing.
WORD_SLICES = ("[a-z]{1,8}", "[ ][a-z]{1,8}", "[A-Z][a-z]{0,8}", "[ ][A-Z][a-z]{0,8}",
               "[0-9]{1,4}")


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's ``structured_outputs`` (module docstring)."""

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ContractViolation(OP, "structured_outputs",
                                    f"must set exactly one of {list(KINDS)}", set_)
        if self.json is not None and not isinstance(self.json, Mapping | str):
            raise ContractViolation(OP, "json", "must be a JSON schema (an object or its text)",
                                    type(self.json).__name__)
        if not isinstance(self.json_object, bool):
            raise ContractViolation(OP, "json_object", "must be a bool", self.json_object)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ContractViolation(OP, name, "must be a non-empty string", v)
        if self.choice is not None:
            ok = (isinstance(self.choice, list | tuple) and self.choice
                  and all(isinstance(c, str) and c for c in self.choice))
            if not ok:
                raise ContractViolation(OP, "choice", "must be a non-empty list of non-empty "
                                        "strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def of(cls, value: StructuredOutputs | Mapping[str, Any] | None
           ) -> StructuredOutputs | None:
        """``value`` as a spec: a mapping's unknown keys are refused by name."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, Mapping):
            raise ContractViolation(OP, "structured_outputs", "must be a mapping or None",
                                    type(value).__name__)
        return from_mapping(cls, value, OP)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def lark_body(self) -> str:
        """The spec as the body of a rule of llguidance's Lark dialect (``chat.constraint``
        puts it after the reasoning)."""
        import llguidance

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ContractViolation(OP, "json", f"is not JSON text ({exc})") from None
            if not isinstance(schema, Mapping):
                raise ContractViolation(OP, "json", "must be a JSON schema object",
                                        type(schema).__name__)
            return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})
        if self.regex is not None:
            return f"/{llguidance.regex_to_lark(self.regex)}/"
        if self.choice is not None:
            return " | ".join(json.dumps(c) for c in self.choice)
        assert self.grammar is not None
        return "%lark {\n" + self.grammar + "\n}"

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON grammar format) of the spec."""
        import llguidance

        if self.grammar is not None:  # a whole Lark grammar as given
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {self.lark_body()}")


class Grammars:
    """llguidance's tokenizer of the engine's tokenizer and the compiled grammars (module
    docstring)."""

    MAX_CACHED = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos: Sequence[int] = ()) -> None:
        import llguidance

        eos = tuple(eos) or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        backend = getattr(tokenizer, "_tok", None)  # TokenizersTokenizer's tokenizers object
        if backend is not None:
            self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                    eos_token=eos[0] if eos else None)
        else:  # the byte tokenizer: 256 byte tokens, then its specials
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
                _ByteView(eos, tokenizer.bos_token_id, vocab_size)), n_vocab=vocab_size)
        self.tokenizer = self.tokenizer.with_slices(
            list(WORD_SLICES) + llguidance.LLTokenizer.general_slices())
        self.vocab_size = vocab_size
        self._compiled: dict[str, Any] = {}

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher of ``spec``'s grammar (``ContractViolation`` naming
        ``structured_outputs`` when llguidance refuses it)."""
        import llguidance

        text = _grammar_text(spec)
        base = self._compiled.get(text)
        if base is None:
            base = llguidance.LLMatcher(self.tokenizer, text)
            if base.is_error():
                raise ContractViolation(OP, "structured_outputs", f"is not a usable "
                                        f"{spec.kind}: {base.get_error().strip()}")
            if len(self._compiled) >= self.MAX_CACHED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[text] = base
        return base.deep_copy()

    def cached(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher of ``spec``'s grammar if it is compiled already (and its text
        remembered), else None -- never compiling: any thread may ask."""
        base = self._compiled.get(_TEXTS.get(_spec_key(spec)))
        return None if base is None else base.deep_copy()


def check(spec: StructuredOutputs) -> None:
    """llguidance's check of ``spec``'s grammar, which needs no tokenizer (a millisecond or two
    per distinct grammar, remembered): ``ContractViolation`` naming ``structured_outputs``
    when it refuses it."""
    error = _grammar_error(_grammar_text(spec))
    if error:
        raise ContractViolation(OP, "structured_outputs",
                                f"is not a usable {spec.kind}: {error.strip()}")


_TEXTS: dict[tuple[str, str] | None, str] = {}  # grammar texts by _spec_key, the last 1024
_TEXTS_LOCK = threading.Lock()


def _spec_key(spec: StructuredOutputs) -> tuple[str, str] | None:
    """The spec as a key: its kind and its value's JSON (property order kept: it orders the
    output); None where the value is no JSON."""
    try:
        return spec.kind, json.dumps(getattr(spec, spec.kind), default=dict)
    except (TypeError, ValueError):
        return None


def _grammar_text(spec: StructuredOutputs) -> str:
    """``spec.grammar_text()``, remembered by ``_spec_key`` (a 32-property schema's text takes
    ~5 ms; the front end's ``check``, the compile thread and ``cached`` all ask for it); what
    llguidance's grammar builders raise on malformed input is a ``ContractViolation`` naming
    ``structured_outputs``."""
    key = _spec_key(spec)
    text = _TEXTS.get(key)
    if text is None:
        try:
            text = spec.grammar_text()
        except Exception as exc:
            raise ContractViolation(OP, "structured_outputs", f"is not a usable {spec.kind} "
                                    f"({type(exc).__name__}: {exc})") from None
        if key is not None:
            with _TEXTS_LOCK:
                if len(_TEXTS) >= 1024:
                    _TEXTS.pop(next(iter(_TEXTS)))
                _TEXTS[key] = text
    return text


@functools.lru_cache(maxsize=1024)
def _grammar_error(text: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(text))


class GrammarCompiler:
    """Grammars compiled on a thread of their own, off the engine's step: llguidance releases
    the GIL while it builds its view of the tokenizer (once; seconds for a 248K vocabulary) and
    each matcher (milliseconds, up to seconds for a large grammar), so the step loop keeps
    running; the thread runs under SCHED_IDLE (``GRAMMAR_NICE`` where that is refused), so on a
    busy machine a grammar waits for CPU rather than the step: beside 8 compiling requests the
    other requests' TTFT was 1.13x that of the same load unconstrained at nice 19 once OpenMP's
    workers stopped spinning away the idle cycles (``pagedhybrid.openmp``), 1.01x (p50) under
    SCHED_IDLE; at nice 10 it had cost ~12%.
    ``submit(spec)`` returns the future of the request's matcher, done at once for a grammar
    compiled already (raising
    ``ContractViolation`` when llguidance refuses the grammar: front ends ``check`` first, as
    vLLM's does, so that a client's mistake is refused before the engine sees it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: Sequence[int] = ()) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedhybrid-grammar",
                                        initializer=_background)
        self._grammars = self._pool.submit(Grammars, tokenizer, vocab_size, eos)

    def submit(self, spec: StructuredOutputs) -> Future[Any]:
        """The future of ``spec``'s matcher: done at once where the grammar is compiled
        already (no wait for the low-priority thread), else compiled on it."""
        ready = self._grammars.done() and self._grammars.exception() is None
        matcher = self._grammars.result().cached(spec) if ready else None
        if matcher is None:
            return self._pool.submit(lambda: self._grammars.result().matcher(spec))
        done: Future[Any] = Future()
        done.set_result(matcher)
        return done


def _background() -> None:
    """The calling thread yields the CPU to the step loop (Linux: SCHED_IDLE, else its own
    nice value)."""
    import contextlib
    import os

    with contextlib.suppress(AttributeError, OSError):  # elsewhere: an ordinary thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_NICE)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only


class _ByteView:
    """The byte tokenizer as llguidance's ``TokenizerWrapper`` reads a tokenizer."""

    def __init__(self, eos: Sequence[int], bos: int | None, vocab_size: int) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = bos
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<special_{i}>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def allowed_tokens(matchers: Sequence[Any], vocab: int, eos: Sequence[int] = (),
                   rows: int | None = None, at: Sequence[int] | None = None) -> torch.Tensor:
    """The packed mask int32 ``[rows, ceil(V / 32)]`` (``rows`` default: one per matcher;
    llguidance's layout: bit ``t % 32`` of word ``t // 32`` allows token ``t``): row ``at[i]``
    (default ``i``) the tokens ``matchers[i]`` allows now, every token in the other rows; where
    a matcher allows its EOS (``eos[0]``), the other EOS ids too; no bit past ``vocab`` is
    set. Each matcher fills its row on this thread (llguidance's batch call, on a pool thread
    of its own, cost 16 JSON masks 0.44 ms of a step against 0.15 ms, and slowed the next
    forward: its idle thread spins beside the step's); the sampler reads the mask packed
    (``kernels.native.sampling``)."""
    n = len(matchers) if rows is None else rows
    bits = np.full((n, (vocab + 31) // 32), -1, dtype=np.int32)
    for m, row in zip(matchers, range(len(matchers)) if at is None else at, strict=True):
        _fill(m, bits[row])
    return torch.from_numpy(_settled(bits, vocab, eos))


def draft_masks(matcher: Any, drafts: Sequence[int], vocab: int, eos: Sequence[int] = ()
                ) -> torch.Tensor:
    """bool ``[len(drafts) + 1, V]``: the tokens ``matcher`` allows at each row of a verify
    chunk -- now, then after each draft in turn (consumed tentatively and rolled back).
    Rows after a draft the grammar refuses, or after the grammar is complete, allow every
    token: verification never reaches them (a refused draft is rejected, and the kept tokens
    end where the grammar does)."""
    bits = np.full((len(drafts) + 1, (vocab + 31) // 32), -1, dtype=np.int32)
    taken = 0
    for row in range(len(drafts) + 1):
        if row:
            d = drafts[row - 1]
            if matcher.is_stopped() or matcher.try_consume_tokens(
                    [matcher_token(d, eos)]) != 1:
                break
            taken += 1
        _fill(matcher, bits[row])
    if taken:
        matcher.rollback(taken)
    return unpack_bitmask(torch.from_numpy(_settled(bits, vocab, eos)), vocab)


def _fill(matcher: Any, row: np.ndarray) -> None:
    row[:] = 0
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


def _settled(bits: np.ndarray, vocab: int, eos: Sequence[int]) -> np.ndarray:
    """``bits`` with the other EOS ids allowed where ``eos[0]`` is, and no bit past ``vocab``."""
    words = bits.view(np.uint32)
    if len(eos) > 1 and 0 <= eos[0] < vocab:
        first = (words[:, eos[0] // 32] >> np.uint32(eos[0] % 32)) & np.uint32(1)
        for t in eos[1:]:
            if 0 <= t < vocab:
                words[:, t // 32] |= first << np.uint32(t % 32)
    if vocab % 32:
        words[:, -1] &= np.uint32((1 << vocab % 32) - 1)
    return bits


def try_consume(matcher: Any, token: int, eos: Sequence[int]) -> bool:
    """Advance ``matcher`` by ``token`` if it allows it now (else nothing changes): a few
    microseconds where a mask costs tens (batch 16 of ``[a-z ]{300}``: 21 us a row)."""
    return matcher.try_consume_tokens([matcher_token(token, eos)]) == 1


def forced(matcher: Any) -> bool:
    """Whether the grammar forces its next bytes (a JSON key's spelling, say): there
    llguidance's mask allows only their canonical tokens ("te" of "text"), where
    ``try_consume`` accepts any token that spells them ("t"), so the mask must come first.
    Elsewhere the two agree token for token (every token of 28 states of six grammars
    checked); ~0.2 us."""
    return bool(matcher.compute_ff_bytes())


def matcher_token(token: int, eos: Sequence[int]) -> int:
    """``token`` as a matcher reads it: any EOS id is the matcher's own EOS (``eos[0]``)."""
    return eos[0] if eos and token in eos else token


def consume(matcher: Any, token: int, eos: Sequence[int]) -> bool:
    """Advance ``matcher`` by a sampled token."""
    return bool(matcher.consume_token(matcher_token(token, eos)))
