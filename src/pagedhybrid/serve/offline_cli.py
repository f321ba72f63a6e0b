"""Command-line front ends of the engine (wired into ``pagedhybrid.cli`` by the lead).

* ``pagedhybrid generate [--model DIR] --prompt TEXT ... [--max-tokens N] [--temperature T]
  [--seed S] [--stream] [--json]`` -- offline generation (greedy by default); ``--stream``
  prints text as it is generated, ``--json`` prints one JSON document (JSON lines with
  ``--stream``).
* ``pagedhybrid run`` -- the main job: the built-in default model serving a handful of overlapping
  requests of different lengths (arrivals while others decode, greedy and seeded sampling, one
  abort), streamed step by step, then a table per request and the throughput line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedhybrid.engine.core.config import EXECUTORS
from pagedhybrid.engine.core.request import SequenceOutput
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.loader import DTYPE_SPELLINGS, load_engine
from pagedhybrid.engine.sample.sampler import SamplingParams
from pagedhybrid.errors import PagedHybridError
from pagedhybrid.serve.llm import LLM, Throughput


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF Qwen3.5 checkpoint folder (default: the built-in default model)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_SPELLINGS,
                   help="weights and activations (default auto: the checkpoint's dtype)")
    g.add_argument("--block-size", type=int, default=16, help="KV page size (power of 2, >=16)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pages (default: memory)")
    g.add_argument("--cache-memory-bytes", type=int, default=None,
                   help="bytes for KV pages, state slots and checkpoints")
    g.add_argument("--cache-memory-fraction", type=float, default=None,
                   help="share of the memory left after weights and workspace for the cache "
                        "(default 0.5)")
    g.add_argument("--num-state-slots", type=int, default=None,
                   help="state slots (default: --max-num-seqs)")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: what the cache holds, up to the "
                        "model's limit)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share cached KV pages and state checkpoints of "
                   "repeated prefixes (default on)")
    g.add_argument("--state-checkpoint-interval", type=int, default=None,
                   help="tokens between state checkpoints (a multiple of --block-size; "
                   "default max(64, block size))")
    g.add_argument("--num-state-checkpoints", type=int, default=None,
                   help="rows of the state-checkpoint pool (default: as many as state slots)")
    g.add_argument("--backend", default="auto", help="kernels: auto | native | torch")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="one thread while other processes keep the cores busy (default on)")
    g.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="copy the projection weights into transparent huge pages (default on; "
                   "off: plain weights stay shared views of the checkpoint file)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="logits bitwise independent of the batch (rollout == training recompute)")
    g.add_argument("--quantization", default=None, metavar="FORMAT",
                   help="projection weights in 8 / 4 bits, quantised at load (round to nearest): "
                   "int8 (per channel), int4 (= int4:32), int4:128, int8:32, ... with :asym for "
                   "zero points (default: the model dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8"],
                   help="KV page element type (default: the model dtype); int8 / fp8 need "
                   "calibrated scales (pagedhybrid calibrate-kv)")
    g.add_argument("--kv-quant", default="per-channel", choices=["per-channel", "per-tensor"],
                   help="scale granularity of quantized pages")
    g.add_argument("--kv-scales", default=None, metavar="FILE",
                   help="KV scale file (default: kv_scales/{dtype}-{quant}.safetensors in the "
                   "checkpoint folder)")
    g.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding as vLLM spells it, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 3, "prompt_lookup_max": 5}\' (default off)')
    g.add_argument("--kv-events-config", type=json_object, default=None, metavar="JSON",
                   help='KV-cache events for routers as vLLM spells them, e.g. '
                   '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                   '"replay_endpoint": "tcp://*:5558", "topic": "kv@pod@model"}\' (default off)')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split every layer's heads and channels (default 1)")
    g.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTORS),
                   help="how the other tensor-parallel ranks start: mp (local processes, the "
                   "default), ray (actors on a Ray cluster) or external_launcher (torchrun-style "
                   "MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK: every rank runs the same "
                   "command, rank 0 serves)")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster for --distributed-executor-backend ray (default: "
                   "RAY_ADDRESS, else a local one)")


def json_object(text: str) -> dict[str, object]:
    """A command-line JSON object (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="extend", nargs="+", required=True, metavar="TEXT",
                   help="prompt text; repeat or list several to batch them")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="K")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_engine_arguments(p)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.set_defaults(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=8,
                   state_checkpoint_interval=16)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"block_size": args.block_size, "num_blocks": args.num_blocks,
            "cache_memory_bytes": args.cache_memory_bytes,
            "cache_memory_fraction": args.cache_memory_fraction,
            "num_state_slots": args.num_state_slots, "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching,
            "state_checkpoint_interval": args.state_checkpoint_interval,
            "num_state_checkpoints": args.num_state_checkpoints, "backend": args.backend,
            "kv_cache_dtype": args.kv_cache_dtype, "kv_quant": args.kv_quant,
            "kv_scales": args.kv_scales, "batch_invariant": args.batch_invariant,
            "quantization": args.quantization,
            "adaptive_threads": args.adaptive_threads, "huge_pages": args.huge_pages,
            "speculative_config": args.speculative_config,
            "kv_events_config": args.kv_events_config,
            "tensor_parallel_size": args.tensor_parallel_size,
            "distributed_executor_backend": args.distributed_executor_backend,
            "ray_address": args.ray_address}


