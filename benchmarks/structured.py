"""Structured outputs: what the grammar mask costs a decode step, what grammars cost to compile
(llguidance and xgrammar side by side), and whether compiling holds up other requests.

1. ``decode``: built-in model, batches of 1 / 16 / 64 requests decoding 64 tokens each, greedy;
   sides ``off`` and ``off_control``: unconstrained; the others: every request constrained by
   a grammar that never ends early (the batch keeps its size): ``regex`` ``[a-z ]{300}`` and
   ``json_string`` (a JSON object whose string field runs on), and ``refused`` (``[0-9]{300}``:
   the text model's every greedy pick is refused: the worst case of masking after the pick;
   a refused row tries its next best tokens, and takes its mask where none is allowed) --
   decode tok/s and the step time, medians of ``--repeats`` alternating runs, the slowdowns
   paired within a repeat, and the share of constrained rows that took a mask
   (``masked_rows``: the others' unmasked greedy pick was allowed,
   ``SamplingParams.masks_after_pick``, or, refused, their next best was,
   ``step_sampling._next_best``).
2. ``libraries``: on the built-in model's tokenizer, llguidance (what the engine uses) and, when
   it is installed, xgrammar (``pip install --no-deps xgrammar apache-tvm-ffi``: no
   dependency of this package): the tokenizer view's build time, compile time of JSON schemas
   (2 / 8 / 32 properties) and of the regex, and the mask time per step of B matchers (B = 1 /
   16 / 64)
   sampling from random logits through the mask -- the same work for both.
3. ``ttft``: 32 unconstrained requests arriving every 10 ms, alone and again beside 8
   constrained ones arriving among them, each with a grammar never seen before (JSON schemas of
   32 properties, and one lexeme of 60,000 words that takes ~0.5 s to compile): the
   unconstrained requests' time to first token, median and p90 (goal: within 10%); beside the
   same 8 requests unconstrained (the same load, no grammar: ``compiling_vs_plain`` is what the
   grammars cost the others) and constrained with their grammars compiled already (masks, no
   compiling); and the 8 requests' own TTFT.

States the CPU; writes JSON.

    python benchmarks/structured.py [--out FILE] [--sections decode libraries ttft]
"""

from __future__ import annotations

# isort: off
import pagedhybrid  # noqa: F401 -- first: it sets OpenMP's spin before torch loads
# isort: on

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pagedhybrid.engine import SamplingParams, load_engine
from pagedhybrid.engine.sample.structured import (
    Grammars,
    StructuredOutputs,
    allowed_tokens,
    consume,
)
from pagedhybrid.kernels.native import cpu_form
from pagedhybrid.kernels.native.sampling import greedy_rows
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer

PROMPT = "And the LORD said unto Moses,"
REGEX = "[a-z ]{300}"  # every letter-or-blank token allowed: the widest mask walk
REFUSED = "[0-9]{300}"  # the worst case: the model's every pick refused, masked and picked again
LONG_STRING = {"type": "object", "required": ["text"], "additionalProperties": False,
               "properties": {"text": {"type": "string", "minLength": 1000}}}  # a JSON answer


def schema(n: int, salt: int = 0) -> dict:
    return {"type": "object", "required": [f"k{salt}_{i}" for i in range(n)],
            "additionalProperties": False,
            "properties": {f"k{salt}_{i}": [{"type": "string", "maxLength": 12},
                                            {"type": "integer", "minimum": 0, "maximum": 99},
                                            {"type": "boolean"}][i % 3] for i in range(n)}}


def decode_rate(engine, batch: int, params: SamplingParams) -> dict[str, float]:
    """``batch`` requests after their first token: decode ``tok_s``, the median ``step_ms``,
    ``sample_ms`` (the sampler's share of a step, grammar work included: timed by the runner,
    so less at the mercy of this machine's drift than the step) and ``masked_rows`` (the share
    of constrained rows that took a mask)."""
    st = engine.stats
    rows, masks, sample_s, steps0 = (st.constrained_rows, st.grammar_masks, st.sample_s,
                                     st.steps)
    for i in range(batch):
        engine.add_request(f"r{engine.stats.steps}-{i}", PROMPT, params)
    steps: list[float] = []
    tokens = 0
    started = False
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if started:
            steps.append(dt)
            tokens += sum(len(o.new_token_ids) for o in outs)
        started = started or (all(o.num_generated for o in outs) and len(outs) == batch)
    return {"tok_s": tokens / max(sum(steps), 1e-9), "step_ms": 1e3 * statistics.median(steps),
            "sample_ms": 1e3 * (st.sample_s - sample_s) / max(st.steps - steps0, 1),
            "masked_rows": (st.grammar_masks - masks) / max(st.constrained_rows - rows, 1)}


