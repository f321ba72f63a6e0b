"""llama.cpp as a CPU benchmark peer: GGUF conversion, quantisation and its own benchmark tools.

llama.cpp is the copy vendored in the ``llama-cpp-python`` 0.3.36 source package (llama.cpp
commit ``0c1e570``, which knows ``Qwen3_5ForCausalLM`` as arch ``qwen35``), built by
``scripts/build_llama_cpp.sh [DEST]`` (default ``.cache/llama.cpp``; CPU only, ``-march=native``,
static binaries; 4.5 min with 2 jobs) into ``DEST/build/bin``: ``llama-bench``,
``llama-batched-bench``, ``llama-perplexity``, ``llama-quantize``, ``llama-tokenize``. The
converter is the tree's ``convert_hf_to_gguf.py``, run with this venv's python (``transformers``,
``numpy``, ``torch``) and the tree's own ``gguf-py`` (nothing is installed into the venv).

Two conversion details for this repo's checkpoints (see :func:`convert`): their byte-level BPE
tokenizers are unknown to the converter's pre-tokenizer hash table (it raises), so the
pre-tokenizer falls back to ``gpt-2`` (the regex of HF ``ByteLevel(use_regex=True)``); and the
MTP head (``mtp.*``) is left out unless ``mtp=True`` (the converter would keep it as an extra
NextN layer that plain decoding never runs).

Every function raises :class:`LlamaCppError` (the command, its exit status, the stderr tail) when
a tool fails. Import as ``benchmarks.llama_cpp`` or, with ``benchmarks/`` on ``sys.path``, as
``llama_cpp``; ``python benchmarks/llama_cpp.py MODEL.gguf`` runs :func:`bench` on a file.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VERSION = "0.3.36"  # llama-cpp-python source package (scripts/build_llama_cpp.sh pins the same)
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / ".cache" / "llama.cpp"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# Runs convert_hf_to_gguf.py with a pre-tokenizer fallback: argv = SRC PRE converter-args...
_CONVERT_SHIM = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not pre:
            raise
        base.logger.warning("pre-tokenizer hash unknown: using %r", pre)
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class LlamaCppError(RuntimeError):
    """A llama.cpp tool (or the converter) failed or is not built; ``crashed``: it died of a
    signal (e.g. SIGSEGV in its AMX kernels: ``repack=False`` below)."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


# ``repack=False`` in the tools below: no extra buffer types (the repacked q4_0 / q8_0 layouts
# and the AMX kernels). llama.cpp 0.3.36 built with GGML_NATIVE on a Xeon with AMX-INT8 dies of
# SIGSEGV in ggml_backend_amx_mul_mat on every quantised batch of more than one token (prompts,
# llama-batched-bench, llama-perplexity) while its single-token decode runs; callers retry such
# a crash without them and say so.


def find(dest: str | Path | None = None) -> Path | None:
    """The build folder (``DEST/build``, binaries in its ``bin/``), or None when not built."""
    build = Path(dest or DEFAULT_DEST) / "build"
    return build if (build / ".built").is_file() and (build / "bin" / "llama-bench").is_file() \
        else None


def source_dir(dest: str | Path | None = None) -> Path:
    """The llama.cpp source tree (``convert_hf_to_gguf.py``, ``gguf-py/``)."""
    return Path(dest or DEFAULT_DEST) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def binary(name: str, dest: str | Path | None = None) -> Path:
    build = find(dest)
    path = build / "bin" / name if build else None
    if path is None or not path.is_file():
        raise LlamaCppError(f"{name}: llama.cpp is not built under {Path(dest or DEFAULT_DEST)};"
                            " run scripts/build_llama_cpp.sh")
    return path


def _run(cmd: Sequence[str | Path], timeout: float | None = None, *, name: str = "",
         env: dict[str, str] | None = None, stdin: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    cmd = [str(c) for c in cmd]
    name = name or Path(cmd[0]).name
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, errors="replace",
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        raise LlamaCppError(f"{name} timed out after {timeout} s: {' '.join(cmd)}\n"
                            f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}"
                            ) from None
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-25:])
        raise LlamaCppError(f"{name} failed (exit {p.returncode}): {' '.join(cmd)}\n{tail}",
                            crashed=p.returncode < 0)
    return p


def convert(model_dir: str | Path, outtype: str, out_path: str | Path, *,
            pre_tokenizer: str = "gpt-2", mtp: bool = False,
            dest: str | Path | None = None, timeout: float | None = 3600) -> Path:
    """HF checkpoint folder -> GGUF (``outtype``: f32, f16, bf16 or q8_0) at ``out_path``.

    ``pre_tokenizer``: the ``tokenizer.ggml.pre`` used when the converter does not recognise the
    tokenizer ("" to fail instead). ``mtp``: keep the MTP head as NextN tensors."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} not in {OUTTYPES}")
    src = source_dir(dest)
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppError(f"convert_hf_to_gguf.py: not found under {src};"
                            " run scripts/build_llama_cpp.sh")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = [str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    if not mtp:
        args.append("--no-mtp")
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # the shim puts the tree's gguf-py on sys.path
    _run([sys.executable, "-c", _CONVERT_SHIM, src, pre_tokenizer, *args], timeout,
         name="convert_hf_to_gguf.py", env=env)
    return out


def quantize(src_gguf: str | Path, qtype: str, out_path: str | Path, *, threads: int = 2,
             dest: str | Path | None = None, timeout: float | None = 3600) -> Path:
    """``llama-quantize``: ``src_gguf`` (best an f32/bf16 file) -> ``qtype`` (q4_0, q4_K_M, q8_0,
    ...) at ``out_path``."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([binary("llama-quantize", dest), src_gguf, out, qtype, str(threads)], timeout=timeout)
    return out


