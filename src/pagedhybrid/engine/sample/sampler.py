"""Sampling parameters and the batched sampler.

``SamplingParams`` follows vLLM's names: ``temperature`` (0 = greedy), ``top_k`` (0 or -1 =
off), ``top_p`` (1 = off), ``min_p`` (0 = off), ``seed`` (per-request generator, int64),
``max_tokens``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` (EOS and stop ids cannot be
sampled before that many tokens), ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, over
the generated tokens), ``repetition_penalty`` (over prompt and generated tokens, as HF/vLLM),
``logit_bias`` (token id -> bias added to its logit), ``bad_words`` (strings whose token
sequences may not be completed; resolved to token ids by the engine's tokenizer, vLLM's rule),
``logprobs`` (k: the top-k log-probabilities of the model distribution at each generated token,
plus the sampled token's own, like vLLM's default raw logprobs) and ``prompt_logprobs`` (k: the
same for every prompt token after the first, given the tokens before it).

Algorithm of ``sample`` on fp32 logits ``[B, V]`` (one row per request that samples this step);
every stage is a tensor operation over the rows that use it, row-wise, so a row's result does
not depend on the other rows (batch-invariant), in vLLM v1's order:

1. logit processors on a copy of the raw logits: ``logit_bias`` added, banned ids (``min_tokens``
   not reached: EOS and stop ids; the last token of a bad word whose prefix was just generated)
   set to ``-inf``;
2. penalties: ``repetition_penalty`` r divides positive / multiplies non-positive logits of the
   tokens seen in the prompt or the output; then ``l -= frequency * count_out + presence *
   [count_out > 0]``;
3. greedy rows (temperature 0): ``argmax`` of the processed logits (of the raw ones, when no
   processor applies, in the same pass that checks every raw logit is finite:
   ``kernels.native.sampling.greedy_rows``; a row that is not comes back as None);
4. random rows, in one working copy of their logits (the step's only ``[rows, V]`` fp32 copy:
   every later stage works in place on it): ``softmax(l / T)``; ``min_p`` zeroes tokens whose
   probability is below ``min_p`` times the best one; top-k zeroes tokens below the k-th largest
   probability; top-p zeroes tokens after the shortest prefix (by descending probability) whose
   mass reaches ``p`` (always at least one token), the prefix found from ``topk`` of a growing
   width (1024, x4, ...; the whole row only for a flat distribution), never a sort of the row;
5. each random row draws one uniform ``u`` (float64) from its own generator (the request's
   seeded ``torch.Generator``, or the engine's shared one) and takes the token where the row's
   cumulative probability first exceeds ``u`` times its total (``draw``: inverse-CDF sampling
   in float64; past ``DRAW_DIRECT`` tokens in two levels -- sums of blocks of ``DRAW_BLOCK``
   tokens, then the one block's tokens -- so no ``[rows, V]`` buffer beyond the working copy;
   no renormalisation needed). A
   request draws exactly one number per generated token from its own generator, so a seeded
   request samples the same tokens whatever else is in the batch (given the same logits).
   (The exponential race it replaces drew V numbers a token: 91 us a row at V = 4096 and
   ~5 ms at Qwen3.5's 248k on one EPYC core -- a fifth of the built-in model's batch-1 step.)

Logprobs are always those of the raw model distribution (before processors and penalties).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from pagedhybrid.engine.sample.structured import StructuredOutputs
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native.sampling import apply_token_bitmask_, greedy_rows

INT64 = (-(2 ** 63), 2 ** 63 - 1)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's range for presence / frequency penalties


def wrap_seed(seed: int) -> int:
    """``seed`` folded into int64 (the ``n`` choices of one request use ``seed + i``)."""
    return (seed - INT64[0]) % 2 ** 64 + INT64[0]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (vLLM spelling)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()
    bad_words: tuple[str, ...] = ()
    # grammar-constrained decoding (engine/sample/structured.py): a StructuredOutputs or its mapping
    structured_outputs: StructuredOutputs | Mapping[str, Any] | None = None
    # vLLM's output options: ``n`` sequences returned per prompt, the best ``n`` of
    # ``best_of`` (by cumulative logprob; the sequences of a request -- ``LLM`` and the server
    # run one engine request each, ``sequences``); ``stop`` strings end a sequence when its
    # text contains one (matched by the engine on the detokenised text, not shown unless
    # ``include_stop_str_in_output``); ``detokenize`` False: token ids only (no text, no stop
    # strings); ``skip_special_tokens``: special tokens out of the text
    n: int = 1
    best_of: int | None = None
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, rule: str, got: object) -> ContractViolation:
            return ContractViolation("SamplingParams", field, rule, got)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def finite(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not (finite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)", self.temperature)
        if not (finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must lie in (0, 1]", self.top_p)
        if not (finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must lie in [0, 1]", self.min_p)
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT64[1]:
            raise bad("top_k", "must be an int >= -1 (0 or -1 = off)", self.top_k)
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64[1]:
            raise bad("max_tokens", "must be an int >= 1", self.max_tokens)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an int in [0, max_tokens]", self.min_tokens)
        if self.seed is not None and (not is_int(self.seed)
                                      or not INT64[0] <= self.seed <= INT64[1]):
            raise bad("seed", f"must be None or an int in [{INT64[0]}, {INT64[1]}] (int64)",
                      self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or k < 0):
                raise bad(name, "must be None or an int >= 0", k)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (finite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise bad(name, f"must lie in [-{MAX_PENALTY}, {MAX_PENALTY}]", v)
        if not (finite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)",
                      self.repetition_penalty)
        ids = tuple(self.stop_token_ids)
        if not all(is_int(t) for t in ids):
            raise bad("stop_token_ids", "must be ints", ids)
        object.__setattr__(self, "stop_token_ids", ids)
        bias = self.logit_bias
        pairs = tuple(sorted(bias.items() if isinstance(bias, Mapping) else bias))
        for t, b in pairs:
            if not is_int(t) or not (finite(b) and abs(b) <= MAX_LOGIT_BIAS):
                raise bad("logit_bias", f"must map int token ids to numbers in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", (t, b))
        if len({t for t, _ in pairs}) != len(pairs):
            raise bad("logit_bias", "has a token id twice", pairs)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))
        words = tuple(self.bad_words)
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise bad("bad_words", "must be non-blank strings", words)
        object.__setattr__(self, "bad_words", words)
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputs.of(self.structured_outputs))
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1", self.n)
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be None or an int >= n = {self.n}", self.best_of)
        stop = (() if self.stop is None else (self.stop,) if isinstance(self.stop, str)
                else tuple(self.stop))
        if not all(isinstance(w, str) and w for w in stop):
            raise bad("stop", "must be a non-empty string or a list of them", stop)
        object.__setattr__(self, "stop", stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool", getattr(self, name))
        if stop and not self.detokenize:
            raise bad("stop", "stop strings need detokenize=True (they match the text)", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences generated for one prompt: ``best_of`` (or ``n``)."""
        return self.best_of or self.n

    def sequences(self) -> list[SamplingParams]:
        """One engine request's parameters per sequence: ``n = 1``, sequence i seeded with
        ``seed + i`` (int64-wrapped) when seeded; ranking ``best_of`` needs each sampled token's
        logprob, so it is asked for (``logprobs=0``) when the caller asked for none."""
        k = self.num_sequences
        logprobs = 0 if k > self.n and self.logprobs is None else self.logprobs
        return [dataclasses.replace(
            self, n=1, best_of=None, logprobs=logprobs,
            seed=None if self.seed is None else wrap_seed(self.seed + i)) for i in range(k)]

    @property
    def masks_after_pick(self) -> bool:
        """A grammar's mask may come after this row's pick: greedy, its masked pick is the
        unmasked one whenever the grammar allows that; a draw from the whole distribution (no
        top-k, top-p or min-p, whose cut a mask would move) that the grammar refuses, drawn
        again under the mask, takes each allowed token with its masked odds (rejection
        sampling: p(t) + (1 - Z) p(t) / Z = p(t) / Z, Z the allowed mass)."""
        return self.greedy or (self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0.0)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab: int) -> None:
        """The token ids this request names must exist: ``ContractViolation`` naming the field."""
        def bad(field: str, got: object) -> ContractViolation:
            return ContractViolation("SamplingParams", field,
                                     f"token ids must lie in [0, {vocab})", got)

        outside = [t for t in self.stop_token_ids if not 0 <= t < vocab]
        if outside:
            raise bad("stop_token_ids", outside[:5])
        outside = [t for t, _ in self.logit_bias if not 0 <= t < vocab]
        if outside:
            raise bad("logit_bias", outside[:5])
        if self.top_k > vocab:
            raise ContractViolation("SamplingParams", "top_k",
                                    f"must be -1, 0 (off) or in [1, {vocab}] (the vocabulary)",
                                    self.top_k)