def decode_section(engine, batches: list[int], repeats: int) -> list[dict]:
    """Per batch: unconstrained (``off``), again unconstrained (``off_control``: the noise
    floor of the comparison) and under each grammar, in turn within each repeat; a side's
    ``slowdown_paired`` is the median over repeats of its slowdown against that repeat's
    ``off`` run (this machine's drift between repeats is larger than the mask's cost), and
    ``sampler_share`` the median of its extra sampler time (grammar work) over that ``off``
    run's step time."""
    sides = {"off": None, "off_control": None, "regex": {"regex": REGEX},
             "json_string": {"json": LONG_STRING}, "refused": {"regex": REFUSED}}
    rows = []
    for batch in batches:
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
        for _ in range(repeats):
            for side, spec in sides.items():
                runs[side].append(decode_rate(engine, batch, SamplingParams(
                    temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=spec)))
        row: dict = {"batch": batch}
        for side, rs in runs.items():
            for k in ("tok_s", "step_ms", "sample_ms"):
                row[f"{side}_{k}"] = statistics.median(r[k] for r in rs)
            if sides[side] is not None:
                row[f"{side}_masked_rows"] = statistics.median(r["masked_rows"] for r in rs)
            if side != "off":  # the mask's share of the decode time
                row[f"{side}_slowdown"] = 1 - row[f"{side}_tok_s"] / row["off_tok_s"]
                row[f"{side}_slowdown_paired"] = statistics.median(
                    1 - r["tok_s"] / o["tok_s"] for r, o in zip(rs, runs["off"], strict=True))
                row[f"{side}_sampler_share"] = statistics.median(
                    (r["sample_ms"] - o["sample_ms"]) / o["step_ms"]
                    for r, o in zip(rs, runs["off"], strict=True))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: tuple[int, ...]) -> None:
        self.vocab, self.eos = vocab, eos
        t0 = time.perf_counter()
        self.grammars = Grammars(tok, vocab, eos)
        self.view_ms = 1e3 * (time.perf_counter() - t0)

    def compile(self, spec: StructuredOutputs):
        return self.grammars.matcher(spec)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def masks(self, ms) -> torch.Tensor:
        return allowed_tokens(ms, self.vocab, self.eos)

    def accept(self, m, token: int) -> bool:
        return consume(m, token, self.eos) and not m.is_stopped()


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: int) -> None:
        import transformers
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        hf = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.view_ms = 1e3 * (time.perf_counter() - t0)
        self.version = getattr(xgr, "__version__", None)

    def compile(self, spec: StructuredOutputs):
        if spec.regex is not None:
            return self.compiler.compile_regex(spec.regex)
        return self.compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def masks(self, ms) -> torch.Tensor:
        bits = self.xgr.allocate_token_bitmask(len(ms), self.vocab)
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bits, i)
        return bits

    def accept(self, m, token: int) -> bool:
        return bool(m.accept_token(token)) and not m.is_terminated()


