"""Run a function on ``W`` real gloo ranks: one spawned process per rank, one thread each.

``run_gloo(fn, world_size, workdir, *args)`` starts ``W`` processes (``spawn``), each joining a
gloo process group through a ``file://`` rendezvous in ``workdir`` (no ports), calls
``fn(rank, world_size, *args)`` with ``torch.set_num_threads(1)``, and returns the per-rank
results (anything ``torch.save`` can store) in rank order. A rank that raises makes
``run_gloo`` raise ``RankFailed`` with that rank's traceback; a run that exceeds ``timeout_s`` is
killed (never a hang). ``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of a ``run_gloo`` job raised or did not finish."""


def _entry(rank: int, world: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    out = Path(workdir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                                world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


def run_gloo(fn: Callable[..., Any], world_size: int, workdir: str | os.PathLike[str],
             *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world_size, str(workdir), fn, args),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].kill()
        procs[r].join()
    results, errors = [], []
    for r in range(world_size):
        path = workdir / f"rank{r}.pt"
        rec = torch.load(path, weights_only=False) if path.exists() else None
        if rec is None:
            errors.append(f"rank {r}: " + ("timed out" if r in alive else
                                           f"exited with code {procs[r].exitcode}, no result"))
        elif not rec["ok"]:
            errors.append(f"rank {r}:\n{rec['error']}")
        else:
            results.append(rec["result"])
    if errors:
        raise RankFailed("\n".join(errors))
    return results
