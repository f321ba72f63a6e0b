"""Engine throughput vs HF transformers ``generate`` (one at a time, and a padded static batch).

Model: a "small" Qwen3.5-shaped hybrid with random weights (hidden 1024, 8 layers with
``full_attention_interval`` 4 -> 2 full + 6 Gated DeltaNet, vocab 32k, tied embeddings,
~141M parameters), written once as an HF checkpoint so that both sides load the same weights.

Workload: N requests with prompts of uniform random length in [P0, P1] and outputs of exactly
[O0, O1] tokens (greedy, EOS ignored, so every system generates the same tokens).

Systems, in the same run and process:

* ``engine``   -- pagedhybrid ``Engine``: every request queued at t=0, continuous batching
  (``max_num_seqs``, ``max_num_batched_tokens``), KV pages + state slots.
* ``hf_single`` -- HF ``generate`` one request at a time.
* ``hf_padded`` -- HF ``generate`` on left-padded static batches of ``max_num_seqs`` requests in
  arrival order; a batch runs until its longest output is done; only each request's own
  tokens count as generated.

Reported: generated tok/s and total (prompt + generated) tok/s per system, the engine's ratios
to both HF modes, the engine's own overhead (scheduling + batch building) as a fraction of step
time over all steps and over steps with >= 32 running sequences, and how many requests'
greedy tokens equal HF one-at-a-time. ``--quick`` is a smaller workload for a 2-core machine.
Writes JSON (``--out``). Not a test: no assertions on timings.

``--batch-invariant`` instead runs, in the same process on the same workload (no HF): the
default engine and ``EngineConfig(batch_invariant=True)`` (both returning the sampled tokens'
logprobs), their throughput ratio, the largest ``dlogp = recompute - rollout`` of each (the
recompute is ``Engine.score`` of the same engine), and the recompute's tokens/s in the
invariant mode against the default kernels' dense forward (``forward_dense``, one sequence at a
time) over the same sequences. The random model's greedy tokens have logprobs of ~0 (its
distributions are near one-hot), so the dlogp of each mode is also measured on the trained
built-in model (32 held-out KJV passages of 16-200 tokens, 32 greedy tokens each, in the
benchmark's dtype), where logprobs are real.

    python benchmarks/engine.py --quick
    python benchmarks/engine.py --quick --moe       # the MoE hybrid vs HF's MoE model
    python benchmarks/engine.py                     # 64 requests, prompts 16-512, out 16-128
"""

from __future__ import annotations

# isort: off
import pagedhybrid  # noqa: F401 -- first: it sets OpenMP's spin before torch loads
# isort: on

import argparse
import dataclasses
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.models.qwen35 import Qwen35Config, load
from pagedhybrid.models.qwen35.synthetic import random_weights, write_checkpoint


def small_config() -> Qwen35Config:
    return Qwen35Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(8)),
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8, rope_theta=10000.0,
        partial_rotary_factor=0.25, mrope_section=(6, 5, 5), mrope_interleaved=True,
        tie_word_embeddings=True, max_position_embeddings=4096, checkpoint_dtype="float32")


def moe_config() -> Qwen35Config:
    """The mixture-of-experts hybrid (``--moe``): the small shape narrowed to hidden 512 (4
    attention heads of 128, GDN 4 key / 8 value heads of 64), 64 experts of 160 channels per
    layer, 8 routed per token, plus a shared expert of 256: ~154M parameters in all, ~44M
    active per token (embeddings included), the experts ~82% of the weights."""
    return dataclasses.replace(
        small_config(), hidden_size=512, num_attention_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=160, shared_expert_intermediate_size=256)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        return sum(self.outputs)


def make_workload(n: int, p_range: tuple[int, int], o_range: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*p_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*o_range) for _ in range(n)])