GREEDY = SamplingParams(temperature=0.0)


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]
                        ) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as written and, when that tokenises to another first token of the
    same length, with a leading space (the word in mid-sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def bad_word_bans(sequences: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """Ids that would complete one of ``sequences`` after ``output`` (single tokens always)."""
    bans = []
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (len(output) >= k and tuple(output[len(output) - k:]) == seq[:-1]):
            bans.append(seq[-1])
    return bans


class Logprob(NamedTuple):
    """Log-probability of one token under the model distribution and its rank (1 = best)."""

    logprob: float
    rank: int


class SampledToken(NamedTuple):
    """One sampled token; ``logprobs`` maps token id -> Logprob (top-k plus the sampled one);
    ``grammar_end``: the request's grammar is complete with this token (structured outputs)."""

    token_id: int
    logprobs: dict[int, Logprob] | None
    grammar_end: bool = False


class TokenHistory(Protocol):
    """What the penalties read of a request."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


def _counts(seqs: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """``[R, V]`` float32 occurrence counts of each row's token ids."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32)
    if width == 0:
        return counts
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)  # [R, L], padding -> id 0, weight 0
    ones = torch.zeros(len(seqs), width, dtype=torch.float32)  # [R, L]
    for r, s in enumerate(seqs):
        if s:
            ids[r, :len(s)] = torch.as_tensor(list(s), dtype=torch.int64)
            ones[r, :len(s)] = 1.0
    return counts.scatter_add_(1, ids, ones)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    history: Sequence[TokenHistory]) -> torch.Tensor:
    """vLLM's penalties on ``logits [R, V]`` (in place for the rows that use them)."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    vocab = logits.shape[1]
    idx = torch.tensor(rows, dtype=torch.int64)
    sub = logits[idx]  # [P, V]
    out_counts = _counts([history[r].output_token_ids for r in rows], vocab)  # [P, V]
    rep = torch.tensor([params[r].repetition_penalty for r in rows])[:, None]  # [P, 1]
    if bool((rep != 1.0).any()):
        seen = (_counts([history[r].prompt_token_ids for r in rows], vocab) > 0) | (
            out_counts > 0)  # [P, V]
        factor = torch.where(seen, rep, torch.ones_like(rep))  # [P, V]
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    freq = torch.tensor([params[r].frequency_penalty for r in rows])[:, None]  # [P, 1]
    pres = torch.tensor([params[r].presence_penalty for r in rows])[:, None]  # [P, 1]
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits[idx] = sub
    return logits


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   history: Sequence[TokenHistory] | None = None,
                   banned: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Stages 1-2 of the module docstring on fp32 ``logits [R, V]``; returns ``logits`` itself
    when no row uses any of them, else a processed copy."""
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    bans = [(r, t) for r, ids in enumerate(banned or ()) for t in ids]
    penalized = history is not None and any(p.penalized for p in params)
    if not (bias or bans or penalized):
        return logits
    out = logits.clone()
    if bias:
        rr, tt, bb = zip(*bias, strict=True)
        out.index_put_((torch.tensor(rr), torch.tensor(tt)), torch.tensor(bb), accumulate=True)
    if bans:
        rr, tt = zip(*bans, strict=True)
        out[torch.tensor(rr), torch.tensor(tt)] = float("-inf")
    if penalized:
        assert history is not None
        apply_penalties(out, params, history)
    return out


