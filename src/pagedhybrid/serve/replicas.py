"""``pagedhybrid serve --replicas N``: N engine replicas behind one OpenAI endpoint, on Ray Serve.

The launcher (this module; Ray is imported only when it runs): check the options, connect to
Ray (``--ray-address``, else a local cluster of this machine), check that the replicas fit the
cluster's CPUs, deploy the application of ``replica_deployments`` (``EngineReplica`` x N, each a
real ``pagedhybrid serve`` process with this command's engine options; an ``Ingress`` with the
prefix-aware ``replica_router``) with Ray Serve's HTTP proxy on ``--host`` / ``--port``, and wait.
SIGTERM / SIGINT delete the application (each replica stops its server, which lets its in-flight
requests finish for up to ``--shutdown-timeout`` seconds), shut Serve down when no other
application uses it, disconnect from Ray (a local cluster stops) and exit 0.

Options: ``--replicas N`` (fixed), or autoscaling bounds ``--min-replicas`` /
``--max-replicas`` (``--replicas`` is then the initial count; Ray Serve scales on
``--target-ongoing-requests`` per replica); ``--cpus-per-replica`` (Ray CPUs each replica
reserves); ``--router prefix|round_robin|random``; ``--router-imbalance``,
``--router-min-match``,
``--max-ongoing-requests``, ``--health-check-period`` / ``--health-check-timeout`` (seconds),
``--replica-start-timeout``. Refusals at start are ``ReplicaOptionError`` naming the option: an
unreachable ``--ray-address`` (a TCP probe of a few seconds, never a long hang), more replicas
than the cluster's CPUs hold (``--replicas`` / ``--min-replicas`` / ``--max-replicas``), a
``--port`` in use, inconsistent bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from pagedhybrid.errors import PagedHybridError
from pagedhybrid.serve.replica_spec import ReplicaSpec

APP_NAME = "pagedhybrid"
ROUTER_POLICIES = ("prefix", "round_robin", "random")
_PROBE_TIMEOUT_S = 3.0
# not passed to the replicas' servers: host and port are theirs, the key goes by environment
_NOT_PASSED = frozenset({"host", "port", "api_key", "func", "command", "help"})


class ReplicaOptionError(PagedHybridError, ValueError):
    """An option of ``pagedhybrid serve --replicas`` that cannot work; ``option`` names it."""

    def __init__(self, option: str, reason: str) -> None:
        self.option, self.reason = option, reason
        super().__init__(f"{option}: {reason}")


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """The launcher's options (never passed to the replicas' servers). ``--ray-address`` is
    shared with the engine's options when those have it (the same cluster)."""
    g = p.add_argument_group("replicas (Ray Serve; needs the ray extra)")
    known = {s for a in p._actions for s in a.option_strings}
    if "--ray-address" not in known:
        g.add_argument("--ray-address", default=None,
                       help="the Ray cluster (host:port of its GCS, or 'auto'; default: "
                       "$RAY_ADDRESS, else a new local cluster)").replica_only = True
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas behind this endpoint on Ray Serve (with "
                   "--min/--max-replicas: the initial count)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling lower bound (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling upper bound (with --min-replicas)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of requests per replica (default --max-num-seqs)")
    g.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs each replica reserves (default 1)")
    g.add_argument("--router", default="prefix", choices=ROUTER_POLICIES,
                   help="request routing: prefix (the replica holding the longest cached "
                   "prefix, else the least loaded; default), round_robin, random")
    g.add_argument("--router-imbalance", type=int, default=None,
                   help="requests in flight a prefix replica may have beyond the least-loaded "
                   "one before the router goes to the least loaded (default --max-num-seqs)")
    g.add_argument("--router-min-match", type=float, default=0.5,
                   help="share of a prompt's full KV pages a replica must hold for the prefix "
                   "router to prefer it (default 0.5; 0: any matching page)")
    g.add_argument("--max-ongoing-requests", type=int, default=256,
                   help="requests in flight per replica before Ray Serve queues (default 256)")
    g.add_argument("--health-check-period", type=float, default=5.0,
                   help="seconds between a replica's health checks (default 5)")
    g.add_argument("--health-check-timeout", type=float, default=30.0,
                   help="seconds a health check may take (default 30)")
    g.add_argument("--replica-start-timeout", type=float, default=600.0,
                   help="seconds a replica's server may take to become healthy (default 600)")
    for action in g._group_actions:
        action.replica_only = True  # type: ignore[attr-defined]