def worker_rank(args: argparse.Namespace) -> int | None:
    """Under ``--distributed-executor-backend external_launcher``, a process at ``RANK`` > 0
    is a tensor-parallel worker of rank 0's engine: it serves that (``distributed.worker_main``)
    instead of the command, and its exit code is returned; None for rank 0 and otherwise."""
    if getattr(args, "distributed_executor_backend", None) != "external_launcher" or \
            int(os.environ.get("RANK", "0")) == 0:
        return None
    from pagedhybrid.engine.worker.distributed import worker_main

    env = os.environ
    return worker_main(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]),
                       int(env["WORLD_SIZE"]))


def _record(out: SequenceOutput, prompt: str | None = None) -> dict[str, object]:
    rec: dict[str, object] = {
        "request_id": out.request_id, "text": out.text, "token_ids": list(out.token_ids),
        "new_token_ids": list(out.new_token_ids), "finished": out.finished,
        "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "num_generated_tokens": len(out.token_ids), "num_preemptions": out.num_preemptions,
    }
    if prompt is not None:
        rec["prompt"] = prompt
    if out.error:
        rec["error"] = out.error
    if out.logprobs is not None:
        rec["logprobs"] = [{str(t): lp.logprob for t, lp in d.items()} for d in out.logprobs]
    return rec


def generate_main(args: argparse.Namespace) -> int:
    if (code := worker_rank(args)) is not None:
        return code
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_tokens=args.max_tokens,
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        llm = LLM(args.model, dtype=args.dtype, **_engine_kwargs(args))
        print(f"pagedhybrid: {llm.engine.memory.summary()}", file=sys.stderr)
        print(f"pagedhybrid: kernels: {llm.engine.runner.kernel_choice()}", file=sys.stderr)
        prompts: list[str] = list(args.prompt)
        if args.stream:
            return _generate_stream(llm, prompts, params, as_json=args.json)
        results = llm.generate(prompts, params, use_progress=not args.json)
    except PagedHybridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        t = llm.last_throughput
        doc = {"outputs": [_record(r.sequences[0], p)
                           for r, p in zip(results, prompts, strict=True)],
               "throughput": None if t is None else {
                   "elapsed_s": t.elapsed_s, "prompt_tokens_per_s": t.prompt_tps,
                   "generated_tokens_per_s": t.generated_tps}}
        print(json.dumps(doc, indent=2))
        return 0
    for i, (r, p) in enumerate(zip(results, prompts, strict=True)):
        print(f"[{i}] {p!r} -> {r.text!r} ({len(r.token_ids)} tokens, {r.finish_reason})")
    return 0


