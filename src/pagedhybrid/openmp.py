"""OpenMP's spin after a parallel region, set before torch loads libgomp.

torch's CPU ops run on libgomp's team; after each parallel region the team's workers spin for
``GOMP_SPINCOUNT`` iterations (300,000 by default: milliseconds) waiting for the next one. The
native kernels (``kernels/native/csrc/common.h``) run on their own helper thread, so on a machine
with as many cores as threads a spinning OpenMP worker takes the core the helper needs, for
every torch op between two native calls (an MoE router's softmax before the experts, a prefill
chunk's GEMMs before the next layer's conv). With ``GOMP_SPINCOUNT=1000`` (tens of
microseconds) on the 2-core EPYC: ``benchmarks/engine.py --moe`` 23.0 / 26.6 s -> 18.9 / 20.6 s
(runs alternating), and the 141M model's batched decode (``benchmarks/weights.py``) b8 fp32
101 -> 267 tok/s, bf16 388 -> 557, int4 377 -> 443.

libgomp reads the variable once, when it is loaded, so ``configure()`` sets it (unless the
user's environment has it) from ``pagedhybrid/__init__`` before anything imports torch; where
torch (or another user of libgomp) was loaded first it cannot, and ``summary()`` -- part of the
engine's kernel line -- says so.
"""

from __future__ import annotations

import functools
import os
import sys

SPIN_COUNT = "1000"


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libgomp" in f.read()
    except OSError:
        return "torch" in sys.modules


@functools.cache
def configure() -> str:
    """Set ``GOMP_SPINCOUNT`` for libgomp if it is neither set nor loaded yet (once per process);
    what it found: ``"set"``, ``"user"`` (the environment had it) or ``"late"`` (libgomp already
    loaded)."""
    if "GOMP_SPINCOUNT" in os.environ:
        return "user"
    if "torch" in sys.modules or _libgomp_loaded():
        return "late"
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return "set"


def summary() -> str:
    """One phrase for the kernel line: the spin OpenMP's workers run with, and whose it is."""
    state = configure()
    if state == "late":
        return ("OpenMP spin: libgomp's default (loaded before pagedhybrid: import pagedhybrid "
                f"first, or set GOMP_SPINCOUNT={SPIN_COUNT})")
    owner = "pagedhybrid's" if state == "set" else "the environment's"
    return f"OpenMP spin: GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']} ({owner})"