def server_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The ``pagedhybrid serve`` arguments that give a replica's server the options of
    ``args`` (what differs from the defaults), less the launcher's own and host / port."""
    positional: list[str] = []
    out: list[str] = []
    for action in parser._actions:
        dest = action.dest
        if getattr(action, "replica_only", False) or dest in _NOT_PASSED or \
                not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if not action.option_strings:
            if value is not None:
                positional.append(str(value))
            continue
        if value == action.default:
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")),
                    action.option_strings[0])
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true / store_const
            if value:
                out.append(flag)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return positional + out


def replica_spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ReplicaSpec:
    """Check the replica options (``ReplicaOptionError`` naming the option) and build the
    application's spec."""
    from pagedhybrid.models.qwen35 import default_model_dir

    n = args.replicas
    if n is None or n < 1:
        raise ReplicaOptionError("--replicas", f"must be an integer >= 1 (got {n})")
    if args.cpus_per_replica <= 0:
        raise ReplicaOptionError("--cpus-per-replica", f"must be > 0 (got {args.cpus_per_replica})")
    if args.max_ongoing_requests < 1:
        raise ReplicaOptionError("--max-ongoing-requests",
                                 f"must be >= 1 (got {args.max_ongoing_requests})")
    for opt, v in (("--health-check-period", args.health_check_period),
                   ("--health-check-timeout", args.health_check_timeout),
                   ("--replica-start-timeout", args.replica_start_timeout)):
        if not v > 0:
            raise ReplicaOptionError(opt, f"must be > 0 seconds (got {v})")
    if not 0.0 <= args.router_min_match <= 1.0:
        raise ReplicaOptionError("--router-min-match",
                                 f"must lie in [0, 1] (got {args.router_min_match})")
    autoscaling = None
    lo, hi = args.min_replicas, args.max_replicas
    if (lo is None) != (hi is None):
        raise ReplicaOptionError("--min-replicas" if lo is None else "--max-replicas",
                                 "autoscaling needs both --min-replicas and --max-replicas")
    if lo is not None:
        if lo < 0:
            raise ReplicaOptionError("--min-replicas", f"must be >= 0 (got {lo})")
        if hi < max(1, lo):
            raise ReplicaOptionError("--max-replicas", f"must be >= max(1, --min-replicas) "
                                     f"(got {hi}, --min-replicas {lo})")
        if not lo <= n <= hi:
            raise ReplicaOptionError("--replicas", f"the initial count must lie in "
                                     f"[--min-replicas, --max-replicas] = [{lo}, {hi}] "
                                     f"(got {n})")
        target = args.target_ongoing_requests or float(args.max_num_seqs)
        if target <= 0:
            raise ReplicaOptionError("--target-ongoing-requests", f"must be > 0 (got {target})")
        autoscaling = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": n,
                       "target_ongoing_requests": target}
    model_dir = Path(args.model_dir or args.model or default_model_dir())
    if not model_dir.is_dir():
        raise ReplicaOptionError("model_dir", f"{model_dir} is not a folder")
    env = {"PAGEDHYBRID_API_KEY": args.api_key} if args.api_key else {}
    imbalance = args.router_imbalance if args.router_imbalance is not None else \
        args.max_num_seqs
    return ReplicaSpec(
        server_argv=tuple(server_argv(parser, args)), model_dir=str(model_dir),
        block_size=args.block_size, num_replicas=n, cpus_per_replica=args.cpus_per_replica,
        router=args.router, imbalance=imbalance, min_match=args.router_min_match,
        capacity_pages=args.num_blocks or (1 << 16),
        max_ongoing_requests=args.max_ongoing_requests,
        health_check_period_s=args.health_check_period,
        health_check_timeout_s=args.health_check_timeout,
        start_timeout_s=args.replica_start_timeout, shutdown_timeout_s=args.shutdown_timeout,
        chat_template=args.chat_template, autoscaling=autoscaling, env=env)


