"""Token-level perplexity of a text: the quality measure every change is judged by.

Sliding windows (the HF recipe): the text is tokenised once (with the tokenizer's special
tokens, e.g. a leading BOS), windows of ``context`` tokens start every ``stride`` tokens, and
each window scores only the tokens the previous window did not reach, so every token but the
first is scored exactly once with at least ``context - stride`` tokens of history (all of it
while the text is shorter than the window). ``ppl = exp(-sum(log p) / count)``.

Backends:

* ``torch`` -- the engine's packed paged path: every window is an ordinary request with
  ``SamplingParams(prompt_logprobs=0, max_tokens=1)`` (vLLM's way), all queued at once and
  continuously batched; the scored log-probabilities are the prompt logprobs of its tail.
* ``onnxruntime`` -- an exported package (``pagedhybrid export``, unpruned logits) run by
  ``PackedGraphSession`` (PagedAttention on the WebGPU EP, pages bound in place): windows are
  packed into steps of at most ``ORT_CHUNK`` new tokens per window (onnxruntime-ep-webgpu 0.4.0
  returns wrong rows for a sequence with >= 32 new tokens in one call), each window with its own
  pages and fixed-state rows; log-softmax of every row.

Bad input (empty or one-token text, context beyond ``max_position_embeddings``, a package from
another checkpoint, a pruned package) raises ``PerplexityError`` naming what is wrong.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedhybrid import dtypes
from pagedhybrid.errors import PagedHybridError

ORT_CHUNK = 31
ORT_MAX_BATCH = 8


class PerplexityError(PagedHybridError, ValueError):
    """A perplexity run that cannot be done as asked (``what`` was wrong, the ``rule``)."""

    def __init__(self, what: str, rule: str, got: object = None) -> None:
        self.what, self.rule, self.got = what, rule, got
        super().__init__(f"perplexity: {what} {rule}" + (f" (got {got})" if got is not None
                                                          else ""))


class Window(NamedTuple):
    begin: int  # first token of the window in the text
    end: int  # one past its last token
    scored: int  # the window's last ``scored`` tokens are scored here


def windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The sliding windows over ``num_tokens`` tokens (every token after the first scored once)."""
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + context, num_tokens)
        scored = end - max(prev_end, 1)  # token 0 has no context
        out.append(Window(begin, end, scored))
        prev_end = end
        if end == num_tokens:
            return out
        begin += stride


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood (nats per token)
    tokens: int  # scored tokens
    windows: int
    context: int
    stride: int
    backend: str
    dtype: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def line(self) -> str:
        return (f"perplexity {self.perplexity:.4f} (nll {self.nll:.5f} nats/token) over "
                f"{self.tokens} tokens in {self.windows} windows (context {self.context}, stride "
                f"{self.stride}; {self.backend} {self.dtype}) in {self.seconds:.1f} s")


Progress = Callable[[int, int], None]  # (windows done, total)


def _check(ids: Sequence[int], context: int, stride: int, max_positions: int) -> None:
    if len(ids) < 2:
        raise PerplexityError("text", "must hold at least 2 tokens", len(ids))
    if not isinstance(context, int) or context < 2:
        raise PerplexityError("context", "must be an int >= 2", context)
    if context > max_positions:
        raise PerplexityError("context", f"must not exceed the model's max_position_embeddings "
                              f"{max_positions}", context)
    if not isinstance(stride, int) or not 1 <= stride <= context:
        raise PerplexityError("stride", f"must be an int in [1, context={context}]", stride)


def _finish(logps: list[float], wins: list[Window], context: int, stride: int, backend: str,
            dtype: str, start: float) -> PerplexityResult:
    total = -float(np.sum(np.asarray(logps, dtype=np.float64)))
    if not math.isfinite(total):
        raise PerplexityError("model", "gave non-finite log-probabilities", total)
    nll = total / len(logps)
    return PerplexityResult(math.exp(nll), nll, len(logps), len(wins), context, stride, backend,
                            dtype, time.perf_counter() - start)


# -- torch: the engine's packed path ---------------------------------------------------------------
def engine_perplexity(engine: Any, ids: Sequence[int], context: int, stride: int,
                      progress: Progress | None = None) -> PerplexityResult:
    """Perplexity through ``engine`` (a ``pagedhybrid.Engine``) via prompt logprobs."""
    from pagedhybrid.engine import SamplingParams

    _check(ids, context, stride, engine.model.config.max_position_embeddings)
    if context + 1 > engine.scheduler.config.max_model_len:
        raise PerplexityError("context", f"needs max_model_len >= context + 1 "
                              f"({engine.scheduler.config.max_model_len})", context)
    start = time.perf_counter()
    wins = windows(len(ids), context, stride)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    names = [f"ppl-{i}" for i in range(len(wins))]
    for name, w in zip(names, wins, strict=True):
        engine.add_request(name, list(ids[w.begin:w.end]), params)
    got: dict[str, Any] = {}
    for out in engine.stream():
        if out.finished:
            got[out.request_id] = out
            if progress is not None:
                progress(len(got), len(wins))
    logps: list[float] = []
    for name, w in zip(names, wins, strict=True):
        out = got[name]
        if out.finish_reason == "error" or out.prompt_logprobs is None:
            raise PerplexityError("model", f"failed on window {name}: {out.error}")
        lps = out.prompt_logprobs
        n = w.end - w.begin
        for j in range(n - w.scored, n):
            logps.append(lps[j][ids[w.begin + j]].logprob)
    return _finish(logps, wins, context, stride, "torch", dtypes.logical_name(engine.model.dtype),
                   start)


