"""The checks that need a CUDA machine, in one run (onnxruntime-gpu 1.31.1 and
onnxruntime-genai-cuda 0.18.0 importable; writes ``$OUT/cuda_checks.json``):

1. ``tests/export/test_export_engine_cuda.py`` (skipped everywhere else): ``--ep cuda`` exports
   of the built-in model (fp16, bf16) run by the real genai Engine, overlapping requests equal
   to isolated ones and to the torch engine;
2. a Qwen3.5-27B-class geometry (every width of ``QWEN35_27B_TEXT_CONFIG``: hidden 5120, 24/4
   attention heads of 256, 16/48 linear heads of 128, FFN 17408; two layers, one of each kind,
   and a 4096-token vocabulary so that the random bf16 checkpoint is 1.6 GB) exported with
   ``--ep cuda`` and loaded and stepped by the CUDA Engine: overlapping requests equal isolated
   ones;
3. the built-in model exported with ``--mtp --state-update-capacity 4`` and without: the CUDA
   Engine's greedy tokens with MTP drafts equal those without, and its speculative statistics
   (drafts proposed / accepted, acceptance rate, forward passes, time).

    PYTHONPATH=src:tests/export python3 scripts/cuda_checks.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "."))
PROMPTS = ("And it came to pass after these things, that the king of Egypt spake unto his "
           "servants,", "Blessed are they", "The LORD is my shepherd; I shall not",
           "In the beginning God created the heaven and the earth.")


def check(name: str, fn: Callable[[], dict[str, Any]], report: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as exc:  # every check reports, whatever the others do
        report[name] = {"error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-3000:]}
    report[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(name, json.dumps(report[name])[:2000], flush=True)


def cuda_tests() -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/export/test_export_engine_cuda.py"], capture_output=True,
                       text=True, timeout=400)
    return {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-2500:]}


def geometry_27b() -> dict[str, Any]:
    import onnxruntime_genai as og
    import torch
    from genai_runner import run_schedule

    from pagedhybrid.export.options import ExportOptions
    from pagedhybrid.export.package import export_package
    from pagedhybrid.models.qwen35.config import QWEN35_27B_TEXT_CONFIG, Qwen35Config
    from pagedhybrid.models.qwen35.synthetic import per_layer, write_random_checkpoint

    cfg = per_layer(dataclasses.replace(Qwen35Config.from_dict(dict(QWEN35_27B_TEXT_CONFIG)),
                                        vocab_size=4096, mtp_num_hidden_layers=0))
    tmp = Path(tempfile.mkdtemp())
    write_random_checkpoint(tmp / "ckpt", cfg, 0, dtype=torch.bfloat16)
    opts = ExportOptions(ep="cuda", dtype="bf16", block_size=16, num_blocks=64,
                         max_batch_size=4)
    res = export_package(tmp / "ckpt", tmp / "pkg", opts)
    engine = og.Engine(og.Model(og.Config(str(tmp / "pkg"))))
    prompts = [[5 + i, 17, 300 + i, 42, 7] * (i + 1) for i in range(3)]
    overlapped, steps = run_schedule(engine, prompts, 8, [0, 0, 2])
    alone = [run_schedule(engine, [p], 8)[0][0] for p in prompts]
    return {"layers": list(cfg.layer_types), "hidden": cfg.hidden_size,
            "export_s": round(res.seconds, 1), "steps": steps,
            "overlapped_equals_alone": overlapped == alone, "tokens": overlapped}


def mtp_engine() -> dict[str, Any]:
    import onnxruntime_genai as og
    from genai_runner import run_schedule

    from pagedhybrid.export.options import ExportOptions
    from pagedhybrid.export.package import export_package
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    prompts = [tok.encode(p) for p in PROMPTS]
    tmp = Path(tempfile.mkdtemp())
    base = ExportOptions(ep="cuda", dtype="fp16", block_size=16, num_blocks=128,
                         max_batch_size=8)
    out: dict[str, Any] = {}
    tokens = {}
    for side, opts in (("off", base),
                       ("mtp", dataclasses.replace(base, mtp=True, state_update_capacity=4))):
        export_package(default_model_dir(), tmp / side, opts)
        engine = og.Engine(og.Model(og.Config(str(tmp / side))))
        run_schedule(engine, [prompts[0]], 4)  # warm-up
        t0 = time.perf_counter()
        single = [run_schedule(engine, [p], 48)[0][0] for p in prompts]
        t1 = time.perf_counter()
        batch, steps = run_schedule(engine, prompts, 48)
        tokens[side] = (single, batch)
        stats = engine.get_speculative_stats()
        out[side] = {"single_s": round(t1 - t0, 3), "batch_steps": steps,
                     "stats": {k: stats[k] for k in (
                         "rounds", "draft_tokens_proposed", "draft_tokens_accepted",
                         "acceptance_rate", "draft_forward_passes", "target_forward_passes",
                         "mtp_failures", "acceptance_length_histogram", "observed_speedup")}}
    out["mtp_tokens_equal"] = tokens["mtp"] == tokens["off"]
    out["tokens_off"] = tokens["off"][0]
    return out


def main() -> int:
    report: dict[str, Any] = {}
    check("cuda_tests", cuda_tests, report)
    check("geometry_27b", geometry_27b, report)
    check("mtp_engine", mtp_engine, report)
    (OUT / "cuda_checks.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
