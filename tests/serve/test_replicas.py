"""``pagedhybrid serve --replicas 2`` end to end: a real Ray cluster (``ray start --head``, 2
CPUs), the real launcher process, two real ``pagedhybrid serve`` replicas under Ray Serve, the
real ``openai`` client against the one endpoint.

One cluster for the module and one prefix-routed server for most tests (a launch takes ~20 s
on two cores); the last test stops it (SIGTERM: exit 0, no server left) and measures the same
shared-prefix workload under random routing for the comparison.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedhybrid.serve.replica_metrics import parse_totals

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MODEL = "default-model"
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range: kept clear
# RAY_AUTH_MODE: a ~/.ray/auth_token (left by any local ray.init) would otherwise turn token
# authentication on for `ray start` but not for the clients that connect to it
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_AUTH_MODE": "disabled"}


def port() -> int:
    """A free port outside Ray's worker port range."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p not in RAY_WORKER_PORTS:
            return p


def run_launcher(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedhybrid", "serve", *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout, check=False)


@dataclass
class Replicated:
    proc: subprocess.Popen[str]
    base: str
    log: Path

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0,
                             timeout=120)

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=60).text

    def servers(self) -> dict[str, int]:
        """Replica id -> its ``pagedhybrid serve`` pid (``pagedhybrid:replica_info``)."""
        return {m["replica"]: int(m["pid"]) for m in re.finditer(
            r'replica_info\{node="[^"]*",pid="(?P<pid>\d+)",port="\d+",'
            r'replica="(?P<replica>[^"]+)"\}', self.metrics())}

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)
        return int(self.proc.returncode)