# -- onnxruntime: an exported package --------------------------------------------------------------
def check_package(package: Path, model_dir: Path) -> dict[str, Any]:
    """The package's genai_config, after checking it was exported from ``model_dir``'s model
    with every token's logits."""
    from pagedhybrid.export import constants as c
    from pagedhybrid.models.qwen35 import Qwen35Config

    path = package / c.GENAI_CONFIG_FILE
    if not path.is_file():
        raise PerplexityError("--package", f"must be an exported package ({c.GENAI_CONFIG_FILE} "
                              f"missing in {package})")
    genai = json.loads(path.read_text(encoding="utf-8"))
    model = genai.get("model", {})
    dec = model.get("decoder", {})
    cfg = Qwen35Config.from_model_dir(model_dir)
    want = {"vocab_size": (model.get("vocab_size"), cfg.vocab_size),
            "hidden_size": (dec.get("hidden_size"), cfg.hidden_size),
            "num_hidden_layers": (dec.get("num_hidden_layers"), cfg.num_hidden_layers),
            "num_attention_heads": (dec.get("num_attention_heads"), cfg.num_attention_heads),
            "num_key_value_heads": (dec.get("num_key_value_heads"), cfg.num_key_value_heads),
            "head_size": (dec.get("head_size"), cfg.head_dim)}
    bad = {k: v for k, v in want.items() if v[0] != v[1]}
    if bad:
        raise PerplexityError("--package", f"was exported from another checkpoint than "
                              f"{model_dir} (package vs model: {bad})")
    for name in ("tokenizer.json",):
        a, b = package / name, model_dir / name
        if a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes():
            raise PerplexityError("--package", f"has another {name} than {model_dir}")
    import onnx

    graph = onnx.load(str(package / c.MODEL_FILE), load_external_data=False).graph
    logits = next((o for o in graph.output if o.name == c.LOGITS), None)
    rows = logits.type.tensor_type.shape.dim[0].dim_param if logits is not None else None
    if rows != c.DIM_TOKENS:
        raise PerplexityError("--package", "must return logits for every token (export it "
                              "without --prune-logits)", rows)
    return genai


@dataclass
class _OrtSeq:
    window: Window
    tokens: list[int]
    pages: list[int]
    conv: dict[int, np.ndarray]
    rec: dict[int, np.ndarray]
    done: int = 0