TOP_P_WIDTH = 1024  # the first topk width searched for the top-p prefix


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: per row of normalised ``probs [R, V]``, the smallest probability of the
    shortest descending prefix whose mass reaches ``top_p`` (0 for rows with ``top_p >= 1``);
    the prefix comes from ``topk`` widths 1024, 4096, ... (the row whole only when needed)."""
    vocab = probs.shape[1]
    off = top_p >= 1.0  # [R]
    width = min(TOP_P_WIDTH, vocab)
    while True:
        top = probs.topk(width, dim=1).values  # [R, W] descending
        before = top.cumsum(dim=1) - top  # mass strictly before each position
        count = (before < top_p[:, None]).sum(dim=1)  # [R] >= 1: the prefix length
        if width == vocab or bool(((count < width) | off).all()):
            floor = top.gather(1, (count - 1).clamp(min=0)[:, None])  # [R, 1]
            return floor.masked_fill_(off[:, None], 0.0)
        width = min(4 * width, vocab)


def _filtered_probs(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None, min_p: torch.Tensor | None = None, *,
                    inplace: bool = False) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p applied row-wise (None: no row filters that way);
    probabilities in vocab order. Works in one copy of ``logits`` (in ``logits`` itself with
    ``inplace``)."""
    vocab = logits.shape[1]
    t = temps[:, None].to(logits.dtype)
    probs = logits.div_(t) if inplace else logits / t  # [R, V]: the one working copy
    probs.sub_(probs.amax(dim=1, keepdim=True)).exp_()
    probs.div_(probs.sum(dim=1, keepdim=True))  # softmax(l / T), in place
    filtered = False
    if min_p is not None and bool((min_p > 0).any()):
        probs.masked_fill_(probs < probs.amax(dim=1, keepdim=True) * min_p[:, None], 0.0)
        filtered = True
    limited = None if top_k is None else (top_k > 0) & (top_k < vocab)  # [R]
    if top_k is not None and limited is not None and bool(limited.any()):
        widest = int(top_k[limited].max())
        kth = probs.topk(widest, dim=1).values.gather(
            1, (top_k.clamp(1, widest) - 1)[:, None])  # [R, 1]: the k-th largest
        probs.masked_fill_(probs < kth.masked_fill_(~limited[:, None], 0.0), 0.0)
        filtered = True
    if top_p is not None and bool((top_p < 1.0).any()):
        if filtered:
            probs.div_(probs.sum(dim=1, keepdim=True))
        probs.masked_fill_(probs < _top_p_floor(probs, top_p), 0.0)
        filtered = True
    return probs.div_(probs.sum(dim=1, keepdim=True)) if filtered else probs