def launch(tmp: Path, address: str, *args: str) -> Replicated:
    p = port()
    log = tmp / f"replicas-{p}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedhybrid", "serve", "--replicas", "2", "--ray-address", address,
         "--port", str(p), "--served-model-name", MODEL, "--dtype", "float32",
         "--max-num-seqs", "4", "--num-blocks", "128", "--health-check-period", "1",
         "--health-check-timeout", "10", *args],
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=ENV)
    r = Replicated(proc, f"http://127.0.0.1:{p}", log)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited: {log.read_text()[-6000:]}")
        try:
            h = httpx.get(f"{r.base}/health", timeout=10)  # ok: every replica routed to
            if h.status_code == 200 and h.json()["status"] == "ok":
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    r.stop()
    raise AssertionError(f"the replicas did not come up: {log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 2-CPU Ray head node of this machine (``ray start --head --block``: SIGTERM stops it
    and everything it started)."""
    temp = tempfile.mkdtemp(prefix="phray-", dir="/tmp")  # short: Ray's socket paths
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    gcs = port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
         "--num-cpus", "2", "--port", str(gcs), "--temp-dir", temp, "--disable-usage-stats",
         "--include-dashboard", "false", "--object-store-memory", str(200 << 20),
         "--ray-client-server-port", str(port()), "--dashboard-port", str(port()),
         "--dashboard-agent-listen-port", str(port())],
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        deadline = time.time() + 120
        while "block forever" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"ray start failed: {log.read_text()[-4000:]}")
            time.sleep(0.3)
        yield f"127.0.0.1:{gcs}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def served(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicated]:
    r = launch(tmp_path_factory.mktemp("replicas"), ray_cluster)
    yield r
    r.stop()


def gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


# -- refusals at start ---------------------------------------------------------------------------
def test_an_unreachable_ray_address_is_a_typed_error_naming_the_option() -> None:
    done = run_launcher("--replicas", "2", "--ray-address", f"127.0.0.1:{port()}",
                        "--port", str(port()), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "error: --ray-address: the Ray cluster at 127.0.0.1:" in done.stderr
    assert "cannot be reached" in done.stderr


def test_more_replicas_than_the_cluster_has_cpus_is_refused(ray_cluster: str) -> None:
    done = run_launcher("--replicas", "3", "--ray-address", ray_cluster, "--port", str(port()))
    assert done.returncode == 2, done.stderr
    assert "error: --replicas: 3 replicas x 1 CPU (--cpus-per-replica) need 3 CPUs; the Ray " \
        "cluster has 2" in done.stderr


# -- the one endpoint ----------------------------------------------------------------------------
def test_completions_chat_and_streams_through_the_one_endpoint(served: Replicated) -> None:
    client = served.client
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                     temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time",
                                         max_tokens=12, temperature=0, stream=True)
    chunks = [c.choices[0].text for c in streamed]
    assert len(chunks) > 1 and "".join(chunks) == done.choices[0].text  # chunk by chunk
    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0)
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
        if c.choices]
    assert "".join(deltas) == chat.choices[0].message.content
    # the server's own refusals pass through unchanged
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert httpx.get(f"{served.base}/nope", timeout=30).status_code == 404


def abort_and_length(r: Replicated) -> tuple[float, float, float]:
    text = r.metrics()
    abort = length = 0.0
    for line in text.splitlines():
        if line.startswith("pagedhybrid:request_success_total") and 'replica="all"' in line:
            if 'finished_reason="abort"' in line:
                abort += float(line.rsplit(" ", 1)[1])
            if 'finished_reason="length"' in line:
                length += float(line.rsplit(" ", 1)[1])
    return abort, length, parse_totals(text).get("pagedhybrid:num_requests_running", -1)


def wait_aborts(r: Replicated, aborts: float, length: float) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        a, n, running = abort_and_length(r)
        if a >= aborts and running == 0:
            assert n == length  # aborted, not run to its end
            return
        time.sleep(0.2)
    raise AssertionError(f"no upstream abort: {abort_and_length(r)}")


def test_a_client_disconnect_aborts_the_request_upstream(served: Replicated) -> None:
    aborts, length, _ = abort_and_length(served)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1000,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as h, h.stream(
            "POST", f"{served.base}/v1/completions", json={**body, "stream": True}) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # and hang up mid-stream
    wait_aborts(served, aborts + 1, length)
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting
        httpx.post(f"{served.base}/v1/completions", json=body, timeout=1.0)
    wait_aborts(served, aborts + 2, length)


def test_metrics_per_replica_and_aggregated(served: Replicated) -> None:
    for i in range(4):
        served.client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=3)
    text = served.metrics()
    replicas = sorted(served.servers())
    assert len(replicas) == 2 and "pagedhybrid:num_replicas 2.0" in text
    every = parse_totals(text)
    per = [parse_totals(text, r) for r in replicas]
    for name in ("pagedhybrid:prompt_tokens_total", "pagedhybrid:generation_tokens_total",
                 "pagedhybrid:prefix_cache_queries_total",
                 "pagedhybrid:e2e_request_latency_seconds_count"):
        assert every[name] == sum(p[name] for p in per) > 0, name
    assert 'pagedhybrid:router_requests_total{reason="' in text


def test_a_killed_replica_server_fails_its_health_and_is_replaced(served: Replicated) -> None:
    before = served.servers()
    victim, pid = sorted(before.items())[0]
    cores = children(pid)  # its engine process
    os.kill(pid, signal.SIGKILL)
    client = served.client
    answers = []
    for i in range(6):  # none hangs: served by the other replica, or a clean 503
        try:
            client.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=3)
            answers.append(200)
        except openai.APIStatusError as exc:
            answers.append(exc.status_code)
    assert set(answers) <= {200, 503}, answers
    assert gone(cores)  # the engine process followed its server
    deadline = time.time() + 240
    while time.time() < deadline:
        now = served.servers()
        if victim not in now and len(now) == 2:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"replica {victim} was not replaced: {served.servers()}")
    health = httpx.get(f"{served.base}/health", timeout=60).json()
    assert health["status"] == "ok" and victim not in health["replicas"], health
    assert client.completions.create(model=MODEL, prompt="Again", max_tokens=3).usage


# -- prefix-aware routing ------------------------------------------------------------------------
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango"]


def shared_prefix_hit_rate(r: Replicated, tag: str) -> float:
    """4 system prompts (~100 tokens: past the first state checkpoint at 64) x 4 questions, one
    after the other; the prefix cache's hit tokens / looked-up tokens over all replicas."""
    def system(k: int) -> str:
        rng = random.Random(f"{tag}-{k}")
        return f"You are assistant {tag} {k}. " + " ".join(rng.choice(WORDS) for _ in range(22))

    def totals() -> tuple[float, float]:
        t = parse_totals(r.metrics())
        return t["pagedhybrid:prefix_cache_hits_total"], t["pagedhybrid:prefix_cache_queries_total"]

    hits0, queries0 = totals()
    for q in range(4):
        for k in range(4):
            r.client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "system", "content": system(k)},
                {"role": "user", "content": f"Question {q}?"}])
    hits, queries = totals()
    return (hits - hits0) / (queries - queries0)


def test_prefix_routing_beats_random_routing_on_a_shared_prefix_workload(
        served: Replicated, ray_cluster: str, tmp_path: Path) -> None:
    prefix = shared_prefix_hit_rate(served, "p")
    pids = list(served.servers().values())
    assert served.stop() == 0  # SIGTERM: the replicas and their servers stop
    assert gone(pids), "a replica's server outlived the launcher"
    randomly = launch(tmp_path, ray_cluster, "--router", "random")
    try:
        rnd = shared_prefix_hit_rate(randomly, "r")
    finally:
        assert randomly.stop() == 0
    print(f"prefix-cache hit rate: prefix routing {prefix:.3f}, random routing {rnd:.3f}")
    assert prefix > rnd