def library_section(batches: list[int], steps: int = 40) -> list[dict]:
    tok = load_tokenizer(default_model_dir())
    vocab = 4096
    eos = tuple(tok.eos_token_ids)
    libs: list = [_Llguidance(tok, vocab, eos)]
    try:
        libs.append(_Xgrammar(vocab))
    except ImportError as exc:
        print(f"xgrammar not installed ({exc}): llguidance alone", flush=True)
    out = []
    gen = torch.Generator().manual_seed(0)
    for lib in libs:
        row: dict = {"library": lib.name, "tokenizer_view_ms": lib.view_ms, "compile_ms": {}}
        for n in (2, 8, 32):
            t0 = time.perf_counter()
            lib.compile(StructuredOutputs(json=schema(n, salt=n + 1000)))
            row["compile_ms"][f"json_{n}"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiled = lib.compile(StructuredOutputs(regex=REGEX))
        row["compile_ms"]["regex"] = 1e3 * (time.perf_counter() - t0)
        row["mask_ms_per_step"] = {}
        for batch in batches:
            ms = [lib.matcher(compiled) for _ in range(batch)]
            spent = []
            for _ in range(steps):
                t0 = time.perf_counter()
                allowed = lib.masks(ms)  # packed, as the sampler reads it
                spent.append(time.perf_counter() - t0)
                picks = greedy_rows(torch.randn(batch, vocab, generator=gen), allowed).tolist()
                for i, (m, t) in enumerate(zip(ms, picks, strict=True)):
                    if not lib.accept(m, t):
                        ms[i] = lib.matcher(compiled)  # ended: a fresh one keeps B
            row["mask_ms_per_step"][str(batch)] = 1e3 * statistics.median(spent)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def ttft_run(engine, beside: str | None, salt: int) -> tuple[list[float], list[float]]:
    """TTFT (s) of the unconstrained requests -- 32 arriving every 10 ms -- and of 8 more
    among them (``beside``): ``"constrained"``, each with a grammar never compiled before
    (unless ``salt`` repeats), or ``"plain"``, the same 8 requests unconstrained."""
    arrivals = [(0.010 * i, f"u{salt}-{i}", SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True))
                for i in range(32)]
    if beside:
        words = " | ".join(f'"w{salt}x{i}"' for i in range(60000))
        specs = [{"json": schema(32, salt=salt * 10 + j)} for j in range(7)]
        specs.append({"grammar": f"start: W\nW: {words}"})
        arrivals += [(0.010 * (4 * j + 1) + 0.005, f"c{salt}-{j}", SamplingParams(
            temperature=1.0, seed=j, max_tokens=24,
            structured_outputs=spec if beside == "constrained" else None))
            for j, spec in enumerate(specs)]
    arrivals.sort(key=lambda a: a[0])
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    while arrivals or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while arrivals and arrivals[0][0] <= now:
            _, rid, params = arrivals.pop(0)
            engine.add_request(rid, PROMPT, params)
            added[rid] = time.perf_counter()
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for o in engine.step():
            if o.request_id not in first and o.token_ids:
                first[o.request_id] = time.perf_counter()
    return ([first[r] - added[r] for r in added if r.startswith("u")],
            [first[r] - added[r] for r in added if r.startswith("c")])


def ttft_section(repeats: int) -> dict:
    """TTFT of the unconstrained requests alone, beside the 8 others unconstrained
    (``beside_plain``: the same load, no grammar), beside them constrained with their grammars
    compiled already (``beside_warm``: masks, no compiling) and beside them compiling (new
    grammars); and the 8 others' own TTFT (what their compiling costs them)."""
    engine = load_engine(None, num_blocks=1024, max_num_seqs=64)
    sides = {"alone": (None, None), "beside_plain": ("plain", None),
             "beside_warm": ("constrained", 100), "beside_compiling": ("constrained", None)}
    runs: dict[str, list[float]] = {s: [] for s in sides}
    own: dict[str, list[float]] = {s: [] for s in sides}
    ttft_run(engine, "constrained", 100)  # warm-up, and the grammars of the warm runs
    for k in range(repeats):
        for side, (beside, salt) in sides.items():
            mine, theirs = ttft_run(engine, beside, k if salt is None else salt)
            runs[side] += mine
            own[side] += theirs
    out: dict = {}
    for side, ts in runs.items():
        ts = sorted(ts)
        out[side] = {"p50_ms": 1e3 * statistics.median(ts),
                     "p90_ms": 1e3 * ts[int(0.9 * (len(ts) - 1))]}
        if own[side]:
            out[side]["beside_p50_ms"] = 1e3 * statistics.median(own[side])
    for side in ("beside_plain", "beside_warm", "beside_compiling"):
        for q in ("p50", "p90"):
            out[f"{side}_{q}_ratio"] = out[side][f"{q}_ms"] / out["alone"][f"{q}_ms"]
    for q in ("p50", "p90"):  # what the grammars cost the others, the load being the same
        out[f"compiling_vs_plain_{q}"] = (out["beside_compiling"][f"{q}_ms"]
                                          / out["beside_plain"][f"{q}_ms"])
    out["compiling_vs_warm_p50"] = (out["beside_compiling"]["p50_ms"]
                                    / out["beside_warm"]["p50_ms"])
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sections", nargs="+", default=["decode", "libraries", "ttft"])
    ap.add_argument("--out", default="benchmarks/results/structured.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out: dict = {"cpu": cpu, "cpu_form": cpu_form(), "threads": 2}
    if "decode" in args.sections:
        out["decode"] = decode_section(load_engine(None, num_blocks=1024, max_num_seqs=64),
                                       args.batches, args.repeats)
    if "libraries" in args.sections:
        out["libraries"] = library_section(args.batches)
    if "ttft" in args.sections:
        out["ttft"] = ttft_section(args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
