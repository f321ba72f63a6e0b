"""The ``Proposer`` interface and the registry of proposers (vLLM's ``spec_decode`` proposers).

A proposer drafts tokens for decoding requests: after each step, ``propose(requests, k)`` sets
each request's ``draft_ids`` (at most ``k``); the scheduler gives a drafted request a verify chunk
and the runner verifies it (``verify.py``). A proposer is registered once, by name, with what the
engine must know before it builds one (``ProposerSpec``); ``speculative_config.method`` names it.
Adding a drafter is a new module that registers its ``ProposerSpec`` -- nothing in ``core/`` or
``worker/`` changes (``tests/engine/test_proposer.py`` registers one from the test file).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedhybrid.engine.core.config import SpeculativeConfig
from pagedhybrid.engine.core.request import Request
from pagedhybrid.errors import ContractViolation

Budget = Callable[[Sequence[Request], Sequence[float]], None]


class Proposer(Protocol):
    """Proposes draft tokens: sets ``req.draft_ids`` (at most ``k``) of decoding requests."""

    def propose(self, requests: Sequence[Request], k: int) -> None: ...


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built from: the config, the engine's runner (its model, the last
    step's hidden states and its draft-head call: ``mtp.py``), each request's current page table
    and, for a proposer that applies the draft budget itself (``ProposerSpec.budgets_itself``,
    with ``adaptive`` on), the budget's ``trim(requests, position_costs)``."""

    config: SpeculativeConfig
    runner: Any
    table: Callable[[Request], Sequence[int]]
    budget: Budget | None


@dataclass(frozen=True)
class ProposerSpec:
    """A proposer by name: ``build(context)`` makes one; ``model_head``: it drafts with the
    checkpoint's own draft head (loaded with the model, its K/V on the sequence's pages, the
    step's hidden states kept for it); ``lookahead(k)``: page positions the scheduler reserves
    past a sampling chunk for its chain; ``budgets_itself``: it applies the draft budget before
    its own work (else the engine trims its drafts after)."""

    name: str
    build: Callable[[ProposerContext], Proposer]
    model_head: bool = False
    lookahead: Callable[[int], int] = lambda k: 0
    budgets_itself: bool = False


PROPOSERS: dict[str, ProposerSpec] = {}


def register_proposer(spec: ProposerSpec) -> ProposerSpec:
    """Make ``spec.name`` a ``speculative_config.method``; a name is registered once."""
    if spec.name in PROPOSERS and PROPOSERS[spec.name] is not spec:
        raise ContractViolation("register_proposer", "name", "is already registered", spec.name)
    PROPOSERS[spec.name] = spec
    return spec


def proposer_spec(config: SpeculativeConfig) -> ProposerSpec:
    """The registered proposer ``config.method`` names, or the refusal naming the field."""
    spec = PROPOSERS.get(config.method)
    if spec is None:
        raise ContractViolation("speculative_config", "method",
                                f"must be one of {sorted(PROPOSERS)} (the registered proposers)",
                                config.method)
    return spec


def draftable(req: Request) -> bool:
    """Whether a request's rows may be verified together (``spec_decode/__init__.py``)."""
    p = req.params
    return not (p.penalized or req.bad_word_ids or req.num_output_tokens < p.min_tokens
                or (p.prompt_logprobs is not None and not req.prompt_logprobs_done))

