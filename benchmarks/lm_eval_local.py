"""The real lm-eval harness through ``pagedhybrid serve``, checked against the same scores offline.

Two local tasks, written as YAML (+ jsonl data) into a temporary folder and loaded with
``TaskManager(include_path=...)``; nothing is downloaded (``HF_*_OFFLINE=1``):

* ``pagedhybrid_kjv_next_verse`` -- multiple choice (``acc``, ``acc_norm``): the context is one
  verse of the built-in model's held-out King James text (``heldout.txt``), the choices are the
  true next verse and 3 other verses of the same chapter (``--mc-items`` items, fixed seed).
* ``pagedhybrid_kjv_rolling`` -- ``loglikelihood_rolling`` (``word_perplexity``,
  ``byte_perplexity``, ``bits_per_byte``) over the first ``--docs`` chapters of the held-out text,
  each cut to at most ``--doc-chars`` characters at a verse boundary; docs longer than the
  context roll over several windows.

Systems:

* ``server tok=False`` / ``server tok=True`` -- lm-eval's ``local-completions`` model against a real
  ``pagedhybrid serve`` process (built-in model, fp32, ``--max-model-len``), ``tokenizer`` = the
  built-in model folder (``tokenizer_backend=huggingface``), ``tokenized_requests`` False (the
  prompt goes as text and the server re-tokenises it) and True (token ids), ``max_length`` = the
  server's ``max_model_len``, ``num_concurrent`` requests in flight. Each loglikelihood request is
  ``echo: true, logprobs: 1, max_tokens: 1``; lm-eval sums ``token_logprobs[ctxlen:-1]``.
  With ``tokenized_requests=False`` lm-eval decodes its token ids to text and the server encodes
  that text with the BOS this tokenizer adds: one token more than lm-eval's ``ctxlen`` counts, so
  that mode is expected to differ (and a full rolling window no longer fits ``max_model_len``);
  ``tokenized_requests=True`` (lm-eval's default) is the mode that must match.
* ``offline`` -- the same lm-eval pipeline (its tokenisation, context/continuation split, left
  truncation to ``max_length - 1``, rolling windows and metric code), with only the model call
  replaced: each request's tokens ``inp[:ctxlen]`` / ``inp[ctxlen:]`` are scored in-process by
  ``Engine.score(prompts, completions)`` (fp32 logprobs, one full forward per sequence). Its
  ``is_greedy`` is not computed (no metric of these tasks uses it).

Reported: per task and metric the three values and the largest |server - offline|, and per
request (every choice of every item; every rolling doc) the largest |loglikelihood difference|
and how many exceed ``--tol`` (1e-4). A mode whose requests the server refuses is reported with
the error and no figures. Writes JSON (``--out``).

    python benchmarks/lm_eval_local.py [--mc-items 60] [--docs 4] [--max-model-len 512]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _server import OFFLINE_ENV, free_port, start_pagedhybrid, stop

os.environ.update(OFFLINE_ENV)

MC_TASK = "pagedhybrid_kjv_next_verse"
ROLL_TASK = "pagedhybrid_kjv_rolling"
METRICS = {MC_TASK: ["acc", "acc_norm"],
           ROLL_TASK: ["word_perplexity", "byte_perplexity", "bits_per_byte"]}
HEADER = re.compile(r"(?:[1-3] )?[A-Z][A-Za-z ]* \d+")  # "Genesis 40", "1 Kings 3"


def chapters(text: str) -> list[list[str]]:
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if HEADER.fullmatch(line) or not out:
            out.append([])
            if HEADER.fullmatch(line):
                continue
        out[-1].append(line)
    return [c for c in out if c]


def next_verse_items(chs: list[list[str]], n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    spots = [(c, i) for c, ch in enumerate(chs) if len(ch) >= 6 for i in range(len(ch) - 1)]
    items = []
    for c, i in rng.sample(spots, min(n, len(spots))):
        ch = chs[c]
        others = rng.sample([j for j in range(len(ch)) if j not in (i, i + 1)], 3)
        choices = [ch[i + 1]] + [ch[j] for j in others]
        rng.shuffle(choices)
        items.append({"context": ch[i], "choices": choices, "label": choices.index(ch[i + 1])})
    return items


def rolling_docs(chs: list[list[str]], n: int, max_chars: int) -> list[dict[str, str]]:
    docs = []
    for ch in chs[:n]:
        text = ""
        for verse in ch:
            if text and len(text) + 1 + len(verse) > max_chars:
                break
            text = f"{text}\n{verse}" if text else verse
        docs.append({"text": text})
    return docs


def write_tasks(folder: Path, items: list[dict[str, Any]], docs: list[dict[str, str]]) -> None:
    """Task YAML files (written as JSON, which YAML reads) over local jsonl data."""
    for name, rows in (("next_verse", items), ("rolling", docs)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1.0}}
    mc = {**common, "task": MC_TASK,
          "dataset_kwargs": {"data_files": {"test": str(folder / "next_verse.jsonl")}},
          "output_type": "multiple_choice", "doc_to_text": "{{context}}",
          "doc_to_choice": "choices", "doc_to_target": "label", "target_delimiter": "\n",
          "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                          for m in METRICS[MC_TASK]]}
    roll = {**common, "task": ROLL_TASK,
            "dataset_kwargs": {"data_files": {"test": str(folder / "rolling.jsonl")}},
            "output_type": "loglikelihood_rolling", "doc_to_text": "",
            "doc_to_target": "text", "metric_list": [{"metric": m} for m in METRICS[ROLL_TASK]]}
    (folder / f"{MC_TASK}.yaml").write_text(json.dumps(mc, indent=1) + "\n")
    (folder / f"{ROLL_TASK}.yaml").write_text(json.dumps(roll, indent=1) + "\n")


def offline_lm_class() -> type:
    """lm-eval's ``local-completions`` model with the HTTP call replaced by ``Engine.score``."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class OfflineScore(LocalCompletionsAPI):  # type: ignore[misc]
        engine: Any = None

        def _loglikelihood_tokens(self, requests: Any, **kwargs: Any) -> list[tuple[float, bool]]:
            # lm-eval's own truncation: inputs[-(max_length - 1):], ctxlen shifted alike
            inputs, ctxlens, _ = self.batch_loglikelihood_requests([requests])
            lps = self.engine.score([x[:c] for x, c in zip(inputs, ctxlens, strict=True)],
                                    [x[c:] for x, c in zip(inputs, ctxlens, strict=True)])
            return [(float(sum(lp)), False) for lp in lps]

    return OfflineScore