def bench(gguf: str | Path, threads: int = 2, pp: int = 512, tg: int = 128, reps: int = 3, *,
          repack: bool = True, extra: Sequence[str] = (), dest: str | Path | None = None,
          timeout: float | None = 3600) -> dict[str, Any]:
    """``llama-bench -o json``: prompt processing of ``pp`` tokens and generation of ``tg``.

    Returns ``pp`` / ``tg`` (tok/s, llama-bench's ``avg_ts`` over ``reps``), ``pp_median`` /
    ``tg_median`` (median of its samples), ``pp_std`` / ``tg_std``, ``model_size`` (bytes),
    ``n_params``, ``type`` (llama.cpp's model description) and ``raw`` (its JSON records)."""
    cmd = [binary("llama-bench", dest), "-m", gguf, "-t", str(threads), "-p", str(pp),
           "-n", str(tg), "-r", str(reps), "-o", "json", *([] if repack else ["--repack", "0"]),
           *extra]
    p = _run(cmd, timeout=timeout)
    try:
        rows = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        raise LlamaCppError(f"llama-bench: no JSON on stdout ({e}): {p.stdout[-500:]}") from None
    out: dict[str, Any] = {"raw": rows}
    for row in rows:
        key = "pp" if row["n_gen"] == 0 else "tg" if row["n_prompt"] == 0 else None
        if key:
            out[key] = row["avg_ts"]
            out[f"{key}_median"] = statistics.median(row["samples_ts"])
            out[f"{key}_std"] = row["stddev_ts"]
        out.update(model_size=row["model_size"], n_params=row["model_n_params"],
                   type=row["model_type"])
    return out


def batched(gguf: str | Path, threads: int = 2, n_parallel: Sequence[int] = (8, 32), *,
            npp: int = 128, ntg: int = 128, ctx: int | None = None, shared_prompt: bool = False,
            repack: bool = True, extra: Sequence[str] = (), dest: str | Path | None = None,
            timeout: float | None = 3600) -> dict[int, dict[str, float]]:
    """``llama-batched-bench``: ``B`` sequences of ``npp`` prompt + ``ntg`` generated tokens for
    each B in ``n_parallel``. Returns ``{B: {"tg": S_TG, "pp": S_PP, "total": S}}`` (tok/s; S_TG
    is the decode throughput of all B sequences together). ``ctx`` defaults to what the largest
    B needs."""
    n_pl = sorted(n_parallel)
    if ctx is None:
        ctx = npp + n_pl[-1] * ntg if shared_prompt else n_pl[-1] * (npp + ntg)
    cmd = [binary("llama-batched-bench", dest), "-m", gguf, "-t", str(threads), "-c", str(ctx),
           "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(map(str, n_pl)), "--output-format", "jsonl",
           *(["-pps"] if shared_prompt else []), *([] if repack else ["--no-repack"]), *extra]
    p = _run(cmd, timeout=timeout)
    out: dict[int, dict[str, float]] = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["pl"]] = {"tg": r["speed_tg"], "pp": r["speed_pp"], "total": r["speed"]}
    missing = [b for b in n_pl if b not in out]
    if missing:
        raise LlamaCppError(f"llama-batched-bench: no result for n_parallel {missing} "
                            f"(ctx {ctx} too small?)")
    return out


def perplexity(gguf: str | Path, text_path: str | Path, ctx: int = 512, *, threads: int = 2,
               repack: bool = True, extra: Sequence[str] = (), dest: str | Path | None = None,
               timeout: float | None = 3600) -> float:
    """``llama-perplexity`` on a text file: llama.cpp's "Final estimate" (windows of ``ctx``
    tokens, BOS first, each scored on its second half). The text must tokenise to >= 2*ctx."""
    cmd = [binary("llama-perplexity", dest), "-m", gguf, "-f", text_path, "-c", str(ctx),
           "-t", str(threads), *([] if repack else ["--no-repack"]), *extra]
    p = _run(cmd, timeout=timeout)
    m = re.search(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf)", p.stderr + p.stdout)
    if not m:
        tail = "\n".join(p.stderr.strip().splitlines()[-10:])
        raise LlamaCppError(f"llama-perplexity: no final estimate (text too short for ctx {ctx}?)"
                            f"\n{tail}")
    return float(m.group(1))


def tokenize(gguf: str | Path, text: str, *, bos: bool = False,
             dest: str | Path | None = None) -> list[int]:
    """``llama-tokenize`` of ``text`` (stdin, taken verbatim) with the GGUF's vocabulary."""
    cmd = [binary("llama-tokenize", dest), "-m", gguf, "--stdin", "--ids", "--log-disable",
           *([] if bos else ["--no-bos"])]
    p = _run(cmd, 600, stdin=text)
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in bench(sys.argv[1]).items() if k != "raw"}, indent=1))
