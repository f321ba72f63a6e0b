"""The native MoE kernel vs a per-expert torch loop and vs ONNX Runtime's CPU MoE kernel.

    python benchmarks/moe.py [--quick] [--reps R] [--out PATH]

One MoE block's routed experts (the router's logits given), in fp32 and in half precision (ours
bf16 weights and activations, as a bf16 checkpoint is served; ORT float16, its only
half-precision CPU MoE): per geometry and batch of tokens, medians of ``--reps`` runs after a
warm-up, all systems in one process, alternating:

* ``native``    -- pagedhybrid's kernel as the model calls it (``kernels/native/moe.py``): fp32
  softmax, top-k and renormalisation in torch, then the experts in one call (tokens sorted by
  expert once, each expert's rows multiplied in place, weighted rows summed back per token);
* ``native_inv`` -- the same kernel's batch-invariant form (streaming products only);
* ``native+shared`` -- with the shared expert and its gate fused into the same call (the model's
  form; not comparable with the others, which leave the shared expert out);
* ``torch_loop`` -- the grouped torch path (``layers.Experts``: one stable sort, then a Python
  loop over the experts with ``F.linear`` per expert, ``index_add_`` back), after the same
  router;
* ``ort``       -- a one-node ``com.microsoft.MoE`` graph in onnxruntime's CPU EP (session built
  once, same thread count; inputs bound as numpy): the op does its own softmax, top-k and
  renormalisation from the logits (attributes as the export writes them, ``export/moe.py``).

Geometries: the benchmark model's layer (``benchmarks/engine.py --moe``: hidden 512, 64 experts
of 160, top-8) and a Qwen3.5-35B-A3B layer (hidden 2048, 256 experts of 512, top-8; fp32
weights, 3.2 GB per copy). Batches 1, 16, 64, 512 tokens (``--quick``: 1, 16, 128 and the small
geometry plus the 35B-A3B layer at batch 16). Not a test: no assertions on timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedhybrid.kernels.native import moe, status
from pagedhybrid.models.qwen35.layers import Experts, route

GEOMETRIES = {  # hidden, experts, intermediate, top-k, shared intermediate
    "bench-154M": (512, 64, 160, 8, 256),
    "35B-A3B": (2048, 256, 512, 8, 512),
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def ort_session(gate_up: torch.Tensor, down: torch.Tensor, k: int, folder: Path) -> Any:
    """A one-node com.microsoft.MoE session over the experts' weights (fp32), the model and
    its weights (external data: a 35B-A3B layer is over protobuf's 2 GB) in ``folder``."""
    import onnx
    import onnxruntime as ort

    from pagedhybrid.export.moe import single_moe_model  # the export's node, attributes and all

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    # its threads would spin after each run and hold the cores the next system runs on
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    onnx.save_model(single_moe_model(gate_up.numpy(), down.numpy(), k, external=folder),
                    str(folder / "moe.onnx"))
    return ort.InferenceSession(str(folder / "moe.onnx"), opts,
                                providers=["CPUExecutionProvider"])


def timed(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median ms of each, the systems alternating within every repetition."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    return {n: 1e3 * statistics.median(v) for n, v in times.items()}


def systems(x: torch.Tensor, logits: torch.Tensor, k: int, gate_up: torch.Tensor,
            down: torch.Tensor, shared: tuple[torch.Tensor, ...], loop: Experts,
            session: Any) -> dict[str, Callable[[], Any]]:
    """Each system's call on one batch (``x`` [T, H], the router's ``logits`` [T, E])."""
    fns: dict[str, Callable[[], Any]] = {
        "native": lambda: moe.experts(x, *route(logits, k), gate_up, down),
        "native_inv": lambda: moe.experts(x, *route(logits, k), gate_up, down, invariant=True),
        "native+shared": lambda: moe.experts(x, *route(logits, k), gate_up, down, shared),
        "torch_loop": lambda: loop(x, *route(logits, k)),
    }
    if session is not None:
        half = torch.float16 if x.dtype != torch.float32 else torch.float32
        feed = {"input": x.to(half).numpy(), "router_probs": logits.to(half).numpy()}
        fns["ort"] = lambda: session.run(None, feed)
    return fns


def bench(name: str, batches: list[int], reps: int, with_ort: bool, half: bool
          ) -> list[dict[str, Any]]:
    hidden, experts, inter, k, shared_inter = GEOMETRIES[name]
    dtype = torch.bfloat16 if half else torch.float32
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    shared = tuple(t.to(dtype) for t in (
        torch.randn(shared_inter, hidden, generator=g) / hidden ** 0.5,
        torch.randn(shared_inter, hidden, generator=g) / hidden ** 0.5,
        torch.randn(hidden, shared_inter, generator=g) / shared_inter ** 0.5,
        torch.randn(1, hidden, generator=g) / hidden ** 0.5))
    loop = Experts(experts, hidden, inter, dtype)
    loop.gate_up_proj.data, loop.down_proj.data = gate_up, down
    folder = Path(tempfile.mkdtemp(prefix="ph-moe-"))
    # ORT's CPU MoE has no bfloat16 kernel: its half-precision form is float16
    ort_dtype = torch.float16 if half else torch.float32
    session = (ort_session(gate_up.to(ort_dtype), down.to(ort_dtype), k, folder)
               if with_ort else None)
    rows = []
    for tokens in batches:
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        logits = torch.randn(tokens, experts, generator=g).to(dtype)
        fns = systems(x, logits, k, gate_up, down, shared, loop, session)
        if session is not None:
            got = torch.from_numpy(fns["ort"]()[0]).float()
            err = float((got - fns["native"]().float()).abs().max())
        ms = timed(fns, reps)
        row = {"geometry": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
               "ms": ms,
               "native_vs_torch_loop": ms["torch_loop"] / ms["native"]}
        if session is not None:
            row["native_vs_ort"] = ms["ort"] / ms["native"]
            row["max_abs_diff_vs_ort"] = err
        rows.append(row)
        print(f"{name:11s} {row['dtype']:8s} T={tokens:4d} "
              + " ".join(f"{n} {v:8.2f}" for n, v in ms.items())
              + f"  x loop {row['native_vs_torch_loop']:.2f}"
              + (f"  x ort {row['native_vs_ort']:.2f} (|diff| {err:.1e})"
                 if session is not None else ""), flush=True)
    del session
    shutil.rmtree(folder)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--no-ort", action="store_true")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="fp32 and/or bf16 (ours bf16, ORT float16: it has no bf16 CPU MoE)")
    p.add_argument("--out", default="benchmarks/results/moe.json")
    a = p.parse_args(argv)
    st = status()
    print(f"CPU: {cpu_name()}; native form {st.isa}; torch threads {torch.get_num_threads()}")
    plan = ({"bench-154M": [1, 16, 128], "35B-A3B": [16]} if a.quick else
            {"bench-154M": [1, 16, 64, 512], "35B-A3B": [1, 16, 64, 512]})
    rows = [r for d in a.dtypes.split(",") for name, batches in plan.items()
            for r in bench(name, batches, a.reps, not a.no_ort, d == "bf16")]
    doc = {"benchmark": "moe", "cpu": cpu_name(), "form": st.isa,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "numpy": np.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
