"""Where a decode step of a 27B-class hybrid layer stack spends its time, per op.

The stack has the real Qwen3.5-27B / Qwen3.8 attention and Gated DeltaNet head counts (24 query
/ 4 KV heads of 256 with partial interleaved MRoPE; 16 key / 48 value heads of 128, conv kernel
4) in 16 layers with ``full_attention_interval`` 4 (12 Gated DeltaNet + 4 full attention),
scaled to fit memory by a narrower residual stream (``--hidden``, default 2048) and MLP
(``--intermediate``, default 4096); random weights. ``--batch`` sequences of ``--context``
tokens are prefilled, then decode steps are timed and profiled with ``torch.profiler``; the
table groups self CPU time by op.

Only the public model API is used (``build``, ``PagedHybridCache.allocate``,
``PackedBatch.from_sequences``, ``forward_packed``), so the same script profiles an older tree
(``PYTHONPATH=/path/to/old/src python benchmarks/decode_profile.py``) for a before/after table.
``forward_packed`` is the eager executor (the model's modules, op by op, the fused Gated DeltaNet
mixer included): the engine's decode steps run the graph or layers executor
(``engine/worker/executors.py``), whose fused calls show as one op each; this table is where the
ops' own time goes.

    python benchmarks/decode_profile.py [--dtype bf16] [--batch 16] [--context 2048]

``--published 0.8B`` (or ``2B``) profiles the published checkpoint's whole geometry instead
(``synthetic.PUBLISHED``: 24 layers, 8 query / 2 KV heads of 256, 16 / 16 GDN heads of 128,
the 248,320-token tied output projection), so the table shows the share of the vocabulary.

The native kernels run in the CPU form ``kernels.native.status()`` picks (printed; force one with
``PAGEDHYBRID_CPU_FEATURES=avx512_bf16|avx512|avx2``). ``--linear native`` multiplies every
projection with ``kernels.native.dense.linear`` (fp32 registers; bf16 weights widened) instead
of ``torch.nn.functional.linear``; with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` torch's GEMMs run
as on a CPU without AVX512-BF16. ``--busy N`` runs N busy-looping processes beside the benchmark
(cores shared with another job).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def config(hidden: int, intermediate: int):  # -> Qwen35Config
    from pagedhybrid.models.qwen35 import Qwen35Config

    layers = 16
    return Qwen35Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(layers)),
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=48, rope_theta=1e7,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), mrope_interleaved=True,
        tie_word_embeddings=False, max_position_embeddings=32768)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--published", choices=["0.8B", "2B"], default=None,
                    help="the whole published geometry instead of the scaled 27B stack")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--linear", choices=["torch", "native"], default="torch")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the run")
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", default="benchmarks/results/decode_profile.json")
    a = ap.parse_args()
    from torch.profiler import profile

    from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, build

    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.published:
        from pagedhybrid.models.qwen35.synthetic import PUBLISHED
        cfg = PUBLISHED[a.published]
    else:
        cfg = config(a.hidden, a.intermediate)
    model = build(cfg, dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if p.dim() > 1 else 0.1
            p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    model.eval()
    _ = model.backend  # selected now, so a --linear override below stays
    try:
        from pagedhybrid.kernels.native import cpu_form
        form = cpu_form()
    except ImportError:  # an older tree
        from pagedhybrid.kernels.native import status
        form = str(status().isa)
    if a.linear == "native":
        from pagedhybrid.kernels.native import dense
        for m in model.modules():
            if hasattr(m, "matmul"):
                m.matmul = dense.linear
    bs = 16
    pages = -(-(a.context + a.steps + 1) // bs)
    cache = PagedHybridCache.allocate(cfg, num_pages=a.batch * pages, block_size=bs,
                                      num_slots=a.batch, dtype=dtype)
    tables = [list(range(b * pages, (b + 1) * pages)) for b in range(a.batch)]
    slots = list(range(a.batch))
    # prefill in chunks (not timed)
    done = 0
    chunk = 512
    while done < a.context:
        n = min(chunk, a.context - done)
        toks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
                for _ in range(a.batch)]
        for b0 in range(0, a.batch, 4):  # 4 sequences per prefill step keeps memory small
            sl = slice(b0, b0 + 4)
            batch = PackedBatch.from_sequences(toks[sl], [done] * len(toks[sl]), tables[sl],
                                               slots[sl])
            model.forward_packed(batch, cache, batch.last_token_rows())
        done += n
    times = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]

    def step(pos: int) -> None:
        toks = [[int(torch.randint(0, cfg.vocab_size, (1,), generator=gen))]
                for _ in range(a.batch)]
        batch = PackedBatch.from_sequences(toks, [pos] * a.batch, tables, slots)
        model.forward_packed(batch, cache, batch.last_token_rows())

    step(a.context)
    for s in range(a.steps):
        t0 = time.perf_counter()
        step(a.context + 1 + s)
        times.append(time.perf_counter() - t0)
    with profile() as prof:
        step(a.context + 1 + a.steps)
    for p in busy:
        p.kill()
        p.wait()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    table = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3,
              "share": e.self_cpu_time_total / total, "calls": e.count} for e in rows[:20]]
    median = statistics.median(times)
    shape = (f"Qwen3.5-{a.published} geometry (24 layers, vocab {cfg.vocab_size})"
             if a.published else f"16 layers (12 GDN + 4 full), hidden {a.hidden}")
    print(f"# {a.label}: decode step B={a.batch} ctx={a.context} {a.dtype}, {shape}, "
          f"{a.threads} threads, {a.busy} busy, kernels "
          f"{form}, linear {a.linear}: median {median * 1e3:.1f} ms/step (min "
          f"{min(times) * 1e3:.1f}; {a.batch / median:.1f} tok/s)")
    print(f"{'op':55s} {'self ms':>9s} {'share':>7s} {'calls':>6s}")
    for r in table:
        print(f"{r['op'][:55]:55s} {r['self_ms']:9.2f} {100 * r['share']:6.1f}% {r['calls']:6d}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {}
    doc[a.label] = {"args": vars(a), "form": form, "median_step_ms": median * 1e3,
                    "min_step_ms": min(times) * 1e3, "ops": table}
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