def request_lls(samples: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(doc_id, request index) -> the loglikelihood lm-eval got for it."""
    out = {}
    for s in samples:
        for k, r in enumerate(s["resps"]):
            x = r[0] if isinstance(r, list | tuple) else r
            out[(int(s["doc_id"]), k)] = float(x[0] if isinstance(x, list | tuple) else x)
    return out


class ApiFailures(logging.Handler):
    """Keeps lm-eval's "API request failed ... Response text: ..." warnings (the server's
    error body), which its exceptions leave out."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "API request failed" in msg:
            self.messages.append(msg)


def evaluate(model: Any, model_args: dict[str, Any] | None, folder: Path, task: str
             ) -> tuple[dict[str, float], dict[tuple[int, int], float]]:
    """One task through ``lm_eval.simple_evaluate``: its metrics and per-request loglikelihoods."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model=model, model_args=model_args, tasks=[task],
                          task_manager=TaskManager(include_path=str(folder)), batch_size=1,
                          log_samples=True, bootstrap_iters=0, random_seed=0)
    assert res is not None
    return ({m: float(res["results"][task][f"{m},none"]) for m in METRICS[task]},
            request_lls(res["samples"][task]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mc-items", type=int, default=60)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-chars", type=int, default=4000)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--num-concurrent", type=int, default=8)
    ap.add_argument("--tokenized", choices=["both", "false", "true"], default="both",
                    help="which tokenized_requests modes to run through the server")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--out", default="benchmarks/results/lm_eval_local.json")
    a = ap.parse_args()

    import torch

    from pagedhybrid.engine import load_engine
    from pagedhybrid.models.qwen35 import default_model_dir
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    torch.set_num_threads(2)
    model_dir = default_model_dir()
    chs = chapters(heldout_text_path().read_text(encoding="utf-8"))
    items = next_verse_items(chs, a.mc_items, seed=0)
    docs = rolling_docs(chs, a.docs, a.doc_chars)
    modes = {"both": [False, True], "false": [False], "true": [True]}[a.tokenized]
    name = "default-model"
    results: dict[str, Any] = {}
    logs = Path("benchmarks/results")
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets-cache")
        write_tasks(folder, items, docs)

        t0 = time.perf_counter()
        OfflineScore = offline_lm_class()
        OfflineScore.engine = load_engine(None, max_model_len=a.max_model_len)
        offline = OfflineScore(model=name, base_url=None, tokenizer=str(model_dir),
                               tokenizer_backend="huggingface", max_length=a.max_model_len)
        scores, offline_lls = {}, {}
        for t in METRICS:
            scores[t], offline_lls[t] = evaluate(offline, None, folder, t)
        results["offline"] = {"scores": scores, "seconds": time.perf_counter() - t0}

        port = free_port()
        proc = start_pagedhybrid(port, logs / "lm_eval_local-server.log", name,
                                 "--max-model-len", str(a.max_model_len),
                                 "--max-num-seqs", "16")
        try:
            for tokenized in modes:
                key = f"server tok={tokenized}"
                args = {"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": name,
                        "tokenizer": str(model_dir), "tokenizer_backend": "huggingface",
                        "tokenized_requests": tokenized, "max_length": a.max_model_len,
                        "num_concurrent": a.num_concurrent, "max_retries": 1, "timeout": 120}
                r: dict[str, Any] = {"scores": {}, "requests": {}, "errors": {}}
                t0 = time.perf_counter()
                for t in METRICS:
                    failures = ApiFailures()
                    logging.getLogger("lm_eval").addHandler(failures)
                    try:
                        r["scores"][t], lls = evaluate("local-completions", args, folder, t)
                    except Exception as exc:  # the server refused, or answered without logprobs
                        msg = f"{type(exc).__name__}: {exc}"
                        if failures.messages:
                            msg = f"{failures.messages[0]} ({msg})"
                        r["errors"][t] = msg[:2000]
                        print(f"{key} {t}: FAILED {msg[:500]}", flush=True)
                        continue
                    finally:
                        logging.getLogger("lm_eval").removeHandler(failures)
                    d = [abs(v - offline_lls[t][k]) for k, v in lls.items()]
                    r["requests"][t] = {"count": len(d), "max_abs_diff": max(d, default=0.0),
                                        "over_tol": sum(x > a.tol for x in d)}
                r["seconds"] = time.perf_counter() - t0
                results[key] = r
        finally:
            stop(proc)

    servers = [k for k in results if k.startswith("server")]
    print(f"\nlm-eval {_version()} local-completions via pagedhybrid serve vs offline "
          f"Engine.score; {len(items)} MC items x 4 choices, {len(docs)} rolling docs, "
          f"max_length {a.max_model_len}")
    head = "".join(f" {k:>17s}" for k in servers)
    print(f"{'task':28s} {'metric':16s}{head} {'offline':>12s} {'max |diff|':>11s}")
    for t, ms in METRICS.items():
        for m in ms:
            off = results["offline"]["scores"][t][m]
            vals, cells = [], []
            for k in servers:
                v = results[k].get("scores", {}).get(t, {}).get(m)
                cells.append(f" {v:17.6f}" if v is not None else f" {'error':>17s}")
                if v is not None:
                    vals.append(abs(v - off))
            d = f"{max(vals):11.2e}" if vals else f"{'-':>11s}"
            print(f"{t:28s} {m:16s}{''.join(cells)} {off:12.6f} {d}")
    print(f"\nper request loglikelihood, server - offline (tolerance {a.tol:g}):")
    # the verdict: token-id requests (text requests gain the server's BOS, see the docstring)
    judged = ["server tok=True"] if "server tok=True" in servers else servers
    ok = True
    for k in servers:
        r = results[k]
        for t in METRICS:
            if t in r["errors"]:
                ok &= k not in judged
                print(f"  {k:17s} {t:28s} error: {r['errors'][t][:300]}")
                continue
            s = r["requests"][t]
            ok &= s["over_tol"] == 0 or k not in judged
            print(f"  {k:17s} {t:28s} {s['count']:4d} requests, max |diff| "
                  f"{s['max_abs_diff']:.2e}, over tolerance: {s['over_tol']}")
    results["match"] = ok
    print(f"{', '.join(judged)} == offline within {a.tol:g} for every request: "
          f"{'yes' if ok else 'NO'}")
    report = {"lm_eval_version": _version(), "max_model_len": a.max_model_len,
              "mc_items": len(items), "rolling_docs": len(docs), "tol": a.tol, **results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


if __name__ == "__main__":
    sys.exit(main())
