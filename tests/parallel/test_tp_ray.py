"""Tensor parallelism across two Ray nodes: ``distributed_executor_backend="ray"``.

A real local two-node Ray cluster on this machine -- ``ray start --head`` with no CPUs of its
own (this process, the driver, is rank 0 on it) and a second ``ray start --address`` node with
one CPU -- so rank 1's actor can only be placed on the second node. Greedy outputs equal TP=1's;
the placement group's bundle sits on the other node; a Ray address nobody listens on is refused
naming ``ray_address``; a rank whose actor is killed fails the requests, no hang.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from pagedhybrid.engine import SamplingParams
from pagedhybrid.errors import ContractViolation
from pagedhybrid.serve.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox", "And the children of Israel went up out of Egypt, and"]
OPTS = {"dtype": "float32", "num_blocks": 32, "max_num_seqs": 2}
RAY = str(Path(sys.executable).parent / "ray")
# a throw-away cluster on this machine: no token authentication (Ray 2.5x turns it on for
# clusters started by `ray start`; a real deployment keeps it and shares ~/.ray/auth_token)
AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
ENV = {**os.environ, **AUTH}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(args: list[str], log: Path) -> subprocess.Popen[str]:
    """One ``ray start --block`` node (SIGTERM stops it and all it started)."""
    proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats",
                             "--object-store-memory", str(100 << 20), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=ENV)
    deadline = time.time() + 120
    while "block forever" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"ray start failed: {log.read_text()[-4000:]}")
        time.sleep(0.3)
    return proc


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("ray-nodes")
    saved = {k: os.environ.get(k) for k in AUTH}
    os.environ.update(AUTH)  # this process is the driver
    temp = tempfile.mkdtemp(prefix="phtp-", dir="/tmp")  # short: Ray's socket paths
    gcs = _port()
    nodes = [_node(["--head", "--num-cpus", "0", "--port", str(gcs), "--temp-dir", temp,
                    "--include-dashboard", "false", "--ray-client-server-port", str(_port()),
                    "--dashboard-agent-listen-port", str(_port())], logs / "head.log")]
    try:
        nodes.append(_node(["--address", f"127.0.0.1:{gcs}", "--num-cpus", "1",
                            "--dashboard-agent-listen-port", str(_port())], logs / "node2.log"))
        yield f"127.0.0.1:{gcs}"
    finally:
        ray.shutdown()
        for n in reversed(nodes):
            n.send_signal(signal.SIGTERM)
            n.wait(120)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_tp2_across_two_ray_nodes_equals_tp1(two_nodes: str) -> None:
    want = [list(o.token_ids) for o in LLM(None, **OPTS).generate(PROMPTS, GREEDY,
                                                                    use_progress=False)]
    with LLM(None, tensor_parallel_size=2, distributed_executor_backend="ray",
             ray_address=two_nodes, **OPTS) as llm:
        peers = llm.engine.runner.peers
        assert peers is not None and peers.executor == "ray"
        driver = ray.get_runtime_context().get_node_id()
        (bundle_node,) = ray.util.placement_group_table(peers.placement)[
            "bundles_to_node_id"].values()
        assert bundle_node != driver  # rank 1 runs on the other node
        outs = llm.generate(PROMPTS, GREEDY, use_progress=False)
        assert [list(o.token_ids) for o in outs] == want
        (state,) = peers.check()
        assert state["steps"] == llm.engine.stats.steps
        # the rank's actor dies: the requests fail naming it, the engine is dead, no hang
        llm.engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=200,
                                                               ignore_eos=True))
        llm.engine.step()
        ray.kill(peers.ranks[0].actor)
        t0 = time.monotonic()
        outs = []
        while llm.engine.has_unfinished_requests() and time.monotonic() - t0 < 60:
            outs.extend(llm.engine.step())
        assert outs and outs[-1].finish_reason == "error"
        assert "tensor-parallel rank 1" in (outs[-1].error or ""), outs[-1].error
        assert llm.engine.dead is not None


def test_an_unreachable_ray_address_is_refused_by_name() -> None:
    with pytest.raises(ContractViolation, match="ray_address"):
        LLM(None, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_address=f"127.0.0.1:{_port()}", **OPTS)
