"""The thread governor: one thread while other processes keep the cores busy, back to the
engine's threads when they leave room, a change only when the state flips."""

from __future__ import annotations

import os

import torch

from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.worker.contention import ThreadGovernor, machine_busy_seconds
from pagedhybrid.serve.llm import LLM


class Machine:
    """A clock, the machine's busy CPU seconds and this process's CPU seconds, advanced by
    hand: ``run(seconds, others, ours)`` -- ``others`` / ``ours`` cores busy meanwhile."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + ours)
        self.own += seconds * ours


def governor(m: Machine, changes: list[int]) -> ThreadGovernor:
    return ThreadGovernor(2, changes.append, cores=2, period=0.5, busy=lambda: m.busy,
                          own=lambda: m.own, clock=lambda: m.t)


def test_two_busy_processes_drop_it_to_one_thread_and_quiet_cores_bring_it_back() -> None:
    m, changes = Machine(), []
    g = governor(m, changes)
    m.run(0.6, others=0.1, ours=2.0)  # quiet: stays on 2
    assert g.tick() == 2 and changes == [] and abs(g.others - 0.1) < 1e-9
    m.run(0.6, others=2.0, ours=0.7)  # two busy loops
    assert g.tick() == 1 and changes == [1]
    m.run(0.1, others=0.0, ours=1.0)  # within the period: nothing is read
    assert g.tick() == 1 and changes == [1]
    m.run(0.6, others=0.4, ours=1.0)  # 1.6 free cores: not yet back (needs 1.75)
    assert g.tick() == 1
    m.run(0.6, others=0.2, ours=1.0)
    assert g.tick() == 2 and changes == [1, 2] and g.switches == 2
    m.run(0.6, others=0.4, ours=2.0)  # half a core of slack: stays on 2
    assert g.tick() == 2 and changes == [1, 2]


def test_one_thread_engines_and_unreadable_stats_never_change() -> None:
    m, changes = Machine(), []
    g = ThreadGovernor(1, changes.append, cores=2, busy=lambda: m.busy, own=lambda: m.own,
                       clock=lambda: m.t)
    m.run(1.0, others=2.0, ours=1.0)
    assert g.tick() == 1 and changes == []
    g = ThreadGovernor(2, changes.append, cores=2, busy=lambda: None, clock=lambda: m.t)
    m.run(1.0, others=2.0, ours=1.0)
    assert g.tick() == 2 and changes == []


def test_proc_stat_is_read() -> None:
    tck = os.sysconf("SC_CLK_TCK")
    assert machine_busy_seconds(f"cpu  {tck} 0 {tck} 500 7 0 {tck} 0 0 0\ncpu0 1\n") == 3.0
    assert machine_busy_seconds("garbage") is None
    assert (machine_busy_seconds() or 0) > 0


def test_the_engine_ticks_the_governor_and_the_invariant_mode_turns_it_off() -> None:
    llm = LLM(None, max_num_seqs=2)
    gov = llm.engine.runner.governor
    assert gov is not None and gov.threads == torch.get_num_threads()
    calls: list[int] = []
    gov.set_threads = calls.append
    gov.period = 0.0
    gov.cores = 1  # a machine whose only core the others take: one thread
    gov.threads = 2
    gov.current = 2
    out = llm.generate(["In the beginning"], SamplingParams(max_tokens=4), use_progress=False)
    assert len(out[0].token_ids) == 4
    assert calls[:1] == [1]
    off = LLM(None, max_num_seqs=2, adaptive_threads=False)
    assert off.engine.runner.governor is None
    inv = LLM(None, max_num_seqs=2, batch_invariant=True)
    assert inv.engine.runner.governor is None
