"""The step's sampler over requests (the runner's): ``sample_requests(rows, reqs, eos, stats)``
is ``sampling.sample`` with each request's bans and generator, structured outputs' masks and
the grammars advanced (``advance``); a request whose row fails fails alone.

A constrained row is masked by its grammar before it picks, or -- greedy, or a draw from the
whole distribution (``SamplingParams.masks_after_pick``) -- only after, where the grammar
refuses its pick (``structured.try_consume``), then picked again under the mask: the same
greedy token, or the same odds (rejection sampling) -- except where the grammar forces its next
bytes (``structured.forced``: the mask then allows only their canonical tokens, which
``try_consume`` does not know), where the mask comes first. A refused greedy row on its raw logits
first tries its next best tokens in order (``_next_best``: the masked argmax, without the
mask). The others' rows are never masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedhybrid.engine.core.request import Request
from pagedhybrid.engine.core.stats import EngineStats
from pagedhybrid.engine.sample.sampler import SampledToken, bad_word_bans, sample
from pagedhybrid.engine.sample.structured import allowed_tokens, consume, forced, try_consume
from pagedhybrid.kernels.native.sampling import top_rows


def sample_requests(rows: torch.Tensor, reqs: Sequence[Request], eos: Sequence[int],
                    stats: EngineStats) -> tuple[dict[str, list[SampledToken]],
                                                 list[tuple[Request, str]]]:
    """The step's tokens of ``reqs`` from their logits ``rows [S, V]`` (``eos``: the EOS ids in
    the vocabulary): a request whose logits are not all finite, or whose sampling raises, fails
    alone. A constrained request whose mask may come after its pick
    (``SamplingParams.masks_after_pick``) picks unmasked, and only a pick its grammar refuses
    is picked again under the grammar's mask (llama.cpp's order: the mask, tens of microseconds
    a row, is made only where it changes the pick); the others are masked before they pick.
    Every request's grammar is advanced by the token it keeps (``advance``)."""
    toks: list[SampledToken | str | None] = [None] * len(reqs)
    constrained = [j for j, r in enumerate(reqs) if r.matcher is not None]
    before = [j for j in constrained  # forced bytes: the mask is narrower than try_consume
              if not reqs[j].params.masks_after_pick or forced(reqs[j].matcher)]
    _pick(rows, reqs, range(len(reqs)), before, toks, eos)
    picked = [j for j in constrained if j not in before and isinstance(toks[j], SampledToken)]
    taken = {j for j in picked if try_consume(reqs[j].matcher, toks[j].token_id, eos)}
    # refused: a plain greedy row takes its next best the grammar allows, the others (and one
    # whose candidates all fail) are picked again under the mask
    refused = [j for j in picked if j not in taken]
    after = _next_best(rows, reqs, refused, toks, taken, eos)
    stats.next_best_picks += len(refused) - len(after)
    if after:
        _pick(rows, reqs, after, after, toks, eos)
    stats.constrained_rows += len(constrained)
    stats.grammar_masks += len(before) + len(after)
    sampled: dict[str, list[SampledToken]] = {}
    failed: list[tuple[Request, str]] = []
    for j, (r, t) in enumerate(zip(reqs, toks, strict=True)):
        kept = [t] if isinstance(t, SampledToken) else "non-finite logits" if t is None else t
        if r.matcher is not None and not isinstance(kept, str):
            kept = advance(r.matcher, kept, eos, int(j in taken))
        if isinstance(kept, str):
            failed.append((r, kept))
        else:
            sampled[r.request_id] = kept
    return sampled, failed


NEXT_BEST = 8  # a refused greedy row's candidates, its best logits