# -- Ray ------------------------------------------------------------------------------------------
def _split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` / ``ray://host:port`` address; None for 'auto' etc."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def connect_ray(address: str | None) -> None:
    """``ray.init`` to ``address`` (None: a new local cluster of this machine). An address that
    cannot be reached is a ``ReplicaOptionError`` within seconds."""
    if address:
        hp = _split_address(address)
        if hp is None and address != "auto":
            raise ReplicaOptionError("--ray-address", f"{address!r} is neither host:port, "
                                     "ray://host:port nor 'auto'")
        if hp is not None:
            try:
                socket.create_connection(hp, timeout=_PROBE_TIMEOUT_S).close()
            except OSError as exc:
                raise ReplicaOptionError("--ray-address", f"the Ray cluster at {address} "
                                         f"cannot be reached ({exc})") from None
    import ray

    try:
        ray.init(address=address or "local", namespace=APP_NAME, logging_level="warning",
                 include_dashboard=False if not address else None,
                 configure_logging=True, log_to_driver=True)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as exc:
        if address:
            hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                " (a cluster with token authentication needs RAY_AUTH_MODE=token here)")
            raise ReplicaOptionError("--ray-address", f"cannot connect to the Ray cluster at "
                                     f"{address}: {exc}{hint}") from None
        raise PagedHybridError(f"a local Ray cluster could not start: {exc}") from None


def check_capacity(spec: ReplicaSpec, cluster_cpus: float) -> None:
    """More replicas than the cluster's CPUs hold: ``ReplicaOptionError`` naming the option."""
    need = [("--replicas", spec.num_replicas)]
    if spec.autoscaling:
        need += [("--min-replicas", spec.autoscaling["min_replicas"]),
                 ("--max-replicas", spec.autoscaling["max_replicas"])]
    for option, n in need:
        if n * spec.cpus_per_replica > cluster_cpus + 1e-9:
            raise ReplicaOptionError(option, f"{n} replicas x {spec.cpus_per_replica:g} CPU "
                                     f"(--cpus-per-replica) need {n * spec.cpus_per_replica:g} "
                                     f"CPUs; the Ray cluster has {cluster_cpus:g}")


def _check_port(host: str, port: int) -> None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))
    except OSError as exc:
        raise ReplicaOptionError("--port", f"{host}:{port} cannot be bound ({exc})") from None


def _local(host: str) -> bool:
    with contextlib.suppress(OSError), socket.socket() as s:
        s.bind((host, 0))
        return True
    return False


def serve_replicas(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the replicated server until SIGTERM / SIGINT (exit 0); a refusal at start prints
    ``error: <option>: <reason>`` and returns 2."""
    ray_mod: Any = None
    try:
        spec = replica_spec(args, parser)
        address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
        hp = _split_address(address) if address else None
        if not address or (hp is not None and _local(hp[0])):
            _check_port(args.host, args.port)
        connect_ray(address)
        import ray

        ray_mod = ray
        check_capacity(spec, float(ray.cluster_resources().get("CPU", 0.0)))
        return _run(spec, args)
    except PagedHybridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if ray_mod is not None and ray_mod.is_initialized():
            ray_mod.shutdown()  # a local cluster stops with it


def _run(spec: ReplicaSpec, args: argparse.Namespace) -> int:
    from ray import serve

    from pagedhybrid.serve.replica_deployments import build_application

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM,
                                                                     signal.SIGINT)}
    had_apps = _serve_apps(serve)
    try:
        level = str(getattr(args, "log_level", "warning")).lower()  # uvicorn's names
        log_level = "DEBUG" if level == "trace" else level.upper()
        serve.start(http_options={"host": args.host, "port": args.port})
        failed: list[BaseException] = []

        def deploy() -> None:  # on a thread: a signal during start-up stops it at once
            try:  # Ray Serve's own logs (access lines included) at the server's --log-level
                serve.run(build_application(spec), name=APP_NAME, route_prefix="/",
                          blocking=False, logging_config={"log_level": log_level})
            except BaseException as exc:
                failed.append(exc)

        starting = threading.Thread(target=deploy, name="pagedhybrid-deploy", daemon=True)
        starting.start()
        while starting.is_alive() and not stop.wait(0.2):
            pass
        if stop.is_set():
            print("pagedhybrid serve: stopped while the replicas were starting",
                  file=sys.stderr, flush=True)
            return 0
        if failed:  # a replica that cannot start (its server's output is in the message)
            raise PagedHybridError(f"the replicas did not start: {failed[0]} (the replicas' "
                                   "errors above say why: their servers' last output)")
        scale = f"{spec.num_replicas} replica{'s' if spec.num_replicas > 1 else ''}"
        if spec.autoscaling:
            scale += (f" (autoscaling {spec.autoscaling['min_replicas']}-"
                      f"{spec.autoscaling['max_replicas']})")
        print(f"pagedhybrid serve: {scale} of {Path(spec.model_dir).name} on "
              f"http://{args.host}:{args.port} (router {spec.router}; Ray Serve)",
              file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        print("pagedhybrid serve: stopping the replicas", file=sys.stderr, flush=True)
        return 0
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        if not had_apps and not _serve_apps(serve):
            with contextlib.suppress(Exception):
                serve.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
        print("pagedhybrid serve: stopped", file=sys.stderr, flush=True)


def _serve_apps(serve: Any) -> bool:
    """Whether Serve runs applications other than ours on the cluster."""
    try:
        return any(name != APP_NAME for name in serve.status().applications)
    except Exception:
        return False
