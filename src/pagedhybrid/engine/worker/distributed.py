"""Tensor-parallel serving over torch.distributed: rank 0 runs the engine, ranks ``1 .. W-1``
run the model runner on their shard of the same steps.

Rank 0 schedules, builds each step's ``StepPlan`` (``input_batch.py``) and sends it, pickled once,
to every other rank over one socket each (the step object, once per step); every rank then
materialises the same batch and metadata and runs the forward on its own heads, MLP channels,
KV pages and state slots -- the row-parallel projections' all-reduces are the only traffic
inside a step (through shared memory between ranks of one machine, ``parallel/shm.py``; gloo
otherwise). Rank 0 alone computes logits and samples. A verify step's commit, the MTP
head's steps (``runner.MtpCall``: the drafter's catch-up and chain) and ``Engine.score`` go the
same way. The pools have the same sizes on every rank (rank 0 plans them
and sends ``PoolSizes``); the scheduler, the prefix cache's hashes and the requests live on rank
0 only.

Start (``start_ranks``): rank 0 opens a ``torch.distributed.TCPStore``; the other ranks are
started by the executor -- ``mp``: ``python -m pagedhybrid.engine.worker.distributed HOST PORT RANK
WORLD`` subprocesses on this machine, ``cores // W`` threads each; ``ray``: one Ray actor per
rank in a placement group of ``W - 1`` bundles (any node of the cluster); ``external_launcher``:
the user starts every rank with torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``RANK``), rank 0 being the one that serves -- then all join one gloo group
through the store, rank 0 publishes the step socket's address and key there, and each rank
loads its slice of the checkpoint (``models.qwen35.load(parallel=...)``: the folder must be at
the same path on every machine).

Failure: a rank that exits (killed, out of memory, a crash) breaks the group -- rank 0 finds out
on the next send or collective (gloo reports the closed connection at once), names the rank and
its exit, stops the others and the engine turns dead (``Engine.dead``): every request in flight
finishes with that error and new ones are refused with ``EngineDead``; the server reports it on
``/health``. An exception inside a step's forward on rank 0 does the same (the other ranks would
wait in a collective that never comes). The other ranks exit when rank 0 goes away (end of their
socket). ``close`` stops them.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagedhybrid.engine.core.config import EngineConfig, PoolSizes
from pagedhybrid.errors import ContractViolation, EngineDead, PagedHybridError
from pagedhybrid.parallel import ParallelConfig
from pagedhybrid.parallel.shm import ShmAllReduce

START_S = 300.0  # seconds the ranks may take to start and join
COLLECTIVE_S = 300.0  # a collective (an all-reduce inside a step) waits this long at most
_STEP_KEY = "pagedhybrid/step-socket"
OP = "EngineConfig"


class _Rank:
    """One rank other than 0, as its executor started it."""

    def __init__(self, rank: int, proc: Any = None, actor: Any = None, ref: Any = None) -> None:
        self.rank, self.proc, self.actor, self.ref = rank, proc, actor, ref

    def gone(self) -> str | None:
        """How this rank ended, or None while it runs (or when nothing can tell)."""
        if self.proc is not None:
            code = self.proc.poll()
            return None if code is None else f"exited with code {code}"
        if self.ref is not None:
            import ray

            done, _ = ray.wait([self.ref], timeout=0)
            if not done:
                return None
            try:
                return f"ended (code {ray.get(self.ref)})"
            except Exception as exc:
                return f"died: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return None

    def stop(self, timeout: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        elif self.actor is not None:
            import ray

            if timeout > 0:
                with contextlib.suppress(Exception):
                    ray.wait([self.ref], timeout=timeout)
            with contextlib.suppress(Exception):
                ray.kill(self.actor)


@dataclass
class TensorParallelGroup:
    """Rank 0's side of the group: the other ranks' step sockets and how they were started."""

    world_size: int
    ranks: list[_Rank]
    conns: list[Connection]
    local_ranks: int  # ranks on this machine (the memory plan divides what it finds by it)
    executor: str
    placement: Any = None  # the Ray placement group
    shm: ShmAllReduce | None = None  # the all-reduces of ranks on this machine (mp)
    dead: str | None = None  # why the group is broken (None: serving)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp_rank=0, tp_world_size=self.world_size, communicator=self.shm)

    def send(self, kind: str, payload: Any) -> None:
        """One message to every other rank (pickled once)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        data = pickle.dumps((kind, payload), pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except OSError as exc:
            raise self.fail(exc) from exc

    def _replies(self, what: str) -> list[Any]:
        """One reply from every other rank, in rank order (a rank that fails instead, or goes
        away, breaks the group)."""
        out = []
        for r, c in zip(self.ranks, self.conns, strict=True):
            deadline = time.monotonic() + START_S
            while not c.poll(0.1):
                why = r.gone()
                if why is not None or time.monotonic() > deadline:
                    raise self.fail(RuntimeError(f"no {what} reply"))
            try:
                kind, body = c.recv()
            except (EOFError, OSError) as exc:
                raise self.fail(exc) from exc
            if kind == "failed":
                self.dead = f"tensor-parallel rank {r.rank} failed: {body}"
                self._stop(0.0)
                raise PagedHybridError(self.dead)
            out.append(body)
        return out

    def allocate(self, sizes: PoolSizes) -> None:
        """Every rank's cache of ``sizes``; returns once all are ready."""
        self.send("allocate", sizes)
        self._replies("allocate")

    def check(self) -> list[dict[str, Any]]:
        """Each other rank's view: its cache geometry, the steps it ran and its last step's
        lengths (``ModelRunner.rank_state``), for the invariants."""
        self.send("check", None)
        return self._replies("check")

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Work every rank takes part in; an exception in it breaks the group."""
        try:
            yield
        except Exception as exc:
            raise self.fail(exc) from exc

    def fail(self, exc: BaseException) -> EngineDead:
        """Break the group: name the rank that went away (else the error), stop the others."""
        if self.dead is None:
            gone = [f"rank {r.rank} {why}" for r in self.ranks if (why := r.gone())]
            self.dead = ("tensor-parallel " + "; ".join(gone) if gone else
                         f"a tensor-parallel step failed on rank 0: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")
            print(f"pagedhybrid: {self.dead}; stopping the other ranks", file=sys.stderr)
            self._stop(0.0)
        return EngineDead(self.dead)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks (they finish the message they are on)."""
        if self.dead is None:
            with contextlib.suppress(Exception):
                self.send("stop", None)
            self.dead = "the engine was closed"
        self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        for r in self.ranks:
            with contextlib.suppress(Exception):
                r.stop(timeout)
        if self.placement is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement)
            self.placement = None
        if self.shm is not None:
            with contextlib.suppress(Exception):
                self.shm.close()
            self.shm = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# -- starting the ranks ---------------------------------------------------------------------------
