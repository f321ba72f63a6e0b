"""Plots of the committed benchmark results, for the docs' benchmarks page and the README.

Reads result files that the benchmark scripts wrote (``benchmarks/results/``, committed by name:
``git ls-files benchmarks/results``) and writes one PNG per figure (``docs/assets/plots/``), each
titled with the machine its result file records (the ``cpu`` field; the kernel form and threads
where the file has them):

* ``engine-throughput.png`` <- ``weights-xeon-grouped.json`` (``benchmarks/weights.py``): decode
  tok/s against batch size, one panel per bit width (32 / 16 / 8 / 4), every system of the file
  at that width: ours (fp32, bf16, int8, int4) against llama.cpp (f32, bf16, q8_0, q4_0,
  q4_K_M) on the same 141M hybrid and threads. Batch 1 is ``tg128``, batch 8 / 32 the batched
  decode (``b8`` / ``b32``). The ratio ours / llama.cpp per batch is printed in each panel.
* ``real-size-throughput.png`` <- ``real_size-packed.json`` (``benchmarks/real_size.py``): decode
  tok/s at batch 1 and 16 on the real Qwen3.5 checkpoints (one panel per size), ours against
  vLLM's CPU build (and HF transformers where the file has it); the median of the file's
  interleaved runs per system (a pre-change ``baseline`` run is left out).
* ``latency-distribution.png`` <- ``latency-final.json`` (``benchmarks/latency.py``): inter-token
  latency and time to first token under Poisson load (1 / 4 / 8 requests/s), p50 (dot) to p99
  (bar end) per request rate, ours (bf16, fp32) against vLLM's CPU build (bf16); the file's
  pre-change ``baseline`` engine is left out.
* ``drafter-acceptance.png`` <- ``speculative-builtin.json`` (``benchmarks/speculative.py``): the
  acceptance rate per draft position of each drafter (n-gram prompt lookup, the checkpoint's MTP
  head) per workload and temperature; per drafter, workload and temperature the row with the most
  verified draft tokens (batch 16 with every draft verified, where the file has it).

A result file that is missing, not JSON, or not in the layout its script writes stops the run with
the file's path and what was expected (exit status 2); nothing is drawn from a guess.

    python benchmarks/plots.py                      # all of them, into docs/assets/plots/
    python benchmarks/plots.py --out /tmp/plots --results benchmarks/results
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "assets" / "plots"
DPI = 100

# system colours, the same in every figure
COLOURS = {"ours": "#1f6fb4", "pagedhybrid": "#1f6fb4", "llama.cpp": "#d9661f",
           "vllm": "#3a9a3a", "hf": "#8a5cb8"}
NAMES = {"ours": "pagedhybrid", "pagedhybrid": "pagedhybrid", "llama.cpp": "llama.cpp",
         "vllm": "vLLM CPU", "hf": "HF transformers"}
# weight format -> bits per weight (the panel it goes in)
BITS = {"fp32": 32, "f32": 32, "bf16": 16, "f16": 16, "int8": 8, "q8_0": 8,
        "int4": 4, "q4_0": 4, "q4_K_M": 4, "q4_k_m": 4}
# weights.py's keys per batch size
BATCH_KEYS = {1: "tg128", 8: "b8", 32: "b32"}
DRAFTERS = {"ngram": "n-gram", "on": "n-gram", "mtp": "MTP head"}


class ResultError(Exception):
    """A result file that cannot be plotted: the message starts with its path."""


def load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ResultError(f"{path}: no such result file")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: expected a JSON object at the top, got {type(doc).__name__}")
    return doc


def _where(keys: tuple[str | int, ...]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if " " not in k and "/" not in k
                   else f"[{k!r}]" for k in keys).lstrip(".")


def dig(doc: Any, path: Path, *keys: str | int, kind: type | tuple[type, ...] = object) -> Any:
    """``doc[k0][k1]...`` from the file's top, or a ResultError naming the file and the field."""
    node = doc
    for i, key in enumerate(keys):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise ResultError(f"{path}: no field {_where(keys[: i + 1])}") from None
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise ResultError(f"{path}: field {_where(keys)} is {type(node).__name__} "
                          f"{node!r:.60}, expected {expected}")
    return node


def number(doc: Any, path: Path, *keys: str | int) -> float:
    return float(dig(doc, path, *keys, kind=(int, float)))


