"""Our packed paged export vs onnxruntime-genai 0.18's own builder, both in the real genai Engine.

Checkpoint: one tiny Qwen3.5-shaped model with random weights (the default model's shape:
hidden 64, 6 layers with ``full_attention_interval`` 3, 4/2 heads of 32, linear 2/4 heads,
``Dk = 16``, ``Dv = 8``, vocab 258, untied head), written once as a ``qwen3_5_text`` checkpoint
(ours) and wrapped as ``Qwen3_5ForConditionalGeneration`` with a one-block vision tower and a
258-token word-level tokenizer (what the builder accepts).

Exports, each in its own process (wall time and peak RSS of that process):

* ``pagedhybrid`` -- ``pagedhybrid export --ep webgpu --dtype fp16 --block-size B --num-blocks P``.
* ``genai-builder`` -- ``python -m onnxruntime_genai.models.builder -p fp16 -e cuda --extra_options
  use_paged_attention=true paged_block_size=B num_blocks=P max_batch_size=M``: the builder
  refuses ``-e webgpu`` for GatedDeltaNet models, so it exports for CUDA and the provider options
  in its ``genai_config.json`` are switched to webgpu (reference/onnxruntime-abi.md §7.5).

Both packages then run the same workload in ``onnxruntime_genai.Engine`` (WebGPU plugin EP;
PagedAttention on WebGPU, GatedDeltaNet/VarlenCausalConvWithState on the CPU EP): N greedy
requests with prompts of random length in ``--prompt-range`` (kept below 32 tokens: the WebGPU
PagedAttention of plugin 0.4.0 is wrong for >= 32 new tokens of one sequence on lavapipe) and
exactly ``--output-range`` new tokens, all queued at t=0; each request is closed when its turn
finishes (an open genai request keeps its batch slot). The same workload runs once first as a
warm-up (lavapipe compiles a shader per new shape). Reported: engine steps/s, generated tok/s,
total tok/s, the ratio ours/builder, how many requests' token streams agree between the two
packages, and export time / peak memory, plus the Qwen3.5-27B-class structural export
(``--no-weights``) of ours (the builder needs the weights).
Writes JSON (``--out``). Not a test: no assertions on timings.

    python benchmarks/export_engine.py --quick
    python benchmarks/export_engine.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedhybrid.models.qwen35.config import QWEN35_27B_TEXT_CONFIG

os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")

# Runs a command in this interpreter and prints the child's own peak RSS (KiB) on exit.
_RSS_WRAPPER = (
    "import atexit, resource, runpy, sys;"
    "atexit.register(lambda: print('PEAK_RSS_KB', "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr));"
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


# -- checkpoints ---------------------------------------------------------------------------------
def write_checkpoints(root: Path, seed: int) -> tuple[Path, Path]:
    """(our qwen3_5_text checkpoint, the builder's Qwen3_5ForConditionalGeneration wrapper)."""
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
    )

    from pagedhybrid.models.qwen35.synthetic import (
        random_weights,
        tiny_byte_config,
        write_checkpoint,
    )

    cfg = dataclasses.replace(tiny_byte_config(), linear_value_head_dim=8,
                              tie_word_embeddings=False)
    weights = random_weights(cfg, seed)
    for name, t in weights.items():  # O(1) activations (same recipe as tests/export)
        if name == "model.embed_tokens.weight":
            weights[name] = t * 0.1
        elif name == "lm_head.weight":
            weights[name] = t * 0.5
        elif name.endswith(("proj.weight", "proj_qkv.weight", "proj_z.weight", "proj_a.weight",
                            "proj_b.weight")):
            weights[name] = t * 0.3
    ours = root / "qwen35-tiny"
    write_checkpoint(ours, cfg, weights)
    text = json.loads((ours / "config.json").read_text())
    text.pop("architectures", None)
    vl_cfg = Qwen3_5Config(
        text_config=text, tie_word_embeddings=False,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "num_position_embeddings": 16})
    vl = Qwen3_5ForConditionalGeneration(vl_cfg).float().eval()
    state = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
             for k, v in load_file(str(ours / "model.safetensors")).items()}
    missing, unexpected = vl.load_state_dict(state, strict=False)
    assert not unexpected and all("visual" in k for k in missing), (missing, unexpected)
    builder_in = root / "qwen35-tiny-vl"
    with torch.no_grad():
        vl.save_pretrained(str(builder_in))
    vocab = {f"<t{i}>": i for i in range(256)} | {"<bos>": 256, "<eos>": 257}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<eos>", pad_token="<eos>").save_pretrained(str(builder_in))
    return ours, builder_in