def check_shape(model_dir: Path, world: int) -> None:
    """Refuse a TP size that does not split the checkpoint's heads and channels, before any
    rank starts (the error names ``tensor_parallel_size`` and the config field)."""
    from pagedhybrid.errors import UnsupportedConfiguration
    from pagedhybrid.models.qwen35 import Qwen35Config

    try:
        Qwen35Config.from_model_dir(model_dir).rank_local(ParallelConfig(0, world))
    except UnsupportedConfiguration as exc:
        raise ContractViolation(OP, "tensor_parallel_size", str(exc), world) from None


def start_ranks(config: EngineConfig, model_dir: Path, dtype: torch.dtype
                ) -> TensorParallelGroup:
    """Start ranks ``1 .. W-1`` with ``config.executor``, join them into one gloo group with
    this process as rank 0 and have each load its slice of ``model_dir`` (module docstring)."""
    world, executor = config.tensor_parallel_size, config.executor
    check_shape(model_dir, world)
    cores = os.cpu_count() or 1
    threads = max(1, cores // world) if executor == "mp" else max(1, torch.get_num_threads())
    if executor == "mp" and world > cores:
        raise ContractViolation(OP, "tensor_parallel_size", f"must be at most the {cores} cores "
                                "of this machine with the mp executor (one rank per core at "
                                "least; use ray or external_launcher across machines)", world)
    if dist.is_initialized():
        raise ContractViolation(OP, "tensor_parallel_size", "> 1 needs this process's "
                                "torch.distributed group, which is already in use (one "
                                "tensor-parallel engine per process: close() the other first)",
                                world)
    placement = None
    if executor == "external_launcher":
        env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
        if None in env.values():
            raise ContractViolation(OP, "distributed_executor_backend", "external_launcher "
                                    "needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK in the "
                                    "environment (torchrun sets them)",
                                    [k for k, v in env.items() if v is None])
        if int(env["WORLD_SIZE"] or 0) != world or int(env["RANK"] or 0) != 0:
            raise ContractViolation(OP, "tensor_parallel_size", "must equal WORLD_SIZE, with "
                                    "this process at RANK 0 (the other ranks run the same "
                                    "command and serve as workers)", (world, env["WORLD_SIZE"],
                                                                      env["RANK"]))
        host, port = str(env["MASTER_ADDR"]), int(env["MASTER_PORT"] or 0)
    else:
        host = "127.0.0.1" if executor == "mp" else _ray_node_ip(config)
        port = 0
    # under torchrun the agent already serves the store at MASTER_PORT: join it
    agent = executor == "external_launcher" and \
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent,
                          timeout=datetime.timedelta(seconds=START_S), wait_for_workers=False)
    key = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1" if executor == "mp" else "0.0.0.0", 0), authkey=key)
    store.set(_STEP_KEY, pickle.dumps((host, listener.address[1], key)))
    ranks: list[_Rank] = []
    try:
        if executor == "mp":
            for r in range(1, world):
                proc = subprocess.Popen([sys.executable, "-m",
                                         "pagedhybrid.engine.worker.distributed", host,
                                         str(store.port), str(r), str(world)],
                                        stdin=subprocess.DEVNULL)
                ranks.append(_Rank(r, proc=proc))
        elif executor == "ray":
            placement, ranks = _start_ray(config, world, threads, host, store.port)
        else:  # started by the user: nothing here can tell how they end but their sockets
            ranks = [_Rank(r) for r in range(1, world)]
        conns = _join(listener, ranks, world)
    except BaseException:
        for r in ranks:
            r.stop(0.0)
        listener.close()
        raise
    listener.close()
    dist.init_process_group("gloo", store=store, rank=0, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_S))
    if executor == "mp":  # the ranks share this machine's cores
        from pagedhybrid.kernels.native import set_pool_threads

        torch.set_num_threads(threads)
        set_pool_threads(threads)
    shm = None
    if executor == "mp":  # one machine: all-reduces through shared memory, not loopback TCP
        shm = ShmAllReduce(None, 0, world, create=True,
                           alive=lambda: all(r.gone() is None for r in ranks))
    group = TensorParallelGroup(world, ranks, conns, world if executor == "mp" else 1, executor,
                                placement, shm)
    group.send("setup", (str(model_dir), dtype, config, threads,
                         None if shm is None else shm.name))
    atexit.register(group.close, 1.0)  # an engine never closed: its ranks and segment go too
    return group


