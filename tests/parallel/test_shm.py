"""``parallel/shm.py``: the shared-memory all-reduce of tensor-parallel ranks on one machine.

Three real processes sum tensors of several sizes -- one element, a decode step's, and one
larger than a slot (it goes in pieces) -- in float32 and bfloat16: every rank gets exactly
``(x0 + x1) + x2`` (rank order), the same bits everywhere. A wait on a rank that is gone raises
``PeerGone`` instead of spinning forever.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from pagedhybrid.parallel.shm import SLOT_BYTES, PeerGone, ShmAllReduce

WORLD = 3
CASES = ((1, torch.float32), (8 * 1024, torch.float32), (SLOT_BYTES // 4 + 123, torch.float32),
         (5000, torch.bfloat16))


def _input(rank: int, case: int) -> torch.Tensor:
    n, dtype = CASES[case]
    g = torch.Generator().manual_seed(100 * rank + case)
    return torch.randn(n, generator=g).to(dtype)


def _rank(rank: int, names: Any, out: Any) -> None:
    torch.set_num_threads(1)
    if rank == 0:
        comm = ShmAllReduce(None, 0, WORLD, create=True)
        for _ in range(WORLD - 1):
            names.put(comm.name)
    else:
        comm = ShmAllReduce(names.get(timeout=60), rank, WORLD)
    got = []
    for case in range(len(CASES)):
        x = _input(rank, case)
        for _ in range(3):  # the banks alternate: the same call again gives the same sum
            y = comm.all_reduce(x.clone())
        got.append((str(y.dtype), y.float().numpy()))  # by value (the process exits)
    out.put((rank, got))
    comm.all_reduce(torch.zeros(1))  # nobody closes while another still reads
    comm.close()


def test_every_rank_gets_the_rank_order_sum_bitwise() -> None:
    ctx = mp.get_context("spawn")
    names, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, names, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(WORLD))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for case in range(len(CASES)):
        want = _input(0, case).clone()
        for r in range(1, WORLD):
            want += _input(r, case)
        for r in range(WORLD):
            dtype, got = results[r][case]
            assert dtype == str(want.dtype), (r, case)
            assert torch.equal(torch.from_numpy(got), want.float()), (r, case)


def test_a_rank_that_is_gone_raises_instead_of_spinning() -> None:
    comm = ShmAllReduce(None, 0, 2, create=True, alive=lambda: False)
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match="stopped"):
        comm.all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 5
    comm.close()
    comm = ShmAllReduce(None, 0, 2, create=True, timeout_s=0.3)
    with pytest.raises(PeerGone, match="waited more than"):
        comm.all_reduce(torch.ones(4))
    comm.close()
