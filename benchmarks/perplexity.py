"""Held-out perplexity of the built-in model on every backend, in one run (the model card's table).

Text: the built-in model's ``heldout.txt`` (KJV chapters never trained on), tokenised once with
its tokenizer (leading BOS). Windows of ``--context`` tokens every ``--stride`` tokens
(``pagedhybrid.perplexity.windows``), so every backend scores exactly the same tokens given the
same history:

* ``hf_fp32``      -- HF transformers ``Qwen3_5ForCausalLM`` (fp32, torch fallback kernels),
  one no-cache forward per window;
* ``torch_fp32`` / ``torch_bf16`` -- the pagedhybrid engine's packed paged path (prompt
  logprobs), fp32 and bf16 weights/activations;
* ``ort_fp16_webgpu`` -- the fp16 ``pagedhybrid export --ep webgpu`` package in onnxruntime
  1.32 with the WebGPU plugin EP (lavapipe here), every node the EP takes on WebGPU;
  ``ort_fp16_paged_only`` -- the same package with only PagedAttention on WebGPU.

* ``ort_<format>_paged_only`` -- the package exported with ``--weights <format>`` (each of
  ``--weights``, default int8:32, int4, int4:128: every projection one MatMulNBits at the
  webgpu default accuracy level 4, int8 activations per block on the CPU EP), PagedAttention
  alone on WebGPU; beside it ``torch_<format>_same_tokens``, the engine (float32, the
  ``reference`` bundle: int8 activations per 32) holding the same codes
  (``quantization=<format>``), and the package's weight file size (``weights_mb``; fp16: the
  fp16 package's).

``--ort-tokens`` limits the text the onnxruntime rows score (lavapipe is slow); those rows then
quote the torch fp32 perplexity of the same prefix beside them. ``--ort-only`` skips the
full-text torch and HF rows. Writes JSON (``--out``).

    python benchmarks/perplexity.py [--context 512] [--stride 256] [--ort-tokens 4096]
        [--weights int8:32,int4,int4:128] [--ort-only]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedhybrid.engine import load_engine
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.default_model import heldout_text_path
from pagedhybrid.perplexity import engine_perplexity, package_perplexity, windows


def hf_perplexity(ids: list[int], context: int, stride: int) -> dict[str, float]:
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(str(default_model_dir()),
                                            dtype=torch.float32).eval()
    start, nll, count = time.perf_counter(), 0.0, 0
    for w in windows(len(ids), context, stride):
        x = torch.tensor([ids[w.begin:w.end]])
        with torch.no_grad():
            lp = hf(input_ids=x, use_cache=False).logits[0].double().log_softmax(-1)
        n = w.end - w.begin
        rows = torch.arange(n - w.scored - 1, n - 1)  # row j predicts token j + 1
        nll -= lp[rows, x[0, rows + 1]].sum().item()
        count += w.scored
    return {"perplexity": math.exp(nll / count), "tokens": count,
            "seconds": time.perf_counter() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--ort-tokens", type=int, default=4096)
    ap.add_argument("--weights", default="int8:32,int4,int4:128",
                    help="comma-separated --weights formats of the quantized package rows "
                    "('' for none)")
    ap.add_argument("--ort-only", action="store_true",
                    help="only the onnxruntime rows (and the engine's on the same tokens)")
    ap.add_argument("--out", default="benchmarks/results/perplexity.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok = load_tokenizer(default_model_dir())
    ids = tok.encode(heldout_text_path().read_text(encoding="utf-8"))
    rows: dict[str, dict[str, float | int]] = {}
    if not a.ort_only:
        for dtype in ("float32", "bfloat16"):
            engine = load_engine(None, dtype=dtype, max_model_len=a.context + 1)
            r = engine_perplexity(engine, ids, a.context, a.stride)
            rows[f"torch_{'fp32' if dtype == 'float32' else 'bf16'}"] = {
                "perplexity": r.perplexity, "tokens": r.tokens, "seconds": r.seconds}
        rows["hf_fp32"] = hf_perplexity(ids, a.context, a.stride)
    short = ids[:a.ort_tokens]
    ref = engine_perplexity(load_engine(None, dtype="float32", max_model_len=a.context + 1),
                            short, a.context, a.stride)
    formats = [f for f in a.weights.split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in [None, *formats]:
            pkg = Path(tmp) / (fmt or "fp16").replace(":", "_")
            export_package(default_model_dir(), pkg, ExportOptions(
                ep="webgpu", dtype="fp16", block_size=16, num_blocks=64, weight_format=fmt))
            size = (pkg / "model.onnx.data").stat().st_size / 2**20
            same = ref.perplexity if fmt is None else engine_perplexity(load_engine(
                None, dtype="float32", max_model_len=a.context + 1, quantization=fmt,
                backend="reference", enable_prefix_caching=False), short, a.context,
                a.stride).perplexity
            for placement in ("webgpu", "paged_only") if fmt is None and not a.ort_only \
                    else ("paged_only",):
                r = package_perplexity(pkg, default_model_dir(), short, a.context, a.stride,
                                       placement)
                rows[f"ort_{fmt or 'fp16'}_{placement}"] = {
                    "perplexity": r.perplexity, "tokens": r.tokens, "seconds": r.seconds,
                    "weights_mb": size, "torch_fp32_same_tokens": ref.perplexity,
                    **({} if fmt is None else {f"torch_{fmt}_same_tokens": same})}
    base = float(rows["hf_fp32"]["perplexity"]) if "hf_fp32" in rows else ref.perplexity
    print(f"held-out perplexity, {len(ids)} tokens, context {a.context}, stride {a.stride}")
    print(f"{'backend':26s} {'perplexity':>11s} {'relative':>10s} {'tokens':>7s} {'s':>7s} "
          f"{'weights MB':>10s} {'engine, same codes':>18s}")
    for name, r in rows.items():
        ppl, same = float(r["perplexity"]), r.get("torch_fp32_same_tokens")
        rel = f"{ppl / float(same) - 1:+.2%}*" if same is not None else f"{ppl / base - 1:+.1e}"
        engine = next((float(v) for k, v in r.items() if k.startswith("torch_int")), None)
        print(f"{name:26s} {ppl:11.4f} {rel:>10s} {r['tokens']:7d} {float(r['seconds']):7.1f} "
              + (f"{float(r['weights_mb']):10.2f}" if "weights_mb" in r else f"{'':10s}")
              + (f" {engine:18.4f}" if engine is not None else ""))
    print("* onnxruntime rows: relative to torch fp32 on the same first "
          f"{len(short)} tokens ({ref.perplexity:.4f})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"context": a.context, "stride": a.stride, "text_tokens": len(ids),
                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
