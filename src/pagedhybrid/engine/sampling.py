"""Sampling parameters and the batched sampler.

``SamplingParams`` follows vLLM's names: ``temperature`` (0 = greedy), ``top_k`` (0 or -1 =
off), ``top_p`` (1 = off), ``seed`` (per-request generator), ``max_tokens``, ``stop_token_ids``,
``ignore_eos``, ``min_tokens`` (EOS and stop ids cannot be sampled before that many tokens),
``logprobs`` (k: the top-k log-probabilities of the model distribution at each
generated token, plus the sampled token's own, like vLLM's default raw logprobs) and
``prompt_logprobs`` (k: the same for every prompt token after the first, given the tokens before
it -- what perplexity is computed from).

Algorithm of ``sample`` on fp32 logits ``[B, V]`` (one row per request that samples this step):

1. greedy rows (temperature 0): ``argmax`` of the raw logits.
2. random rows: ``l = logits / T``; sort descending; top-k masks sorted positions ``>= k``;
   top-p keeps the shortest prefix whose mass reaches ``p`` (always at least one token);
   ``softmax`` of the masked sorted logits, scattered back to vocabulary order.
3. each random row draws its own exponential noise ``q ~ Exp(1)^V`` from its own generator
   (the request's seeded ``torch.Generator``, or the engine's shared one) and picks
   ``argmax(probs / q)`` (the exponential-race form of categorical sampling). A request draws
   exactly V numbers per generated token from its own generator, so a seeded request samples the
   same tokens whatever else is in the batch (given the same logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedhybrid.errors import ContractViolation


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (vLLM spelling)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist

    def __post_init__(self) -> None:
        def bad(field: str, rule: str, got: object) -> ContractViolation:
            return ContractViolation("SamplingParams", field, rule, got)

        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)", self.temperature)
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must lie in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an int >= -1 (0 or -1 = off)", self.top_k)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an int in [0, max_tokens]", self.min_tokens)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an int or None", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise bad(name, "must be None or an int >= 0", k)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


class Logprob(NamedTuple):
    """Log-probability of one token under the model distribution and its rank (1 = best)."""

    logprob: float
    rank: int


class SampledToken(NamedTuple):
    """One sampled token; ``logprobs`` maps token id -> Logprob (top-k plus the sampled one)."""

    token_id: int
    logprobs: dict[int, Logprob] | None


def _filtered_probs(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k and top-p applied row-wise; returns probabilities in vocab order."""
    vocab = logits.shape[1]
    scaled = logits / temps[:, None]  # [R, V]
    sorted_l, order = scaled.sort(dim=-1, descending=True)  # [R, V], [R, V]
    pos = torch.arange(vocab)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_l = sorted_l.masked_fill(pos >= k[:, None], float("-inf"))
    probs_sorted = sorted_l.softmax(dim=-1)  # [R, V]
    # Keep a token when the mass strictly before it is below p (the first token always stays).
    before = probs_sorted.cumsum(dim=-1) - probs_sorted  # [R, V]
    sorted_l = sorted_l.masked_fill(before >= top_p[:, None], float("-inf"))
    probs_sorted = sorted_l.softmax(dim=-1)  # [R, V]
    return torch.empty_like(probs_sorted).scatter_(1, order, probs_sorted)  # [R, V]


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
           generators: Sequence[torch.Generator]) -> list[SampledToken]:
    """Pick one token per row of ``logits`` ``[B, V]`` (see the module docstring)."""
    rows = logits.shape[0]
    if len(params) != rows or len(generators) != rows:
        raise ContractViolation("sample", "params/generators", "need one per logits row",
                                (rows, len(params), len(generators)))
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()  # greedy choice for every row first
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        sel = [params[i] for i in random_rows]
        probs = _filtered_probs(
            logits[idx],
            torch.tensor([p.temperature for p in sel], dtype=torch.float32),
            torch.tensor([p.top_k for p in sel], dtype=torch.int64),
            torch.tensor([p.top_p for p in sel], dtype=torch.float32),
        )  # [R, V]
        vocab = logits.shape[1]
        for j, i in enumerate(random_rows):
            noise = torch.empty(vocab, dtype=torch.float32).exponential_(generator=generators[i])
            tokens[i] = int((probs[j] / noise).argmax())
    out = []
    for i, p in enumerate(params):
        lps = (logprob_dicts(logits[i:i + 1], [tokens[i]], p.logprobs)[0]
               if p.logprobs is not None else None)
        out.append(SampledToken(int(tokens[i]), lps))
    return out