# -- exports -------------------------------------------------------------------------------------
def run_measured(module_args: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, *module_args],
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(module_args)} failed:\n{proc.stdout}\n{proc.stderr}")
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines()
           if line.startswith("PEAK_RSS_KB")]
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(rss[-1] / 1024, 1)}


def export_ours(ckpt: Path, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    return run_measured(["pagedhybrid.export.cli", "export", str(ckpt), str(out), "--ep",
                         "webgpu", "--dtype", "fp16", "--block-size", str(a.block_size),
                         "--num-blocks", str(a.num_blocks), "--max-batch-size",
                         str(a.max_batch_size)])


def export_builder(ckpt: Path, out: Path, cache: Path, a: argparse.Namespace) -> dict[str, Any]:
    stats = run_measured(["onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                          "-p", "fp16", "-e", "cuda", "-c", str(cache), "--extra_options",
                          "use_paged_attention=true", f"paged_block_size={a.block_size}",
                          f"num_blocks={a.num_blocks}", f"max_batch_size={a.max_batch_size}"])
    path = out / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["decoder"]["session_options"]["provider_options"] = [
        {"webgpu": {"enableGraphCapture": "0", "validationMode": "basic"}}]
    path.write_text(json.dumps(cfg, indent=4))
    return stats


def export_structural(root: Path) -> dict[str, Any]:
    model_dir = root / "qwen35-27b-config"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN35_27B_TEXT_CONFIG))
    stats = run_measured(["pagedhybrid.export.cli", "export", str(model_dir),
                          str(root / "qwen35-27b-structure"), "--ep", "cuda", "--dtype", "bf16",
                          "--no-weights"])
    counts = {}
    import onnx_ir as ir

    for node in ir.load(root / "qwen35-27b-structure" / "model.onnx").graph:
        if node.op_type in ("PagedAttention", "GatedDeltaNet", "VarlenCausalConvWithState"):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return {**stats, "ops": counts}


