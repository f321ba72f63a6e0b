"""Route two real ``pagedhybrid serve`` replicas with an external KV-event router: Dynamo's.

The router is NVIDIA Dynamo's standalone selection service (``python -m dynamo.select_service``
from the ``ai-dynamo-runtime`` wheel): it subscribes to each replica's ZMQ KV-event stream
(``--kv-events-config``, vLLM's wire format), keeps Dynamo's KV indexer (a radix tree of the
pages each replica holds) and answers ``POST /select_and_reserve`` with the replica to send a
prompt to -- KV overlap and load together, the scheduler of Dynamo's KV router. It does not proxy
the request: the caller sends it to the returned ``endpoint`` (as Ray or a gateway plugin
does), then reports prefill completion and release.

Steps: start two replicas (each with its own event endpoints) and the selection service,
register the replicas, then for each replica in turn: send a long prefix to that replica
directly (it now holds the prefix's pages and publishes ``BlockStored``), ask the router where
a different request sharing the prefix should go, send it there, and read both replicas'
``prefix_cache_hits_total``. A control prompt sharing nothing must match no pages. Exits 1 if
any routed request did not go to the replica holding its prefix.

Dynamo matches by its own hash of the event's ``token_ids`` (the engine's block hashes are only
opaque ids for parent links and removal), so pagedhybrid's BLAKE2b page hashes need no change.

Run through ``scripts/external_router.sh`` (it installs the router into its own venv), or
``python scripts/external_router.py --router-python /path/to/venv/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "m"
PAGE = 16  # pagedhybrid's default --block-size; the router must chunk prompts the same way


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up:\n{log.read_text()[-3000:]}")


def prefix_hits(base: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedhybrid:prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-python", required=True,
                    help="python of a venv with ai-dynamo-runtime installed")
    ap.add_argument("--logs", type=Path, default=None, help="log folder (default: a temp dir)")
    args = ap.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pagedhybrid-router-"))
    logs.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "10"]
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(cmd: list[str], name: str, env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen[bytes], Path]:
        log = logs / f"{name}.log"
        p = subprocess.Popen([*nice, *cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
        procs.append(p)
        return p, log

    try:
        replicas = []
        for wid in (1, 2):
            http, pub, replay = free_port(), free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                   "replay_endpoint": f"tcp://*:{replay}", "topic": f"kv@replica{wid}@{MODEL}"}
            p, log = spawn([sys.executable, "-m", "pagedhybrid", "serve", "--port", str(http),
                            "--served-model-name", MODEL, "--dtype", "float32",
                            "--max-num-seqs", "4", "--kv-events-config", json.dumps(cfg)],
                           f"replica{wid}", {"PYTHONUNBUFFERED": "1"})
            replicas.append({"id": wid, "base": f"http://127.0.0.1:{http}", "proc": p,
                             "log": log, "pub": f"tcp://127.0.0.1:{pub}",
                             "replay": f"tcp://127.0.0.1:{replay}"})
        rport = free_port()
        rp, rlog = spawn([args.router_python, "-m", "dynamo.select_service", "--port", str(rport),
                          "--threads", "1"], "dynamo_select_service")
        router = f"http://127.0.0.1:{rport}"
        for r in replicas:
            wait_ok(f"{r['base']}/health", r["proc"], r["log"])
        wait_ok(f"{router}/health", rp, rlog, 60)
        for r in replicas:
            httpx.post(f"{router}/workers", json={
                "worker_id": r["id"], "model_name": MODEL, "endpoint": r["base"],
                "block_size": PAGE, "kv_events_endpoints": {"0": r["pub"]},
                "replay_endpoint": r["replay"]}, timeout=30).raise_for_status()
        wait_ok(f"{router}/ready", rp, rlog, 30)
        time.sleep(1.0)  # let the SUB sockets finish connecting before the first event
        print(f"router: Dynamo select_service at {router}; replicas: "
              + ", ".join(f"{r['id']}={r['base']}" for r in replicas) + f"; logs in {logs}")

        def tokenize(text: str) -> list[int]:
            resp = httpx.post(f"{replicas[0]['base']}/tokenize",
                              json={"model": MODEL, "prompt": text}, timeout=30)
            return list(resp.raise_for_status().json()["tokens"])

        def complete(base: str, ids: list[int]) -> None:
            httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": ids,
                                                        "max_tokens": 4}, timeout=300
                       ).raise_for_status()

        def route(ids: list[int], tag: str) -> dict:
            """Select (booking load), send to the chosen replica, report the lifecycle."""
            sel = httpx.post(f"{router}/select_and_reserve", json={
                "selection_id": tag, "model_name": MODEL, "token_ids": ids}, timeout=30)
            choice = sel.raise_for_status().json()
            complete(choice["endpoint"], ids)
            httpx.post(f"{router}/reservations/{tag}/prefill_complete", timeout=30)
            httpx.delete(f"{router}/reservations/{tag}", timeout=30)
            return choice

        stories = {1: "In a quiet harbour town the lighthouse keeper wrote a letter every "
                      "evening to the sailors who had never come home from the northern sea. ",
                   2: "The mountain observatory kept its telescopes pointed at a faint comet "
                      "while the astronomers argued over coffee about the age of the stars. "}
        ok = True
        for holder in (2, 1):  # warm replica 2 first, so a tie-break on 1 cannot pass for it
            r = replicas[holder - 1]
            prefix = tokenize(stories[holder] * 3)
            complete(r["base"], prefix + tokenize(" And so it began."))  # direct, not routed
            time.sleep(0.5)  # the BlockStored batch reaches the router
            before = {x["id"]: prefix_hits(x["base"]) for x in replicas}
            choice = route(prefix + tokenize(" Years later, nobody remembered why."),
                           f"shared-{holder}")
            hits = {x["id"]: prefix_hits(x["base"]) - before[x["id"]] for x in replicas}
            good = choice["worker_id"] == holder
            ok &= good
            print(f"prefix held by replica {holder} ({len(prefix)} tokens): router chose replica "
                  f"{choice['worker_id']} ({choice['endpoint']}), overlap "
                  f"{choice['overlap']['gpu']} tokens; prefix-cache hit tokens per replica "
                  f"{hits} -> {'OK' if good else 'WRONG REPLICA'}")
        control = tokenize("Completely unrelated: a recipe for lentil soup with cumin, "
                           "carrots, onions and a squeeze of lemon at the very end. " * 2)
        sel = httpx.post(f"{router}/select", json={"model_name": MODEL, "token_ids": control},
                         timeout=30).raise_for_status().json()
        ok &= sel["overlap"]["gpu"] == 0
        print(f"control prompt sharing no prefix: overlap {sel['overlap']['gpu']} tokens "
              f"(load-based pick: replica {sel['worker_id']})")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