def _join(listener: Listener, ranks: list[_Rank], world: int) -> list[Connection]:
    """Accept every other rank's step socket (each sends its rank first), watching that the
    ranks still run; in rank order."""
    conns: dict[int, Connection] = {}
    failed: list[BaseException] = []

    def accept() -> None:
        try:
            for _ in range(world - 1):
                c = listener.accept()
                conns[int(c.recv())] = c
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=accept, name="pagedhybrid-tp-join", daemon=True)
    t.start()
    deadline = time.monotonic() + START_S
    while t.is_alive():
        gone = [f"rank {r.rank} {why}" for r in ranks if (why := r.gone())]
        if gone or time.monotonic() > deadline:
            listener.close()
            raise PagedHybridError("tensor-parallel " + "; ".join(gone) + " while starting"
                                   if gone else f"tensor-parallel ranks did not join in "
                                   f"{START_S:g} s ({len(conns)} of {world - 1})")
        t.join(0.05)
    if failed:
        raise PagedHybridError(f"tensor-parallel ranks could not join: {failed[0]}")
    return [conns[r] for r in range(1, world)]


def _ray_node_ip(config: EngineConfig) -> str:
    """Connect to the Ray cluster (``ray_address``, else ``RAY_ADDRESS``, else a local one);
    this node's address."""
    try:
        import ray
    except ImportError:
        raise ContractViolation(OP, "distributed_executor_backend", "'ray' needs Ray: pip "
                                "install 'pagedhybrid[ray]'", "ray") from None
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local") and not address.startswith("ray://"):
        h, _, p = address.rpartition(":")
        try:
            socket.create_connection((h or address, int(p or 6379)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise ContractViolation(OP, "ray_address", f"cannot be reached ({exc})",
                                    address) from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return ray.util.get_node_ip_address()


def _start_ray(config: EngineConfig, world: int, threads: int, host: str, port: int
               ) -> tuple[Any, list[_Rank]]:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": threads}] * (world - 1), strategy="PACK")
    if not pg.wait(timeout_seconds=30):
        ray.util.remove_placement_group(pg)
        have = ray.cluster_resources().get("CPU", 0)
        raise ContractViolation(OP, "tensor_parallel_size", f"needs {world - 1} Ray actors of "
                                f"{threads} CPUs; the cluster has {have:g} CPUs in all and "
                                "could not place them in 30 s", world)
    actor_cls = ray.remote(RayRank)
    ranks = []
    for r in range(1, world):
        actor = actor_cls.options(num_cpus=threads, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r - 1))).remote()
        ranks.append(_Rank(r, actor=actor, ref=actor.run.remote(host, port, r, world)))
    return pg, ranks