def _next_best(logits: torch.Tensor, reqs: Sequence[Request], refused: Sequence[int],
               toks: list[SampledToken | str | None], taken: set[int], eos: Sequence[int]
               ) -> list[int]:
    """The refused rows still to be picked under their masks. A greedy row on its raw logits
    (no bias, penalty, ban or logprobs) instead takes the first of its ``NEXT_BEST`` best
    tokens -- by logit, then by id (``top_rows``: the first of the order the masked argmax
    breaks ties in) -- that its grammar allows (``try_consume``, a few microseconds where the
    mask costs tens), into ``taken``: exactly the masked argmax. A row none of whose candidates
    is allowed takes the mask."""
    plain = [j for j in refused if _raw_greedy(reqs[j], eos)]
    rest = [j for j in refused if j not in plain]
    if not plain:
        return rest
    _, ids = top_rows(logits, plain, min(NEXT_BEST, logits.shape[1]))
    for j, ix in zip(plain, ids.tolist(), strict=True):
        first, matcher = toks[j].token_id, reqs[j].matcher  # type: ignore[union-attr]
        t = next((t for t in ix if t != first and try_consume(matcher, t, eos)), None)
        if t is None:
            rest.append(j)
        else:
            toks[j] = SampledToken(t, None)
            taken.add(j)
    return rest


def _raw_greedy(r: Request, eos: Sequence[int]) -> bool:
    """Whether ``r`` picks the argmax of its raw logits this step (greedy, no logit bias,
    penalty, ban or logprobs)."""
    p = r.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.penalized
            and not r.bad_word_ids and not _bans(r, eos))


def _bans(r: Request, eos: Sequence[int]) -> list[int]:
    """The ids ``r`` may not sample this step: its stop ids and EOS before ``min_tokens``, and
    the last tokens of its bad words that would complete one."""
    return (([*r.params.stop_token_ids, *(() if r.params.ignore_eos else eos)]
             if r.num_output_tokens < r.params.min_tokens else [])
            + (bad_word_bans(r.bad_word_ids, r.output_token_ids) if r.bad_word_ids else []))


def _pick(logits: torch.Tensor, reqs: Sequence[Request], which: Sequence[int],
          masked: Sequence[int], toks: list[SampledToken | str | None], eos: Sequence[int]
          ) -> None:
    """``toks[j]`` for the rows ``which`` of ``logits``: a token, None for non-finite logits,
    or why sampling failed; the rows ``masked`` (a subset) under their grammars' masks. On a
    raise the rows are sampled one by one from the generator states they had before the
    failed batch, so a seeded request draws the same uniforms either way."""
    which = list(which)
    vocab = logits.shape[1]
    rows = logits if len(which) == logits.shape[0] else logits[which]
    sub = [reqs[j] for j in which]
    banned = [_bans(r, eos) for r in sub]
    params = [r.params for r in sub]
    gens = [r.generator for r in sub]
    # only random rows draw: their generators' states, to restore if the batch fails
    states = [(g, g.get_state()) for g, p in zip(gens, params, strict=True) if not p.greedy]
    allowed = None  # the grammars' packed masks, every token elsewhere
    if masked:
        at = {j: i for i, j in enumerate(which)}
        allowed = allowed_tokens([reqs[j].matcher for j in masked], vocab, eos, len(which),
                                 [at[j] for j in masked])
    got: list[SampledToken | str | None]
    try:
        got = list(sample(rows, params, gens, sub, banned if any(banned) else None, allowed))
    except Exception:  # find the row that fails, keep the others
        for g, st in states:
            g.set_state(st)  # the batch may have drawn some rows' uniforms already
        got = []
        for i in range(len(which)):
            try:
                got.extend(sample(rows[i:i + 1], params[i:i + 1], gens[i:i + 1], sub[i:i + 1],
                                  banned[i:i + 1], None if allowed is None else allowed[i:i + 1]))
            except Exception as exc:
                got.append(f"sampling failed: {type(exc).__name__}: {exc}")
    if allowed is not None:
        for i in (allowed == 0).all(dim=1).nonzero().flatten().tolist():
            got[i] = "structured output: the grammar allows no token here"
    for j, t in zip(which, got, strict=True):
        toks[j] = t


def advance(matcher: Any, toks: list[SampledToken], eos: Sequence[int], taken: int = 0
            ) -> list[SampledToken] | str:
    """A request's grammar advanced by the tokens it keeps this step (the first ``taken`` of
    them consumed already); they end with the one that completes the grammar (marked
    ``grammar_end``). A token the grammar refuses fails the request (the reason is
    returned)."""
    out = []
    for i, t in enumerate(toks):
        if i >= taken and not consume(matcher, t.token_id, eos):
            return f"structured output: the grammar refused token {t.token_id}"
        if matcher.is_stopped():
            out.append(t._replace(grammar_end=True))
            break
        out.append(t)
    return out