def package_perplexity(package: str | Path, model_dir: str | Path, ids: Sequence[int],
                       context: int, stride: int, placement: str = "webgpu",
                       progress: Progress | None = None) -> PerplexityResult:
    """Perplexity of an exported package in onnxruntime (see the module docstring)."""
    from pagedhybrid.export.session import PackedGraphSession, batch_inputs
    from pagedhybrid.models.qwen35 import PackedBatch, Qwen35Config

    package, model_dir = Path(package), Path(model_dir)
    genai = check_package(package, model_dir)
    cfg = Qwen35Config.from_model_dir(model_dir)
    _check(ids, context, stride, cfg.max_position_embeddings)
    start = time.perf_counter()
    wins = windows(len(ids), context, stride)
    block = int(genai["engine"]["dynamic_batching"]["block_size"])
    per_seq = -(-context // block)
    session = PackedGraphSession(package, ORT_MAX_BATCH * per_seq, placement=placement)
    conv_dtype = session.io_dtype
    conv_shape = (1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    rec_shape = (1, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                 cfg.linear_key_head_dim)
    logps: list[float] = []
    queue = list(wins)
    free = [list(range(k * per_seq, (k + 1) * per_seq)) for k in range(ORT_MAX_BATCH)]
    live: list[_OrtSeq] = []
    finished = 0
    while queue or live:
        while queue and free:
            w = queue.pop(0)
            live.append(_OrtSeq(w, list(ids[w.begin:w.end]), free.pop(0),
                                {i: np.zeros(conv_shape, conv_dtype) for i in
                                 session.linear_layers},
                                {i: np.zeros(rec_shape, np.float32) for i in
                                 session.linear_layers}))
        counts = [min(ORT_CHUNK, len(s.tokens) - s.done) for s in live]
        batch = PackedBatch.from_sequences(
            [s.tokens[s.done:s.done + n] for s, n in zip(live, counts, strict=True)],
            [s.done for s in live], [s.pages for s in live], list(range(len(live))))
        conv = {i: np.ascontiguousarray(np.concatenate([s.conv[i] for s in live]))
                for i in session.linear_layers}
        rec = {i: np.ascontiguousarray(np.concatenate([s.rec[i] for s in live]))
               for i in session.linear_layers}
        out = session.step(**batch_inputs(batch), conv=conv, recurrent=rec)
        logp = torch.from_numpy(out.logits).double().log_softmax(dim=-1).numpy()  # [N, V]
        row = 0
        for b, (s, n) in enumerate(zip(live, counts, strict=True)):
            for i in session.linear_layers:
                s.conv[i], s.rec[i] = conv[i][b:b + 1].copy(), rec[i][b:b + 1].copy()
            length = len(s.tokens)
            for j in range(s.done, s.done + n):  # row j predicts token j + 1
                if length - s.window.scored <= j + 1 < length:
                    logps.append(float(logp[row + j - s.done, s.tokens[j + 1]]))
            row += n
            s.done += n
        for s in [s for s in live if s.done == len(s.tokens)]:
            live.remove(s)
            free.append(s.pages)
            finished += 1
            if progress is not None:
                progress(finished, len(wins))
    dtype = dtypes.logical_name(session.io_dtype)
    return _finish(logps, wins, context, stride, f"onnxruntime/{placement}", dtype, start)


# -- command line --------------------------------------------------------------------------------
def register_subcommands(subparsers: Any) -> None:
    p = subparsers.add_parser("perplexity", help="token-level perplexity of a text (sliding "
                              "window) through the engine or an exported package")
    p.add_argument("--model", default=None,
                   help="HF Qwen3.5 checkpoint folder (default: the built-in model)")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file (default: the built-in model's held-out text)")
    p.add_argument("--context", type=int, default=512, help="window length in tokens")
    p.add_argument("--stride", type=int, default=None, help="window step (default context/2)")
    p.add_argument("--dtype", default="float32", help="torch backend: float32|bfloat16|float16")
    p.add_argument("--quantization", default=None, metavar="FORMAT",
                   help="torch backend: projection weights in int8 / int4 (as the engine's "
                   "--quantization: int8, int4, int4:128, ... :asym)")
    p.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch")
    p.add_argument("--package", default=None, help="exported package (--backend onnxruntime)")
    p.add_argument("--placement", choices=("webgpu", "paged_only"), default="webgpu",
                   help="onnxruntime: every node the WebGPU EP takes, or PagedAttention only")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only the first N tokens of the text")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=perplexity_main)


def perplexity_main(args: Any) -> int:
    import sys

    from rich.console import Console
    from rich.progress import Progress as Bar

    from pagedhybrid.engine.loader import load_engine
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    try:
        model_dir = Path(args.model) if args.model else default_model_dir()
        text_path = Path(args.text) if args.text else heldout_text_path()
        if not text_path.is_file():
            raise PerplexityError("--text", "must be a readable file", str(text_path))
        try:
            text = text_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise PerplexityError("--text", "must be UTF-8 text", str(exc)) from None
        if not text.strip():
            raise PerplexityError("--text", "is empty", str(text_path))
        from pagedhybrid.models.qwen35 import Qwen35Config

        cfg = Qwen35Config.from_model_dir(model_dir)
        tok = load_tokenizer(model_dir, cfg.vocab_size)
        ids = tok.encode(text)
        if args.max_tokens is not None:
            ids = ids[:args.max_tokens]
        stride = args.stride if args.stride is not None else max(1, args.context // 2)
        _check(ids, args.context, stride, cfg.max_position_embeddings)
        if args.backend == "onnxruntime" and args.quantization:
            raise PerplexityError("--quantization", "applies to the torch backend (a package "
                                  "holds its weights as exported: pagedhybrid export --weights)")
        if args.backend == "onnxruntime" and not args.package:
            raise PerplexityError("--package", "is required with --backend onnxruntime")
        bar = Bar(console=Console(stderr=True), transient=True)
        task = bar.add_task("perplexity", total=None)
        with bar:
            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            if args.backend == "torch":
                engine = load_engine(model_dir, dtype=args.dtype, max_model_len=args.context + 1,
                                     quantization=args.quantization)
                result = engine_perplexity(engine, ids, args.context, stride, tick)
            else:
                result = package_perplexity(args.package, model_dir, ids, args.context, stride,
                                            args.placement, tick)
    except PagedHybridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result.as_dict(), "model": str(model_dir), "text": str(text_path)},
                         indent=2))
    else:
        print(result.line())
    return 0