def machine(doc: dict[str, Any], path: Path) -> str:
    """The machine a result file records: CPU model and cores, kernel form, threads."""
    cpu = dig(doc, path, "cpu", kind=str).strip()
    if not cpu:
        raise ResultError(f"{path}: field 'cpu' is empty (the machine the result ran on)")
    name, _, flags = cpu.removeprefix("CPU: ").partition(";")
    parts = [name.strip()]
    form = doc.get("native_form") or doc.get("cpu_form")
    if isinstance(form, str) and form:
        parts.append(f"{form.split(' (')[0]} kernels")
    elif flags:
        found = flags.split()
        isa = next((label for flag, label in (("avx512_bf16", "AVX-512 BF16"),
                                              ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                    if flag in found), None)
        if isa:
            parts.append(isa)
    if isinstance(doc.get("threads"), int):
        parts.append(f"{doc['threads']} threads")
    return ", ".join(parts)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "figure.titlesize": 11,
                         "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _title(fig, headline: str, doc: dict[str, Any], src: Path) -> None:
    fig.suptitle(f"{headline}\n{machine(doc, src)} · {src.name}")


def _save(fig, out: Path) -> None:
    """A 256-colour PNG (a third of the RGBA file's bytes; plots have few colours)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _pyplot().close(fig)
    buf.seek(0)
    with Image.open(buf) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    palette.save(out, format="PNG", optimize=True)


def _system_format(key: str, path: Path) -> tuple[str, str]:
    system, _, fmt = key.rpartition(" ")
    if not system or fmt not in BITS:
        raise ResultError(f"{path}: speed entry {key!r} is not '<system> <format>' with a "
                          f"format of {sorted(BITS)}")
    return system, fmt


def plot_engine_throughput(src: Path, out: Path) -> None:
    """Decode tok/s against batch size per bit width, every system in ``speed`` (weights.py)."""
    doc = load(src)
    speed = dig(doc, src, "speed", kind=dict)
    if not speed:
        raise ResultError(f"{src}: field 'speed' is empty")
    curves: dict[int, list[tuple[str, str, list[int], list[float]]]] = {}
    for key in speed:
        system, fmt = _system_format(key, src)
        entry = dig(doc, src, "speed", key, kind=dict)
        batches = [b for b, k in BATCH_KEYS.items() if k in entry]
        if 1 not in batches:
            raise ResultError(f"{src}: no field {_where(('speed', key, 'tg128'))} "
                              "(batch 1 decode tok/s)")
        tok_s = [number(doc, src, "speed", key, BATCH_KEYS[b]) for b in batches]
        curves.setdefault(BITS[fmt], []).append((system, fmt, batches, tok_s))
    plt = _pyplot()
    widths = sorted(curves, reverse=True)
    fig, axes = plt.subplots(1, len(widths), figsize=(2.9 * len(widths), 3.8), squeeze=False,
                             layout="constrained")
    for ax, bits in zip(axes[0], widths, strict=True):
        seen: dict[str, int] = {}
        for system, fmt, batches, tok_s in curves[bits]:
            n = seen[system] = seen.get(system, -1) + 1
            ax.plot(batches, tok_s, marker="o", ms=4, lw=1.8,
                    color=COLOURS.get(system, "#555555"), ls=("-", "--", ":")[n % 3],
                    label=f"{NAMES.get(system, system)} {fmt}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(BATCH_KEYS), [str(b) for b in BATCH_KEYS])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{bits}-bit weights")
        ax.set_xlabel("batch size (sequences decoding)")
        ax.legend(loc="upper left", fontsize=7.5, frameon=False)
        ours = next((c for c in curves[bits] if c[0] == "ours"), None)
        peer = next((c for c in curves[bits] if c[0] == "llama.cpp"), None)
        if ours and peer and ours[2] == peer[2]:
            ratios = " · ".join(f"{a / b:.2f}×" for a, b in zip(ours[3], peer[3], strict=True))
            ax.text(0.98, 0.03, f"ours / llama.cpp {peer[1]}:\n{ratios}", ha="right",
                    va="bottom", transform=ax.transAxes, fontsize=7.5, color="#333333")
    axes[0][0].set_ylabel("decode tok/s (all sequences)")
    _title(fig, "Decode throughput against batch size: pagedhybrid vs llama.cpp, per weight "
           "width (141M hybrid)", doc, src)
    _save(fig, out)


def plot_real_size_throughput(src: Path, out: Path) -> None:
    """Decode tok/s at batch 1 and 16 on the real checkpoints, ours against vLLM CPU / HF."""
    doc = load(src)
    runs = dig(doc, src, "runs", kind=list)
    groups: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for i, run in enumerate(runs):
        if str(dig(doc, src, "runs", i, kind=dict).get("file", "")).startswith("baseline"):
            continue
        size = dig(doc, src, "runs", i, "size", kind=str)
        dtype = dig(doc, src, "runs", i, "dtype", kind=str)
        system = dig(doc, src, "runs", i, "system", kind=str)
        if "decode_tok_s_b16" not in run:
            continue
        pair = (number(doc, src, "runs", i, "decode_tok_s_b1"),
                number(doc, src, "runs", i, "decode_tok_s_b16"))
        groups.setdefault((size, dtype), {}).setdefault(system, []).append(pair)
    # the panels where a peer ran beside us (the comparison the figure is for)
    panels = sorted((k for k, v in groups.items() if len(v) > 1), key=lambda k: (k[1], k[0]))
    if not panels:
        raise ResultError(f"{src}: no model size and dtype with more than one system's "
                          "decode_tok_s_b1 / decode_tok_s_b16")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.6), squeeze=False,
                             layout="constrained")
    for ax, (size, dtype) in zip(axes[0], panels, strict=True):
        for system, pairs in sorted(groups[(size, dtype)].items()):
            tok_s = [statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)]
            label = f"{NAMES.get(system, system)}" + (f" (median of {len(pairs)})"
                                                      if len(pairs) > 1 else "")
            ax.plot([1, 16], tok_s, marker="o", ms=4, lw=1.8,
                    color=COLOURS.get(system, "#555555"), label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 16], ["1", "16"])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"Qwen3.5 {size} {dtype}")
        ax.set_xlabel("batch size (sequences decoding)")
        ax.legend(loc="upper left", fontsize=7.5, frameon=False)
    axes[0][0].set_ylabel("decode tok/s (all sequences)")
    _title(fig, "Decode throughput on the real checkpoints: pagedhybrid vs vLLM CPU", doc, src)
    _save(fig, out)


def plot_latency_distribution(src: Path, out: Path, model: str = "builtin") -> None:
    """ITL and TTFT p50..p99 against request rate under Poisson load (latency.py's online rows)."""
    doc = load(src)
    results = dig(doc, src, "results", kind=dict)
    series = []
    for key in results:
        parts = key.split("/")
        if len(parts) != 3:
            raise ResultError(f"{src}: results key {key!r} is not '<model>/<dtype>/<system>'")
        name, dtype, system = parts
        if name != model or system == "baseline" or "online" not in results[key]:
            continue
        dig(doc, src, "results", key, "online", "rows", kind=list)
        series.append((system, dtype, key))
    if not series:
        raise ResultError(f"{src}: no results.'{model}/<dtype>/<system>'.online rows to plot")
    series.sort(key=lambda s: (s[0] != "current", s[0], s[1] != "bf16"))
    plt = _pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), layout="constrained")
    width = 0.8 / len(series)
    first = ("results", series[0][2], "online", "rows")
    for j, (system, dtype, key) in enumerate(series):
        online = ("results", key, "online", "rows")
        rows = dig(doc, src, *online, kind=list)
        label = f"{NAMES.get('ours' if system == 'current' else system, system)} {dtype}"
        colour = COLOURS.get("ours" if system == "current" else system, "#555555")
        faded = dtype != "bf16" and system == "current"
        for ax, metric in zip(axes, ("itl", "ttft"), strict=True):
            xs, p50, p99 = [], [], []
            for i in range(len(rows)):
                if number(doc, src, *online, i, "rate") != number(doc, src, *first, i, "rate"):
                    raise ResultError(f"{src}: {_where((*online, i, 'rate'))} differs from "
                                      f"{_where((*first, i, 'rate'))}: one set of rates per file")
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                p50.append(1e3 * number(doc, src, *online, i, f"{metric}_p50_s"))
                p99.append(1e3 * number(doc, src, *online, i, f"{metric}_p99_s"))
            ax.vlines(xs, p50, p99, color=colour, lw=5, alpha=0.35 if faded else 0.6)
            ax.plot(xs, p50, "o", color=colour, ms=5, alpha=0.6 if faded else 1.0,
                    label=label if metric == "itl" else None)
            ax.plot(xs, p99, "_", color=colour, ms=10, mew=2, alpha=0.6 if faded else 1.0)
    rates = [number(doc, src, *first, i, "rate") for i in range(len(dig(doc, src, *first)))]
    for ax, title in zip(axes, ("inter-token latency", "time to first token"), strict=True):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(rates)), [f"{r:g} req/s" for r in rates])
        ax.set_xlabel("request rate (Poisson arrivals)")
        ax.set_title(f"{title}: p50 (dot) to p99 (bar end)")
        ax.set_ylabel("ms")
        ax.grid(axis="x", visible=False)
    axes[0].legend(loc="upper left", fontsize=7.5, frameon=False)
    _title(fig, "Latency under Poisson load (streamed /v1/completions, 64 output tokens, "
           f"{'built-in' if model == 'builtin' else model} model)", doc, src)
    _save(fig, out)