# -- engine --------------------------------------------------------------------------------------
def run_workload(package: Path, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    import onnxruntime_genai as og

    engine = og.Engine(og.Model(og.Config(str(package))))
    buf = engine.create_event_buffer(256)

    def go(ps: list[list[int]], outs: list[int]) -> tuple[list[list[int]], int, float]:
        reqs = []
        for p, n in zip(ps, outs, strict=True):
            r = engine.create_request()
            o = og.TurnOptions(r)
            o.set_max_generated_tokens(n)
            o.set_min_generated_tokens(n)
            o.set_do_sample(False)
            r.begin_turn(np.asarray(p, np.int32), o)
            reqs.append(r)
        toks: list[list[int]] = [[] for _ in ps]
        steps, start = 0, time.perf_counter()
        while engine.has_pending_requests():
            for ev in engine.run(buf):
                if ev.flags & og.EngineEventFlags.FAILED:
                    raise RuntimeError(f"engine failure {ev.error_code}")
                if ev.flags & og.EngineEventFlags.TOKEN:
                    toks[next(k for k, r in enumerate(reqs) if ev.request == r)].append(ev.token)
                if ev.flags & og.EngineEventFlags.TURN_FINISHED:
                    ev.request.close()  # frees its pages, states and batch slot
            steps += 1
            if steps > 100 * len(ps) + 1000:
                raise RuntimeError("engine made no progress")
        seconds = time.perf_counter() - start
        return toks, steps, seconds

    go(prompts, outputs)  # warm-up on the same workload: every shader shape compiled once
    toks, steps, seconds = go(prompts, outputs)
    generated = sum(len(t) for t in toks)
    total = generated + sum(len(p) for p in prompts)
    return {"steps": steps, "seconds": round(seconds, 4), "steps_per_s": steps / seconds,
            "generated_tok_per_s": generated / seconds, "total_tok_per_s": total / seconds,
            "tokens": toks}


# -- main ------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 requests, 16-24 new tokens")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(4, 31))
    p.add_argument("--output-range", type=int, nargs=2, default=(32, 96))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="keep checkpoints and packages here (default: a temp dir)")
    p.add_argument("--out", default="benchmarks/results/export_engine.json")
    a = p.parse_args()
    if a.quick:
        a.requests, a.output_range = 8, (16, 24)
    if a.prompt_range[1] >= 32:
        print("note: prompts >= 32 tokens hit a WebGPU PagedAttention bug on lavapipe",
              file=sys.stderr)
    import onnxruntime_ep_webgpu as wep
    import onnxruntime_genai as og

    og.register_execution_provider_library("WebGpuExecutionProvider", wep.get_library_path())
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(*a.prompt_range))]
               for _ in range(a.requests)]
    outputs = [rng.randint(*a.output_range) for _ in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.work_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        ours_ckpt, vl_ckpt = write_checkpoints(root, a.seed + 7)
        exports = {
            "pagedhybrid": export_ours(ours_ckpt, root / "pkg-pagedhybrid", a),
            "genai-builder": export_builder(vl_ckpt, root / "pkg-builder", root / "hf-cache", a),
        }
        runs = {name: run_workload(root / pkg, prompts, outputs)
                for name, pkg in (("pagedhybrid", "pkg-pagedhybrid"),
                                  ("genai-builder", "pkg-builder"))}
        structural = export_structural(root)
    agree = sum(x == y for x, y in zip(runs["pagedhybrid"]["tokens"],
                                       runs["genai-builder"]["tokens"], strict=True))
    ours, peer = runs["pagedhybrid"], runs["genai-builder"]
    header = f"{'system':<15}{'steps':>7}{'steps/s':>10}{'gen tok/s':>11}{'total tok/s':>13}" \
             f"{'export s':>10}{'export MiB':>12}"
    print(f"workload: {a.requests} requests, prompts {a.prompt_range[0]}-{a.prompt_range[1]}, "
          f"outputs {a.output_range[0]}-{a.output_range[1]}, block {a.block_size}, "
          f"{a.num_blocks} pages, max batch {a.max_batch_size}")
    print(header)
    for name in runs:
        r, e = runs[name], exports[name]
        print(f"{name:<15}{r['steps']:>7}{r['steps_per_s']:>10.1f}{r['generated_tok_per_s']:>11.1f}"
              f"{r['total_tok_per_s']:>13.1f}{e['seconds']:>10.2f}{e['peak_rss_mib']:>12.1f}")
    ratio = {k: ours[k] / peer[k] for k in ("steps_per_s", "generated_tok_per_s",
                                             "total_tok_per_s")}
    print("ratio pagedhybrid/builder: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    print(f"requests with identical greedy tokens: {agree}/{a.requests}")
    print(f"Qwen3.5-27B-class structural export (--no-weights): {structural['seconds']:.2f} s, "
          f"peak {structural['peak_rss_mib']:.0f} MiB, ops {structural['ops']}")
    doc = {
        "benchmark": "export_engine", "platform": platform.platform(),
        "python": platform.python_version(), "args": vars(a), "exports": exports,
        "engine": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in runs.items()},
        "ratio_pagedhybrid_over_builder": ratio, "identical_token_streams": agree,
        "structural_27b": structural,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