def _generate_stream(llm: LLM, prompts: list[str], params: SamplingParams,
                     as_json: bool) -> int:
    start = time.perf_counter()
    shown: dict[str, str] = {}
    finals: dict[str, SequenceOutput] = {}
    single = len(prompts) == 1
    for out in llm.stream(prompts, params):
        text = out.text or ""
        prev = shown.get(out.request_id, "")
        delta = text[len(prev):] if text.startswith(prev) else text
        shown[out.request_id] = text
        if as_json:
            rec = _record(out)
            rec["delta"] = delta
            print(json.dumps(rec), flush=True)
        elif single:
            print(delta, end="\n" if out.finished else "", flush=True)
        else:
            end = f"  [{out.finish_reason}]" if out.finished else ""
            print(f"{out.request_id}| {delta!r}{end}", flush=True)
        if out.finished:
            finals[out.request_id] = out
    t = Throughput(len(finals), sum(len(o.prompt_token_ids) for o in finals.values()),
                   sum(len(o.token_ids) for o in finals.values()), time.perf_counter() - start)
    print(t.line(), file=sys.stderr)
    return 0


# -- pagedhybrid run ---------------------------------------------------------------------------
DEMO = (  # (arrival step, prompt, params): the built-in model was trained on the KJV Bible
    (0, "In the beginning God created",
     SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    (0, "And it came to pass, when the king had heard the words of the prophet, that he rent "
        "his clothes, and",
     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    (2, "And it came to pass, when the king had heard the words of the prophet, that he went "
        "up", SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=20,
                             ignore_eos=True)),  # shares r1's prefix: a prefix-cache hit
    (3, "The LORD is my shepherd;", SamplingParams(temperature=0.8, top_k=40, seed=7,
                                                   max_tokens=40, ignore_eos=True)),
    (6, "Then Jesus went up into a mountain, and there he sat with his disciples. And when he "
        "lifted up his eyes, and saw a great company come unto him, he said unto Philip,",
     SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
    (10, "And the children of Israel", SamplingParams(temperature=0.0, max_tokens=64,
                                                       ignore_eos=True)),
)
ABORT_AFTER = ("r5", 6)  # abort r5 after it generated this many tokens


@dataclass
class _Track:
    prompt: str
    added_s: float
    first_s: float | None = None
    done_s: float | None = None
    out: SequenceOutput | None = None
    pieces: list[str] = field(default_factory=list)


def run_main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if (code := worker_rank(args)) is not None:
        return code
    console = Console(width=max(Console().width, 150))
    kw = _engine_kwargs(args) if hasattr(args, "block_size") else {
        "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_blocks": 8,
        "state_checkpoint_interval": 16}
    try:
        engine = load_engine(getattr(args, "model", None), dtype=getattr(args, "dtype",
                                                                           "float32"), **kw)
    except PagedHybridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = engine.model.config
    console.print(
        f"[bold]pagedhybrid run[/]: {cfg.num_hidden_layers} layers "
        f"({len(cfg.full_attention_layers)} full attention, {len(cfg.linear_attention_layers)} "
        f"Gated DeltaNet), {engine.blocks.capacity} KV pages x {engine.blocks.block_size} "
        f"tokens, {engine.states.capacity} state slots, budget "
        f"{engine.config.max_num_batched_tokens} tokens/step, "
        f"max {engine.config.max_num_seqs} running; kernels: {engine.runner.kernel_summary()}")
    tracks = _serve_demo(engine, console)
    _report(engine, tracks, console, Table)
    ok = engine.blocks.num_free == engine.blocks.capacity and \
        engine.states.num_free == engine.states.capacity
    return 0 if ok and all(t.out is not None for t in tracks.values()) else 1


def _serve_demo(engine: Engine, console: object) -> dict[str, _Track]:
    tracks: dict[str, _Track] = {}
    queue = [(f"r{i}", *item) for i, item in enumerate(DEMO)]
    step = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and queue[0][1] <= step:
            rid, _, prompt, params = queue.pop(0)
            engine.add_request(rid, prompt, params)
            tracks[rid] = _Track(prompt, time.perf_counter() - start)
            console.print(f"[dim]step {step:3d}[/] + {rid} arrives "  # type: ignore[attr-defined]
                          f"({len(engine.scheduler.requests[rid].prompt_token_ids)} prompt "
                          "tokens)")
        outs = engine.step()
        now = time.perf_counter() - start
        parts = []
        for o in outs:
            tr = tracks[o.request_id]
            if o.new_token_ids and tr.first_s is None:
                tr.first_s = now
            text = "".join(tr.pieces)
            delta = (o.text or "")[len(text):]
            tr.pieces.append(delta)
            tag = f" [{o.finish_reason}]" if o.finished else ""
            parts.append(f"{o.request_id} {delta!r}{tag}")
            if o.finished:
                tr.done_s, tr.out = now, o
        if parts:
            console.print(f"[dim]step {step:3d}[/] " + " | ".join(parts),  # type: ignore[attr-defined]
                          markup=True, highlight=False)
        rid, after = ABORT_AFTER
        req = engine.scheduler.requests.get(rid)
        if req is not None and req.num_output_tokens >= after:
            engine.abort_request(rid)
            console.print(f"[dim]step {step:3d}[/] x {rid} aborted")  # type: ignore[attr-defined]
        engine.check_invariants()
        step += 1
    return tracks


def _report(engine: Engine, tracks: dict[str, _Track], console: object, table_cls: type) -> None:
    table = table_cls(title="requests")
    for col in ("id", "prompt", "cached", "out", "finish", "preempt", "ttft s", "total s"):
        table.add_column(col, justify="right" if col not in ("id", "finish") else "left")
    table.add_column("text", overflow="ellipsis", no_wrap=True, max_width=60)
    for rid, tr in tracks.items():
        o = tr.out
        assert o is not None
        first = "-" if tr.first_s is None else f"{tr.first_s - tr.added_s:.2f}"
        lat = "-" if tr.done_s is None else f"{tr.done_s - tr.added_s:.2f}"
        table.add_row(rid, str(len(o.prompt_token_ids)), str(o.num_cached_tokens),
                      str(len(o.token_ids)),
                      str(o.finish_reason), str(o.num_preemptions), first, lat,
                      repr((o.text or "")[:56]))
    console.print(table)  # type: ignore[attr-defined]
    st = engine.stats
    prompt = sum(len(t.out.prompt_token_ids) for t in tracks.values() if t.out)
    gen = sum(len(t.out.token_ids) for t in tracks.values() if t.out)
    t = Throughput(len(tracks), prompt, gen, st.total_s)
    console.print(t.line())  # type: ignore[attr-defined]
    mean = st.computed_tokens / st.steps if st.steps else 0.0
    console.print(  # type: ignore[attr-defined]
        f"{st.steps} steps, {mean:.1f} tokens/step, peak {st.peak_running} running, peak "
        f"{st.peak_blocks}/{engine.blocks.capacity} pages, {st.preemptions} preemptions; "
        f"engine overhead (scheduling + batch building) {100 * st.overhead_fraction:.1f}% of "
        f"step time; after draining: {engine.blocks.num_free}/{engine.blocks.capacity} pages "
        f"({engine.blocks.num_cached} of them cached prefix pages) and "
        f"{engine.states.num_free}/{engine.states.capacity} slots free")
    pc = engine.prefix_cache_stats()
    if engine.checkpoints is not None:
        console.print(  # type: ignore[attr-defined]
            f"prefix cache: {pc['hits']}/{pc['queries']} admissions hit, {pc['hit_tokens']} of "
            f"{pc['query_tokens']} tokens served from cache "
            f"({100 * pc['cached_token_fraction']:.0f}%), {pc['checkpoints_written']} state "
            f"checkpoints written, {pc['page_evictions']} page and "
            f"{pc['checkpoint_evictions']} checkpoint evictions")


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m pagedhybrid.serve.offline_cli generate|run ...``)."""
    p = argparse.ArgumentParser(prog="pagedhybrid-engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate")
    add_generate_arguments(g)
    g.set_defaults(func=generate_main)
    r = sub.add_parser("run")
    add_run_arguments(r)
    r.set_defaults(func=run_main)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