def plot_drafter_acceptance(src: Path, out: Path) -> None:
    """Acceptance per draft position of each drafter (speculative.py's rows)."""
    doc = load(src)
    rows = dig(doc, src, "rows", kind=list)
    k = int(number(doc, src, "k"))
    best: dict[tuple[str, float, str], dict[str, Any]] = {}
    for i in range(len(rows)):
        method = dig(doc, src, "rows", i, "side", kind=str).removesuffix("_forced")
        if method not in DRAFTERS:
            continue
        accept = dig(doc, src, "rows", i, "accept_per_pos", kind=list)
        if len(accept) != k:
            raise ResultError(f"{src}: {_where(('rows', i, 'accept_per_pos'))} has "
                              f"{len(accept)} positions, the file's k is {k}")
        row = {"accept": [number(doc, src, "rows", i, "accept_per_pos", p) for p in range(k)],
               "batch": int(number(doc, src, "rows", i, "batch")),
               "draft_tokens": int(number(doc, src, "rows", i, "draft_tokens"))}
        key = (dig(doc, src, "rows", i, "workload", kind=str),
               number(doc, src, "rows", i, "temperature"), method)
        if key not in best or row["draft_tokens"] > best[key]["draft_tokens"]:
            best[key] = row
    if not best:
        raise ResultError(f"{src}: no rows with a drafter side ({sorted(DRAFTERS)})")
    workloads = sorted({w for w, _, _ in best}, key=lambda w: (w != "repetitive", w))
    bars = sorted({(m, t) for _, t, m in best}, key=lambda mt: (DRAFTERS[mt[0]], mt[1]))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.8 * len(workloads), 3.8),
                             squeeze=False, sharey=True, layout="constrained")
    width = 0.8 / len(bars)
    shades = {"ngram": ("#d9661f", "#f0b27f"), "on": ("#d9661f", "#f0b27f"),
              "mtp": ("#1f6fb4", "#8fbde0")}
    for ax, workload in zip(axes[0], workloads, strict=True):
        for j, (method, temp) in enumerate(bars):
            row = best.get((workload, temp, method))
            if row is None:
                continue
            xs = [p + 1 + (j - (len(bars) - 1) / 2) * width for p in range(k)]
            colour = shades[method][0 if temp == 0 else 1]
            ax.bar(xs, row["accept"], width=width * 0.95,
                   color=colour, label=f"{DRAFTERS[method]}, T={temp:g} "
                   f"(batch {row['batch']}, {row['draft_tokens']} drafted)")
        ax.set_xticks(range(1, k + 1), [str(p) for p in range(1, k + 1)])
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.15)
        ax.set_title(f"{workload} workload")
        ax.grid(axis="x", visible=False)
        ax.legend(loc="upper right", fontsize=7, frameon=False)
    axes[0][0].set_ylabel("acceptance rate")
    _title(fig, f"Drafter acceptance per draft position (k={k}, built-in model)", doc, src)
    _save(fig, out)