def params_probs(logits: torch.Tensor, params: Sequence[SamplingParams], *,
                 inplace: bool = False) -> torch.Tensor:
    """``_filtered_probs`` of ``logits [R, V]`` with each row's own ``params`` (temperature,
    top-k, top-p, min-p)."""
    vocab = logits.shape[1]  # (a filter no row uses is not built: a step's ops are dear)
    return _filtered_probs(
        logits, torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64)
        if any(0 < p.top_k < vocab for p in params) else None,
        torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if any(p.top_p < 1.0 for p in params) else None,
        torch.tensor([p.min_p for p in params], dtype=torch.float32)
        if any(p.min_p > 0 for p in params) else None, inplace=inplace)


DRAW_BLOCK = 1024  # tokens per block of draw's first level
DRAW_DIRECT = 32768  # vocabularies up to this size are drawn in one level


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """``[R]`` int64: a token per row of ``probs [R, V]`` (non-negative, a positive sum; need
    not be normalised) with exactly those odds, from one float64 uniform of the row's own
    generator (module docstring, step 5; the path depends on V alone, never on the batch).
    Never a zero-probability token."""
    rows, vocab = probs.shape
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    if vocab <= DRAW_DIRECT:  # one level: the rows' whole CDF (R x V float64: small)
        cdf = probs.double().cumsum_(dim=1)
        return _first_past(probs, cdf, u * cdf[:, -1])[:, 0]
    full, tail = divmod(vocab, DRAW_BLOCK)
    sums = torch.empty(rows, full + (tail > 0), dtype=torch.float64)  # [R, blocks]
    for r in range(rows if full else 0):  # (a row at a time: the sum widens its input first)
        sums[r, :full] = probs[r, :full * DRAW_BLOCK].view(full, DRAW_BLOCK).sum(
            dim=1, dtype=torch.float64)
    if tail:
        sums[:, full] = probs[:, full * DRAW_BLOCK:].sum(dim=1, dtype=torch.float64)
    cdf = sums.cumsum(dim=1)
    target = u * cdf[:, -1]  # [R], in [0, total)
    block = _first_past(sums, cdf, target)  # [R, 1]
    rest = target - (cdf.gather(1, block) - sums.gather(1, block))[:, 0]  # into that block
    at = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK)  # [R, B]: the block's token ids
    inside = probs.gather(1, at.clamp(max=vocab - 1)).masked_fill_(at >= vocab, 0.0)
    return at.gather(1, _first_past(inside, inside.double().cumsum_(dim=1), rest))[:, 0]