@dataclass
class Result:
    system: str
    seconds: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def generated_tps(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds


def run_engine(model: torch.nn.Module, w: Workload, args: argparse.Namespace,
               batch_invariant: bool = False, logprobs: int | None = None
               ) -> tuple[Result, list[list[int]], Engine]:
    longest = max(len(p) + o for p, o in zip(w.prompts, w.outputs, strict=True))
    pages = args.max_num_seqs * -(-longest // args.block_size) + 8
    engine = Engine(model, EngineConfig(block_size=args.block_size, num_blocks=pages,  # type: ignore[arg-type]
                                        max_num_seqs=args.max_num_seqs,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        backend=args.backend, batch_invariant=batch_invariant))
    # warm-up (excluded): one short request
    engine.add_request("warm", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2,
                                                         ignore_eos=True))
    list(engine.stream())
    engine.reset_stats()
    start = time.perf_counter()
    for i, (p, o) in enumerate(zip(w.prompts, w.outputs, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=o,
                                                      ignore_eos=True, logprobs=logprobs))
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    for out in engine.stream():
        if out.finished:
            tokens[out.request_id] = list(out.token_ids)
            if out.logprobs is not None:
                lps[out.request_id] = [d[t].logprob for d, t in
                                       zip(out.logprobs, out.token_ids, strict=True)]
    seconds = time.perf_counter() - start
    res = Result("engine_batch_invariant" if batch_invariant else "engine", seconds,
                 w.prompt_tokens, sum(len(t) for t in tokens.values()))
    engine.rollout_logprobs = [lps.get(f"r{i}", []) for i in range(len(w.prompts))]  # type: ignore[attr-defined]
    return res, [tokens[f"r{i}"] for i in range(len(w.prompts))], engine


def builtin_dlogp(dtype: str, invariant: bool) -> float:
    """max |score - rollout logprob| of the trained built-in model on held-out passages."""
    from pagedhybrid.engine import load_engine
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    ids = load_tokenizer(default_model_dir()).encode(heldout_text_path().read_text())
    rng = random.Random(0)
    prompts = []
    for _ in range(32):
        n = rng.randint(16, 200)
        s = rng.randrange(0, len(ids) - n)
        prompts.append(ids[s:s + n])
    engine = load_engine(None, dtype="bfloat16" if dtype == "bf16" else "float32",
                         batch_invariant=invariant, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {o.request_id: o for o in engine.stream() if o.finished}
    outs = [done[str(i)] for i in range(len(prompts))]
    scored = engine.score(prompts, [list(o.token_ids) for o in outs])
    return max(abs(d[t].logprob - v) for o, sc in zip(outs, scored, strict=True)
               for d, t, v in zip(o.logprobs or (), o.token_ids, sc, strict=True))


def bench_batch_invariant(model: torch.nn.Module, w: Workload, args: argparse.Namespace
                          ) -> dict[str, object]:
    rows: dict[str, dict[str, float]] = {}
    for invariant in (False, True):
        res, toks, engine = run_engine(model, w, args, invariant, logprobs=0)
        start = time.perf_counter()
        scored = engine.score(w.prompts, toks)
        score_s = time.perf_counter() - start
        dlogp = max(abs(a - b) for s, r in zip(scored, engine.rollout_logprobs, strict=True)  # type: ignore[attr-defined]
                    for a, b in zip(s, r, strict=True))
        rows["batch_invariant" if invariant else "default"] = {
            "seconds": res.seconds, "generated_tok_s": res.generated_tps,
            "total_tok_s": res.total_tps, "max_abs_dlogp": dlogp, "score_s": score_s,
            "score_tok_s": sum(len(p) + len(t) for p, t in zip(w.prompts, toks, strict=True))
            / score_s, "kernels": engine.kernels.reason}
        print(f"{'batch-invariant' if invariant else 'default':15s}: {res.seconds:7.2f} s, "
              f"{res.generated_tps:7.1f} gen tok/s, max |dlogp| {dlogp:.3e}, recompute "
              f"{rows['batch_invariant' if invariant else 'default']['score_tok_s']:.0f} tok/s",
              flush=True)
    default = model.backend  # the last engine left the invariant bundle: take the default one
    from pagedhybrid.kernels.backend import select

    model.use_backend(select(args.backend, model.config, model.dtype).backend)  # type: ignore[union-attr]
    seqs = [p + t for p, t in zip(w.prompts, toks, strict=True)]
    start = time.perf_counter()
    for s in seqs:
        model.forward_dense(torch.tensor([s]))  # type: ignore[operator]
    dense_s = time.perf_counter() - start
    model.use_backend(default)  # type: ignore[union-attr]
    dense_tps = sum(len(s) for s in seqs) / dense_s
    inv, base = rows["batch_invariant"], rows["default"]
    out = {"rows": rows, "throughput_ratio": inv["generated_tok_s"] / base["generated_tok_s"],
           "dense_forward_tok_s": dense_tps,
           "score_vs_dense_forward": inv["score_tok_s"] / dense_tps}
    print(f"batch-invariant / default throughput: {out['throughput_ratio']:.2f}x (goal >= 0.75);"
          f" recompute {inv['score_tok_s']:.0f} tok/s vs default dense forward {dense_tps:.0f}"
          f" tok/s ({out['score_vs_dense_forward']:.2f}x)")
    out["builtin_max_abs_dlogp"] = {m: builtin_dlogp(args.dtype, m == "batch_invariant")
                                    for m in ("default", "batch_invariant")}
    print(f"trained built-in model ({args.dtype}), max |dlogp| rollout vs recompute: default "
          f"{out['builtin_max_abs_dlogp']['default']:.3e}, batch-invariant "
          f"{out['builtin_max_abs_dlogp']['batch_invariant']:.1e}")
    return out


def _hf_generate(hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int
                 ) -> torch.Tensor:
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_single(hf: torch.nn.Module, w: Workload) -> tuple[Result, list[list[int]]]:
    _hf_generate(hf, torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.int64), 2)
    outs = []
    start = time.perf_counter()
    for p, o in zip(w.prompts, w.outputs, strict=True):
        ids = torch.tensor([p])
        outs.append(_hf_generate(hf, ids, torch.ones_like(ids), o)[0, len(p):].tolist())
    seconds = time.perf_counter() - start
    return Result("hf_single", seconds, w.prompt_tokens, w.generated_tokens), outs


def run_hf_padded(hf: torch.nn.Module, w: Workload, batch: int) -> Result:
    start = time.perf_counter()
    for lo in range(0, len(w.prompts), batch):
        ps, os_ = w.prompts[lo:lo + batch], w.outputs[lo:lo + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        _hf_generate(hf, ids, mask, max(os_))
    seconds = time.perf_counter() - start
    return Result("hf_padded", seconds, w.prompt_tokens, w.generated_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="32 requests, prompts 16-64, outputs 8-24 (minutes on 2 cores)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    p.add_argument("--output-range", type=int, nargs=2, default=(16, 128))
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf-single", action="store_true")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="weights and activations of both systems (KV pages follow)")
    p.add_argument("--backend", default="auto", help="engine kernels: auto|native|torch")
    p.add_argument("--batch-invariant", action="store_true",
                   help="default vs batch-invariant engine (and the recompute), no HF")
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts hybrid (moe_config) vs HF Qwen3_5MoeForCausalLM")
    p.add_argument("--out", default="benchmarks/results/engine.json")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_range, args.output_range = 32, (16, 64), (8, 24)

    import transformers

    cfg = moe_config() if args.moe else small_config()
    with tempfile.TemporaryDirectory(prefix="ph-bench-") as tmp:
        write_checkpoint(Path(tmp), cfg, random_weights(cfg, seed=args.seed))
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        model = load(tmp, dtype=dtype)
        if args.batch_invariant:
            w = make_workload(args.requests, tuple(args.prompt_range),
                              tuple(args.output_range), cfg.vocab_size, args.seed)
            doc = {"benchmark": "engine --batch-invariant", "dtype": args.dtype,
                   "workload": {"requests": args.requests,
                                "prompt_range": list(args.prompt_range),
                                "output_range": list(args.output_range)},
                   **bench_batch_invariant(model, w, args)}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
            return 0
        hf_class = (transformers.Qwen3_5MoeForCausalLM if args.moe
                    else transformers.Qwen3_5ForCausalLM)
        hf = hf_class.from_pretrained(tmp, dtype=dtype).eval()
        n_params = sum(t.numel() for t in model.state_dict().values()) - (
            cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
        w = make_workload(args.requests, tuple(args.prompt_range), tuple(args.output_range),
                          cfg.vocab_size, args.seed)
        print(f"model: {n_params / 1e6:.0f}M params, {cfg.num_hidden_layers} layers "
              f"({len(cfg.full_attention_layers)} full), hidden {cfg.hidden_size}, vocab "
              f"{cfg.vocab_size}; workload: {args.requests} requests, prompts "
              f"{args.prompt_range}, outputs {args.output_range}; torch threads "
              f"{torch.get_num_threads()}; {args.dtype}", flush=True)
        eng, eng_tokens, engine = run_engine(model, w, args)
        print(f"engine done in {eng.seconds:.1f} s ({engine.kernels.reason})", flush=True)
        results = [eng]
        match = None
        if not args.skip_hf_single:
            single, hf_tokens = run_hf_single(hf, w)
            print(f"hf_single done in {single.seconds:.1f} s", flush=True)
            results.append(single)
            match = sum(a == b for a, b in zip(eng_tokens, hf_tokens, strict=True))
        padded = run_hf_padded(hf, w, args.max_num_seqs)
        print(f"hf_padded done in {padded.seconds:.1f} s", flush=True)
        results.append(padded)

    st = engine.stats
    ov32, steps32 = st.overhead_at(32)
    print(f"\n{'system':<10} {'seconds':>9} {'gen tok/s':>10} {'total tok/s':>12} "
          f"{'engine x (gen)':>15}")
    for r in results:
        print(f"{r.system:<10} {r.seconds:9.2f} {r.generated_tps:10.2f} {r.total_tps:12.2f} "
              f"{eng.generated_tps / r.generated_tps:15.2f}")
    print(f"engine: {st.steps} steps, {st.computed_tokens / max(st.steps, 1):.1f} tokens/step, "
          f"peak {st.peak_running} running, {st.preemptions} preemptions; overhead "
          f"(scheduling + batch building) {100 * st.overhead_fraction:.2f}% of step time overall"
          f", {100 * ov32:.2f}% over {steps32} steps with >= 32 running; forward "
          f"{100 * st.forward_s / st.total_s:.1f}%, sampling {100 * st.sample_s / st.total_s:.1f}%")
    if match is not None:
        print(f"greedy tokens equal to HF one-at-a-time: {match}/{len(w.prompts)} requests")
    doc = {
        "benchmark": "engine", "quick": args.quick, "moe": args.moe, "params": n_params,
        "config": {k: v for k, v in asdict(cfg).items() if k != "layer_types"},
        "layer_types": list(cfg.layer_types),
        "workload": {"requests": args.requests, "prompt_range": list(args.prompt_range),
                     "output_range": list(args.output_range), "seed": args.seed,
                     "prompt_tokens": w.prompt_tokens, "generated_tokens": w.generated_tokens},
        "engine_config": {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "kernels": engine.kernels.reason},
        "dtype": args.dtype,
        "results": [{"system": r.system, "seconds": r.seconds,
                     "generated_tokens_per_s": r.generated_tps,
                     "total_tokens_per_s": r.total_tps} for r in results],
        "ratios": {f"engine_vs_{r.system}": {"generated": eng.generated_tps / r.generated_tps,
                                             "total": eng.total_tps / r.total_tps}
                   for r in results[1:]},
        "engine_stats": {"steps": st.steps, "preemptions": st.preemptions,
                         "peak_running": st.peak_running,
                         "overhead_fraction": st.overhead_fraction,
                         "overhead_fraction_at_32_running": ov32, "steps_at_32_running": steps32,
                         "forward_fraction": st.forward_s / st.total_s},
        "greedy_match_hf_single": match,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