# png name -> (default result file, plot function)
FIGURES: dict[str, tuple[str, Callable[[Path, Path], None]]] = {
    "engine-throughput.png": ("weights-xeon-grouped.json", plot_engine_throughput),
    "real-size-throughput.png": ("real_size-packed.json", plot_real_size_throughput),
    "latency-distribution.png": ("latency-final.json", plot_latency_distribution),
    "drafter-acceptance.png": ("speculative-builtin.json", plot_drafter_acceptance),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="folder of the result JSONs (default benchmarks/results)")
    ap.add_argument("--out", type=Path, default=OUT,
                    help="folder the PNGs are written to (default docs/assets/plots)")
    for png, (default, _) in FIGURES.items():
        ap.add_argument(f"--{png.removesuffix('.png')}", metavar="FILE", default=default,
                        help=f"result file for {png}, in --results (default {default})")
    args = ap.parse_args(argv)
    for png, (_, plot) in FIGURES.items():
        src = args.results / getattr(args, png.removesuffix(".png").replace("-", "_"))
        out = args.out / png
        try:
            plot(src, out)
        except ResultError as e:
            print(f"plots.py: {e}", file=sys.stderr)
            return 2
        try:
            shown_src = src.resolve().relative_to(ROOT)
        except ValueError:
            shown_src = src
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB) from {shown_src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
