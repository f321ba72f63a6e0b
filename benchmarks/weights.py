"""Weights in 16, 8 and 4 bits: speed per format against llama.cpp, memory bandwidth, quality.

Speed, on the 141M random hybrid of ``benchmarks/engine.py`` (hidden 1024, 8 layers, vocab 32k,
tied embeddings; ``latency.write_small_model``), per format, ``--threads`` threads (default 2):

* ``pp512`` -- one 512-token prompt prefilled (``max_tokens=1``, no prefix cache): prompt tok/s;
* ``tg128`` -- one request decoding 128 tokens after a 16-token prompt: (tokens - 1) / (time of
  the last token - time of the first), i.e. decode alone, as llama-bench's tg;
* ``b8`` / ``b32`` -- 8 / 32 requests of 128-token prompts decoding 128 tokens each, queued at
  once: the tokens generated after every request has its first one, over that time (decode
  throughput, as llama-batched-bench's S_TG with ``-npp 128 -ntg 128``).

Each figure is the median of ``--reps`` runs. Ours: ``fp32``, ``bf16`` (16-bit weights and
activations), ``int8`` (per channel) and ``int4`` (block 32; ``--formats`` to change), all with
fp32 activations except bf16. llama.cpp (``benchmarks/llama_cpp.py``, when built with
``scripts/build_llama_cpp.sh``): its own GGUF conversion of the same checkpoint in ``f32``,
``bf16``, ``q8_0``, ``q4_0`` and ``q4_K_M``, ``llama-bench`` pp512 / tg128 and
``llama-batched-bench`` at 8 and 32 sequences, same threads, in the same run (formats
alternate: ours, then llama.cpp's at the same bits). Each llama.cpp tool runs with its extra
buffer types (repacked layouts, AMX) and, where it crashes with them (``llama_cpp.py``: its AMX
kernels on a Xeon with AMX-INT8), again without; the report's ``repacked`` says which.

Memory-bandwidth limit: the bytes of weights a decode step reads per token at batch 1 (every
projection and the LM head as held: codes + scales for int8 / int4; the embedding row is
negligible) against the machine's copy bandwidth (``torch`` copy of 512 MiB, read + write bytes
/ time, median of 5): ``limit = bandwidth / bytes``; ``tg128 / limit`` is the share reached.

Quality, on the trained built-in model: held-out perplexity (``pagedhybrid.perplexity``, the
first ``--ppl-tokens`` tokens of ``heldout.txt``, context 512, stride 256) and greedy agreement
with the fp32 model (32 held-out passages of 32 tokens, 32 greedy tokens each: the share of
continuations identical to fp32's, and the mean share of tokens before the first difference);
llama.cpp's ``llama-perplexity`` on the same text per GGUF format when built.

    python benchmarks/weights.py --quick
    python benchmarks/weights.py                 # writes benchmarks/results/weights.json
"""

from __future__ import annotations

# isort: off
import pagedhybrid  # noqa: F401 -- first: it sets OpenMP's spin before torch loads
# isort: on

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