class RayRank:
    """A rank as a Ray actor (``ray.remote`` is applied when the group starts)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, host: str, port: int, rank: int, world: int) -> int:
        return worker_main(host, port, rank, world)


# -- a rank other than 0 --------------------------------------------------------------------------
def worker_main(host: str, port: int, rank: int, world: int) -> int:
    """Join rank 0's group as ``rank`` and serve its steps until it stops or goes away."""
    from pagedhybrid.engine.core.stats import EngineStats
    from pagedhybrid.engine.worker.runner import ModelRunner, load_model
    from pagedhybrid.kernels.native import set_pool_threads

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a stuck rank is
    store = dist.TCPStore(host, port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=START_S))
    step_host, step_port, key = pickle.loads(store.get(_STEP_KEY))
    conn = Client((step_host, step_port), authkey=key)
    conn.send(rank)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_S))
    try:
        _, (model_dir, dtype, config, threads, shm_name) = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(threads)
        set_pool_threads(threads)
        parent = os.getppid()  # (mp: rank 0; its exit re-parents this process)
        comm = None if shm_name is None else ShmAllReduce(
            shm_name, rank, world, alive=lambda: os.getppid() == parent)
        try:
            model = load_model(model_dir, dtype, config,
                               ParallelConfig(rank, world, communicator=comm))
            runner = ModelRunner(model, config, EngineStats())
        except Exception as exc:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return 1
        return _serve(conn, runner, rank)
    except (EOFError, OSError):
        return 0  # rank 0 is gone
    except Exception:
        traceback.print_exc(file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _serve(conn: Connection, runner: Any, rank: int) -> int:
    steps = 0
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "step":
            runner.replay(payload)
            steps += 1
        elif kind == "commit":
            runner.commit_states(*payload)
        elif kind == "mtp":
            runner.forward_mtp(payload)
        elif kind == "score":
            runner.score(payload)
        elif kind == "allocate":
            runner.allocate(payload)
            conn.send(("ready", rank))
        elif kind == "check":
            conn.send(("state", {**runner.rank_state(), "rank": rank, "steps": steps}))
        elif kind == "stop":
            return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedhybrid.engine.worker.distributed HOST PORT RANK WORLD`` (the mp
    executor)."""
    host, port, rank, world = (argv if argv is not None else sys.argv[1:])
    return worker_main(host, int(port), int(rank), int(world))


if __name__ == "__main__":
    sys.exit(main())