def _first_past(weights: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: per row, the first column whose cumulative weight ``cdf`` exceeds ``target``
    -- where a rounding puts ``target`` past the row's mass, its last column with any weight
    (never a column of weight 0)."""
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=weights.shape[1] - 1)
    for r in (weights.gather(1, pick)[:, 0] <= 0).nonzero().flatten().tolist():
        pick[r, 0] = int(weights[r].nonzero().max())
    return pick


def logprob_dicts(logits: torch.Tensor, tokens: Sequence[int], k: int
                  ) -> list[dict[int, Logprob]]:
    """Per row of fp32 ``logits [R, V]``: the top-``k`` tokens and ``tokens[r]`` with their
    log-probabilities under the raw distribution and ranks (1 = most likely)."""
    lp = logits.float().log_softmax(dim=-1)  # [R, V]
    target = torch.tensor(list(tokens), dtype=torch.int64)  # [R]
    mine = lp.gather(1, target[:, None])  # [R, 1]
    ranks = ((lp > mine).sum(dim=1) + 1).tolist()  # [R]
    top_v, top_i = lp.topk(min(k, lp.shape[1]), dim=1) if k > 0 else (None, None)
    out = []
    for r, (tok, val) in enumerate(zip(target.tolist(), mine[:, 0].tolist(), strict=True)):
        d: dict[int, Logprob] = {}
        if top_v is not None and top_i is not None:
            d = {int(i): Logprob(float(v), j + 1)
                 for j, (v, i) in enumerate(zip(top_v[r].tolist(), top_i[r].tolist(),
                                                strict=True))}
        d.setdefault(tok, Logprob(float(val), int(ranks[r])))
        out.append(d)
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator], history: Sequence[TokenHistory] | None = None,
           banned: Sequence[Sequence[int]] | None = None,
           allowed: torch.Tensor | None = None) -> list[SampledToken | None]:
    """Pick one token per row of ``logits`` ``[B, V]`` (see the module docstring); None for a
    row whose raw logits hold a NaN or an infinity (its request fails alone), or whose mask
    allows no token.
    ``history`` (one per row) feeds the penalties, ``banned`` (one list per row) the ids that
    may not be sampled now, ``allowed`` (the packed int32 ``[B, ceil(V / 32)]`` mask of
    ``structured.allowed_tokens``) the only ids that may. Logprobs are the raw
    distribution's."""
    rows = logits.shape[0]
    if len(params) != rows or len(generators) != rows or (
            history is not None and len(history) != rows) or (
            banned is not None and len(banned) != rows):
        raise ContractViolation("sample", "params/generators/history/banned",
                                "need one per logits row", (rows, len(params), len(generators)))
    if history is None and any(p.penalized for p in params):
        raise ContractViolation("sample", "history", "is needed by penalized rows", None)
    raw = logits.float()  # [B, V] (the logits themselves when they are fp32)
    proc = process_logits(raw, params, history, banned)  # [B, V] (a copy only if processed)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    # [B]: the argmax (over the allowed tokens where a mask comes and nothing else is done to
    # the logits), -1 for a row with a non-finite logit or no allowed token
    picked = greedy_rows(raw, allowed if proc is raw and not random_rows else None)
    if allowed is not None and (proc is not raw or random_rows):
        proc = apply_token_bitmask_(raw.clone() if proc is raw else proc, allowed)
    tokens = picked if proc is raw else proc.argmax(dim=-1)  # [B] greedy choice first
    if random_rows:
        every = len(random_rows) == rows
        idx = torch.tensor(random_rows)
        probs = params_probs(proc if every else proc[idx], [params[i] for i in random_rows],
                             inplace=not every or proc is not raw)  # [R, V]: never the caller's
        if tokens is picked:
            tokens = picked.clone()
        tokens[idx] = draw(probs, [generators[i] for i in random_rows])
    if tokens is not picked:  # a row with non-finite raw logits is refused however it sampled
        tokens = tokens.masked_fill_(picked < 0, -1)
    ids = tokens.tolist()  # the step's one host copy of the tokens
    out: list[SampledToken | None] = []
    for i, p in enumerate(params):
        if ids[i] < 0:
            out.append(None)
            continue
        lps = (logprob_dicts(raw[i:i + 1], [ids[i]], p.logprobs)[0]
               if p.logprobs is not None else None)
        out.append(SampledToken(ids[i], lps))
    return out