OURS = ("fp32", "bf16", "int8", "int4")
PEERS = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # same bits
EXTRA_PEERS = ("q4_K_M",)


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write)."""
    src = torch.ones(mib << 18)  # fp32: mib MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def weight_bytes(model: Any) -> int:
    """Bytes of projection weights (and the LM head) one decode step reads."""
    from pagedhybrid.parallel.linear import ReplicatedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, ReplicatedLinear):
            w = m.weight
            total += m.quant.nbytes if m.quant is not None else w.numel() * w.element_size()
    return total


def _engine(model_dir: Path, fmt: str, **kw: Any) -> Any:
    from pagedhybrid.engine.loader import load_engine

    dtype = "bfloat16" if fmt == "bf16" else "float32"
    quant = None if fmt in ("fp32", "bf16") else fmt
    return load_engine(model_dir, dtype=dtype, quantization=quant, enable_prefix_caching=False,
                       max_num_seqs=32, max_num_batched_tokens=512, num_blocks=512, **kw)


def ours_speed(model_dir: Path, fmt: str, vocab: int, reps: int, rng: random.Random
               ) -> dict[str, Any]:
    from pagedhybrid.engine import SamplingParams

    engine = _engine(model_dir, fmt)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def run(prompts: list[list[int]], n: int) -> tuple[float, list[list[float]]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        stamps: dict[str, list[float]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
            stamps[f"r{i}"] = []
        t0 = time.perf_counter()
        for out in engine.stream():
            stamps[out.request_id].extend([time.perf_counter()] * len(out.new_token_ids))
        return time.perf_counter() - t0, list(stamps.values())

    run([prompt(16)], 8)  # warm-up
    pp, tg, b8, b32 = [], [], [], []
    for _ in range(reps):
        secs, _ = run([prompt(512)], 1)
        pp.append(512 / secs)
        _, (st,) = run([prompt(16)], 128)
        tg.append((len(st) - 1) / (st[-1] - st[0]))
        for n, acc in ((8, b8), (32, b32)):
            _, sts = run([prompt(128) for _ in range(n)], 128)
            start = max(s[0] for s in sts)  # every request decoding
            end = max(s[-1] for s in sts)
            acc.append(sum(sum(t > start for t in s) for s in sts) / (end - start))
    return {"pp512": statistics.median(pp), "tg128": statistics.median(tg),
            "b8": statistics.median(b8), "b32": statistics.median(b32),
            "weight_bytes": weight_bytes(engine.model), "kernels": engine.runner.kernel_summary()}


def gguf(model_dir: Path, qtype: str, folder: Path, made: dict[str, Path]) -> Path:
    """llama.cpp's own conversion of ``model_dir`` in ``qtype`` (q4_0 / q4_K_M quantised from
    its f32 file, which ``made`` caches)."""
    import llama_cpp

    out = folder / f"{qtype}.gguf"
    if qtype in llama_cpp.OUTTYPES:
        return llama_cpp.convert(model_dir, qtype, out)
    if "f32" not in made:
        made["f32"] = llama_cpp.convert(model_dir, "f32", folder / "f32.gguf")
    return llama_cpp.quantize(made["f32"], qtype, out)


def repacked(call: Any, *args: Any, **kw: Any) -> tuple[Any, bool]:
    """(call(..., repack=True), True), or -- where that crashes (llama.cpp's AMX kernels on an
    AMX Xeon: ``llama_cpp.py``'s ``repack``) -- (call(..., repack=False), False)."""
    import llama_cpp

    try:
        return call(*args, **kw), True
    except llama_cpp.LlamaCppError as e:
        if not e.crashed:
            raise
        print(f"  llama.cpp crashed, run again with --no-repack: {str(e).splitlines()[0]}",
              flush=True)
        return call(*args, **kw, repack=False), False


def peer_speed(path: Path, threads: int, reps: int) -> dict[str, Any]:
    """llama.cpp's pp512 / tg128 (separate llama-bench runs, so that a prompt crash does not
    take the decode's repacked layout away) and batched decode; ``repacked`` says which ran with
    llama.cpp's extra buffer types."""
    import llama_cpp

    tg, tg_r = repacked(llama_cpp.bench, path, threads=threads, pp=0, reps=reps)
    pp, pp_r = repacked(llama_cpp.bench, path, threads=threads, tg=0, reps=reps)
    b, b_r = repacked(llama_cpp.batched, path, threads=threads, n_parallel=(8, 32))
    return {"pp512": pp["pp_median"], "tg128": tg["tg_median"], "b8": b[8]["tg"],
            "b32": b[32]["tg"], "file_bytes": path.stat().st_size, "type": tg["type"],
            "repacked": {"pp512": pp_r, "tg128": tg_r, "batched": b_r}}


def ours_quality(fmt: str, tokens: int, ids: list[int], passages: list[list[int]],
                 reference: list[list[int]] | None) -> tuple[dict[str, Any], list[list[int]]]:
    from pagedhybrid.engine import SamplingParams
    from pagedhybrid.models.qwen35 import default_model_dir
    from pagedhybrid.perplexity import engine_perplexity

    engine = _engine(default_model_dir(), fmt)
    ppl = engine_perplexity(engine, ids[:tokens], 512, 256).perplexity
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(passages):
        engine.add_request(f"g{i}", p, params)
    got: dict[str, list[int]] = {}
    for out in engine.stream():
        if out.finished:
            got[out.request_id] = list(out.token_ids)
    gen = [got[f"g{i}"] for i in range(len(passages))]
    row: dict[str, Any] = {"perplexity": ppl}
    if reference is not None:
        same = [a == b for a, b in zip(gen, reference, strict=True)]
        prefix = []
        for a, b in zip(gen, reference, strict=True):
            k = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefix.append(k / len(a))
        row["greedy_identical"] = sum(same) / len(same)
        row["greedy_prefix"] = statistics.fmean(prefix)
    return row, gen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(OURS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ppl-tokens", type=int, default=12000)
    p.add_argument("--quick", action="store_true", help="1 rep, 4000 perplexity tokens")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "weights.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.ppl_tokens = 1, 4000
    torch.set_num_threads(a.threads)
    import llama_cpp
    from latency import cpu_line, write_small_model
    from pagedhybrid.kernels import native
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    report: dict[str, Any] = {"cpu": cpu_line(), "native_form": native.status().form,
                              "threads": a.threads, "reps": a.reps}
    print(report["cpu"], "| native form:", report["native_form"], flush=True)
    bw = copy_bandwidth()
    report["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write)", flush=True)
    peer = None if a.no_llama_cpp else llama_cpp.find()
    if peer is None and not a.no_llama_cpp:
        print("llama.cpp not built (scripts/build_llama_cpp.sh): ours only", flush=True)
    rng = random.Random(0)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        write_small_model(small, default_model_dir(), seed=0)
        from pagedhybrid.models.qwen35 import Qwen35Config

        vocab = Qwen35Config.from_model_dir(small).vocab_size
        ggufs: dict[str, Path] = {}
        for fmt in formats:
            r = ours_speed(small, fmt, vocab, a.reps, rng)
            r["bandwidth_limit_tg"] = bw / r["weight_bytes"]
            r["tg_share_of_limit"] = r["tg128"] / r["bandwidth_limit_tg"]
            rows[f"ours {fmt}"] = r
            print(f"ours {fmt:6s} pp512 {r['pp512']:7.1f}  tg128 {r['tg128']:6.1f}  "
                  f"b8 {r['b8']:6.1f}  b32 {r['b32']:6.1f} tok/s  weights "
                  f"{r['weight_bytes'] / 2**20:6.1f} MiB  limit {r['bandwidth_limit_tg']:6.1f} "
                  f"({100 * r['tg_share_of_limit']:.0f}%)", flush=True)
            qtype = PEERS.get(fmt.split(":")[0] if fmt.startswith("int") else fmt)
            peers = [qtype] if qtype is not None else []
            if fmt == formats[-1]:
                peers += list(EXTRA_PEERS)
            for qt in peers if peer is not None else []:
                ggufs[qt] = gguf(small, qt, Path(tmp) / "small-gguf", ggufs)
                rows[f"llama.cpp {qt}"] = lr = peer_speed(ggufs[qt], a.threads, a.reps)
                print(f"llama.cpp {qt:6s} pp512 {lr['pp512']:7.1f}  tg128 {lr['tg128']:6.1f}  "
                      f"b8 {lr['b8']:6.1f}  b32 {lr['b32']:6.1f} tok/s  file "
                      f"{lr['file_bytes'] / 2**20:6.1f} MiB  repacked {lr['repacked']}",
                      flush=True)
        report["speed"] = rows
        # quality on the trained built-in model
        tok = load_tokenizer(default_model_dir())
        text = heldout_text_path().read_text(encoding="utf-8")
        ids = tok.encode(text)
        qrng = random.Random(1)
        passages = []
        for _ in range(32):
            s = qrng.randrange(1, len(ids) - 40)
            passages.append(ids[s:s + 32])
        quality: dict[str, Any] = {}
        reference = None
        for fmt in ["fp32", *[f for f in formats if f != "fp32"]]:
            row, gen = ours_quality(fmt, a.ppl_tokens, ids, passages, reference)
            reference = reference or gen
            quality[f"ours {fmt}"] = row
            print(f"quality ours {fmt}: {row}", flush=True)
        if peer is not None:
            head = Path(tmp) / "heldout-head.txt"
            head.write_text(tok.decode(ids[:a.ppl_tokens]), encoding="utf-8")
            built: dict[str, Path] = {}
            for qtype in ("f32", "bf16", "q8_0", "q4_0", "q4_K_M"):
                g = gguf(default_model_dir(), qtype, Path(tmp) / "builtin-gguf", built)
                built[qtype] = g
                ppl, rp = repacked(llama_cpp.perplexity, g, head)
                quality[f"llama.cpp {qtype}"] = {"perplexity": ppl, "repacked": rp}
                print(f"quality llama.cpp {qtype}: {quality[f'llama.cpp {qtype}']}", flush=True)
        report["quality"] = quality
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
