"""Thread use that follows how busy the machine's cores are (``ThreadGovernor``).

A step's parallel regions (torch's OpenMP teams, the native kernels' pool) are fast while every
thread has a core. When other processes keep the cores busy, a region waits for whichever of its
threads the scheduler put aside -- a tick (4-12 ms) for work that computes in a fraction of a
millisecond -- and a step of many regions slows 5-25x. One thread then beats two.

``ThreadGovernor.tick()`` (the runner calls it before each step) reads, at most every
``period`` seconds, how much CPU time the whole machine spent (``/proc/stat``) less what this
process spent (``time.process_time``): the cores the other processes use. When that leaves fewer
free cores than the engine's threads (with half a core of slack), torch runs on one thread
(the runner's ``set_threads``; the native pool keeps its threads: its items are claimed from a
shared counter, so it never waits at a barrier for a thread that is not running); when the others
leave room again (a quarter core below the limit), torch goes back to the engine's threads.
Changing torch's thread count re-forms its OpenMP team (~8 ms on the next region), so a change
happens only when the state flips, never per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

SLACK_CORES = 0.5  # others may use this much of the engine's cores before it drops to one thread
RETURN_CORES = 0.25  # ... and must use this much less before it returns to its threads


def machine_busy_seconds(stat: str | None = None) -> float | None:
    """CPU seconds the machine spent not idle, from ``/proc/stat``'s first line (None when it
    cannot be read)."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
        user, nice, system, _idle, _iowait, irq, softirq = (
            int(v) for v in text.splitlines()[0].split()[1:8])
    except (OSError, ValueError, IndexError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    def __init__(self, threads: int, set_threads: Callable[[int], None],
                 cores: int | None = None, period: float = 0.5,
                 busy: Callable[[], float | None] = machine_busy_seconds,
                 own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.cores = cores or os.cpu_count() or 1
        self.period = period
        self.set_threads = set_threads
        self._busy, self._own, self._clock = busy, own, clock
        self.current = threads
        self.others = 0.0  # cores the other processes used over the last period
        self.switches = 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(), self._own()

    def tick(self) -> int:
        """The thread count for the next step (changed here when the state flips)."""
        now = self._clock()
        if self.threads <= 1 or now - self._last[0] < self.period:
            return self.current
        t0, busy0, own0 = self._last
        self._last = sample = (now, self._busy(), self._own())
        if busy0 is None or sample[1] is None:
            return self.current
        wall = max(now - t0, 1e-9)
        self.others = max(0.0, (sample[1] - busy0) - (sample[2] - own0)) / wall
        free = self.cores - self.others
        want = self.current
        if self.current > 1 and free < self.threads - SLACK_CORES:
            want = 1
        elif self.current == 1 and free >= self.threads - SLACK_CORES + RETURN_CORES:
            want = self.threads
        if want != self.current:
            self.current = want
            self.switches += 1
            self.set_threads(want)
        return self.current
