"""``pagedhybrid export`` and ``pagedhybrid verify`` (argparse), wired by ``pagedhybrid.cli``.

``pagedhybrid export MODEL_DIR OUT_DIR --ep cuda|webgpu --dtype fp16|bf16 [--block-size 256]
[--num-blocks N | --gpu-utilization F] [--max-batch-size N] [--max-length N]
[--max-scheduled-tokens N] [--prefill-chunk-size N] [--prune-logits] [--no-weights]
[--weights int4|int8[:BLOCK][:asym] [--accuracy-level N] [--no-quantize-lm-head]]`` writes the
package with a progress bar and prints the files, the KV page budget (``pages:``: the page count
and where it came from -- ``--num-blocks``, genai's free-memory factor on CUDA, or the default
page count of ``export/pages.py`` on other providers) and the operator counts;
``pagedhybrid verify OUT_DIR [--checkpoint MODEL_DIR]`` prints the ABI report and exits non-zero
on any mismatch.
Unsupported configurations exit with status 2 and the reason.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedhybrid.errors import PagedHybridError, UnsupportedConfiguration
from pagedhybrid.export.options import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH_SIZE, ExportOptions
from pagedhybrid.export.pages import DEFAULT_KV_BUDGET, WEBGPU_BINDING_LIMIT


def register_subcommands(subparsers: Any) -> None:
    e = subparsers.add_parser(
        "export", help="export the packed paged hybrid ONNX graph for ONNX Runtime GenAI")
    e.add_argument("model_dir", help="HF Qwen3.5 checkpoint folder (config.json + safetensors)")
    e.add_argument("out_dir", help="package folder to write")
    e.add_argument("--ep", required=True, help="execution provider: cuda | webgpu")
    e.add_argument("--dtype", default="fp16", help="activation dtype: fp16 | bf16")
    e.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per KV page (power of two >= 16)")
    budget = e.add_mutually_exclusive_group()
    budget.add_argument(
        "--num-blocks", type=int, metavar="N",
        help="KV pages the Engine allocates (each sequence reaches at most N x block-size "
        "tokens). Default on CUDA: --gpu-utilization 0.6 (genai sizes pages from free memory); "
        "on other providers: enough pages for --max-batch-size sequences of --max-length "
        f"tokens, capped at {DEFAULT_KV_BUDGET / (1 << 30):g} GiB of pages in all and "
        f"{WEBGPU_BINDING_LIMIT >> 20} MiB per layer buffer (WebGPU's default storage binding "
        "limit); refused when one sequence of --max-length (else 4096) tokens cannot fit")
    budget.add_argument("--gpu-utilization", type=float,
                        help="fraction of free device memory for pages (CUDA only)")
    e.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE)
    e.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="longest sequence (prompt + output) served: genai search.max_length and "
                   "the default page count's per-sequence demand (default: the model's context "
                   "length, max_position_embeddings)")
    e.add_argument("--max-scheduled-tokens", type=int)
    e.add_argument("--prefill-chunk-size", type=int,
                   help="most prompt tokens of one request per step (genai search.chunk_size)")
    e.add_argument("--state-update-capacity", type=int, default=0, metavar="K",
                   help="GatedDeltaNet / conv nodes return their compact state updates for up to "
                   "K tokens per sequence (speculative verification in onnxruntime-genai; "
                   "1-8, default 0 = off)")
    e.add_argument("--mtp", action="store_true",
                   help="also export the checkpoint's MTP head (mtp.*) as its own graph mtp.onnx "
                   "and the main graph's hidden_states output, with genai_config's model.mtp "
                   "(onnxruntime-genai 0.18.0's MTP drafter)")
    e.add_argument("--prune-logits", action="store_true",
                   help="emit logits only for each sequence's last token [B, vocab]")
    e.add_argument("--kv-cache-dtype", choices=["int8", "fp8"], default=None,
                   help="quantized KV pages (CUDA): int8 or float8e4m3fn with calibrated scales")
    e.add_argument("--kv-quant", choices=["per-channel", "per-tensor"], default="per-channel")
    e.add_argument("--kv-scales", default=None, metavar="FILE",
                   help="KV scale file (default: kv_scales/{dtype}-{quant}.safetensors in the "
                   "checkpoint folder; pagedhybrid calibrate-kv writes it)")
    e.add_argument("--no-weights", action="store_true",
                   help="structure only: weights declared as external data, not written")
    e.add_argument("--weights", default=None, metavar="FORMAT", dest="weight_format",
                   help="projections in 8 / 4 bits as com.microsoft.MatMulNBits (the engine's "
                   "--quantization formats): int4 (= int4:32), int4:128, int4:32:asym, int8:32, "
                   "... (int8 alone: per output channel); fp16 only; the embedding stays fp16")
    e.add_argument("--accuracy-level", type=int, default=None, metavar="N",
                   help="MatMulNBits accuracy_level 0-4 (default: onnxruntime-genai's builder's, "
                   "4 on webgpu = int8 activations per block, 0 on cuda)")
    e.add_argument("--no-quantize-lm-head", action="store_true",
                   help="with --weights: keep the LM head in fp16")
    e.set_defaults(func=run_export)
    v = subparsers.add_parser("verify", help="check an exported package against its ABI")
    v.add_argument("out_dir")
    v.add_argument("--checkpoint", default=None, metavar="MODEL_DIR",
                   help="the checkpoint exported from: also check a --weights package's codes "
                   "and scales against it")
    v.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    v.set_defaults(func=run_verify)


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    return ExportOptions(
        ep=args.ep, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        gpu_utilization=args.gpu_utilization, max_batch_size=args.max_batch_size,
        max_length=args.max_length,
        max_scheduled_tokens=args.max_scheduled_tokens,
        prefill_chunk_size=args.prefill_chunk_size, prune_logits=args.prune_logits,
        weights=not args.no_weights, kv_cache_dtype=args.kv_cache_dtype,
        kv_quant=args.kv_quant, kv_scales=args.kv_scales,
        state_update_capacity=args.state_update_capacity, mtp=args.mtp,
        weight_format=args.weight_format, accuracy_level=args.accuracy_level,
        quantize_lm_head=not args.no_quantize_lm_head)


def run_export(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from pagedhybrid.export.package import export_package

    console = Console(stderr=True)
    try:
        options = options_from_args(args)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      console=console, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    label = "building graph (layers)" if stage == "graph" else "writing weights"
                    tasks[stage] = bar.add_task(label, total=total)
                bar.update(tasks[stage], completed=done, total=total)

            result = export_package(args.model_dir, args.out_dir, options, progress)
    except UnsupportedConfiguration as exc:
        console.print(f"[red]unsupported configuration:[/red] {exc.reason}")
        return 2
    except PagedHybridError as exc:
        console.print(f"[red]export failed:[/red] {exc}")
        return 1
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(result.op_counts.items())
                       if k in ("PagedAttention", "GatedDeltaNet", "VarlenCausalConvWithState",
                                "MoE", "MatMulNBits"))
    print(f"exported {result.out_dir} in {result.seconds:.1f} s: {', '.join(result.files)}")
    print(f"pages: {result.pages.summary()}")
    print(f"operators: {counts}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from pagedhybrid.export.verify import verify_package

    report = verify_package(args.out_dir, args.checkpoint)
    if args.quiet:
        for f in report.failures:
            print(f"FAIL {f.check}: {f.detail}")
        print(f"{len(report.findings) - len(report.failures)} checks passed, "
              f"{len(report.failures)} failed")
    else:
        print(report.format())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m pagedhybrid.export.cli``) until the lead wires it."""
    parser = argparse.ArgumentParser(prog="pagedhybrid")
    register_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
