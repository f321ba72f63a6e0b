"""The engine's cumulative counters (``Engine.stats``); the runner adds its step timings."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters: verify chunks, draft tokens proposed, accepted,
    and accepted per draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafter_failures: int = 0  # steps whose drafter raised (they ran without drafts)

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


STEP_LOG = 100_000  # steps kept in EngineStats.step_log


@dataclass
class EngineStats:
    """Cumulative counters; times in seconds."""

    steps: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of requests that finished
    generated_tokens: int = 0
    computed_tokens: int = 0  # tokens fed to the model (prefill chunks, recompute, decodes)
    preemptions: int = 0
    step_failures: int = 0  # steps that raised (their requests failed, serving went on)
    pool_rebuilds: int = 0  # of those, the ones whose pools had to be rebuilt
    # structured outputs: constrained rows sampled, the masks they needed (a row picked
    # unmasked needs none when the grammar allows its pick: ``structured.try_consume``), and
    # the refused greedy picks that took their next best instead (``step_sampling``)
    constrained_rows: int = 0
    grammar_masks: int = 0
    next_best_picks: int = 0
    peak_running: int = 0
    peak_blocks: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding
    # per step: (sequences, tokens, scheduling + batch building s, whole step s), the last
    # STEP_LOG steps (a server steps for days: all of them would grow without end)
    step_log: deque[tuple[int, int, float, float]] = field(
        default_factory=lambda: deque(maxlen=STEP_LOG))

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.build_s + self.forward_s + self.sample_s + self.update_s

    @property
    def overhead_fraction(self) -> float:
        """(scheduling + batch building) / step time."""
        return (self.schedule_s + self.build_s) / self.total_s if self.total_s else 0.0

    def overhead_at(self, min_seqs: int) -> tuple[float, int]:
        """Overhead fraction over the steps that ran at least ``min_seqs`` sequences, and how
        many such steps there were."""
        rows = [(o, t) for n, _, o, t in self.step_log if n >= min_seqs]
        total = sum(t for _, t in rows)
        return (sum(o for o, _ in rows) / total if total else 0.0), len(rows)
