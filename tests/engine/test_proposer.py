"""A new drafter is a new proposer and its registration, nothing else (issue 52): a proposer
written here, in the test file, registered by name, and chosen by ``speculative_config.method``
as vLLM users choose ``ngram``, gives exactly greedy decoding's tokens -- with drafts that are
right (accepted: the verify path ran) and drafts that are wrong (rejected: the states rolled
back) -- and an unregistered method is refused naming the field and the registered names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
from test_speculative import GREEDY, PROMPTS, run

from pagedhybrid.engine import Engine, Request
from pagedhybrid.engine.spec_decode import (
    PROPOSERS,
    ProposerContext,
    ProposerSpec,
    register_proposer,
)
from pagedhybrid.errors import ContractViolation


class Lookup:
    """Drafts from a table of continuations keyed by prompt; ``shift`` corrupts every draft."""

    def __init__(self, ctx: ProposerContext, truth: dict[tuple[int, ...], Sequence[int]],
                 shift: int) -> None:
        self.k_max, self.truth, self.shift = ctx.config.num_speculative_tokens, truth, shift
        self.calls = 0

    def propose(self, requests: Sequence[Request], k: int) -> None:
        assert k == self.k_max
        self.calls += 1
        for r in requests:
            seen = self.truth.get(tuple(r.prompt_token_ids), ())
            nxt = seen[r.num_output_tokens:r.num_output_tokens + k]
            r.draft_ids = tuple((t + self.shift) % 256 for t in nxt)


@pytest.fixture
def toy(make_engine: Callable[..., Engine]) -> Iterator[dict[tuple[int, ...], Sequence[int]]]:
    """Register ``toy`` (right drafts) and ``toy_wrong`` for the test; remove them after."""
    base = run(make_engine(num_blocks=64), [(p, GREEDY) for p in PROMPTS])
    truth = {tuple(p): base[f"r{i}"].token_ids for i, p in enumerate(PROMPTS)}
    register_proposer(ProposerSpec("toy", lambda ctx: Lookup(ctx, truth, 0)))
    register_proposer(ProposerSpec("toy_wrong", lambda ctx: Lookup(ctx, truth, 1)))
    yield truth
    del PROPOSERS["toy"], PROPOSERS["toy_wrong"]


@pytest.mark.parametrize("method", ["toy", "toy_wrong"])
def test_a_proposer_registered_here_gives_exact_greedy_output(
        make_engine: Callable[..., Engine], toy: dict[tuple[int, ...], Sequence[int]],
        method: str) -> None:
    engine = make_engine(num_blocks=64, speculative_config={
        "method": method, "num_speculative_tokens": 3, "adaptive": False})
    assert isinstance(engine.drafter, Lookup) and engine.drafter.shift == (method != "toy")
    got = run(engine, [(p, GREEDY) for p in PROMPTS])
    for i, p in enumerate(PROMPTS):
        assert list(got[f"r{i}"].token_ids) == list(toy[tuple(p)]), method
    spec = engine.stats.spec
    assert engine.drafter.calls > 0 and spec.drafts > 0
    if method == "toy":  # every draft right: all accepted but those past a request's max_tokens
        assert spec.draft_tokens - len(PROMPTS) <= spec.accepted_tokens <= spec.draft_tokens
    else:  # every draft wrong: rejected, the states rolled back (the output above is exact)
        assert spec.accepted_tokens == 0


def test_an_unregistered_method_is_refused_naming_the_registered_ones(
        make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(ContractViolation, match=r"method.*\['mtp', 'ngram'\]"):
        make_engine(num_blocks=16, speculative_config={"method": "eagle"})
    with pytest.raises(ContractViolation, match="already registered"):
        register_proposer(ProposerSpec("ngram", lambda ctx: Lookup(ctx, {}, 0)))
