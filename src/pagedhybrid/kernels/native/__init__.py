"""Native CPU kernels: a torch C++ extension (``csrc/``), built ahead of time by ``make``.

Ops (registered as ``torch.ops.pagedhybrid_<form>.*``; ``library()`` is the chosen form's):

* ``paged_attention`` -- decode and short-query attention reading K/V pages in place (fp32,
  bf16, fp16 caches; fp32 accumulation), online softmax, all query heads of a GQA group per kv
  head, fixed KV splits of ``KV_SPLIT`` tokens merged in split order (deterministic, and the same
  whatever else is in the batch);
* ``gated_delta_decode`` / ``gated_delta_varlen`` -- the Gated DeltaNet recurrent step in place
  on the state pool; ``causal_conv_decode`` / ``causal_conv_varlen`` -- the varlen causal conv
  update in place on the conv pool;
* ``quant_linear`` / ``quant_dequantize`` -- products of int8 / int4 weights
  (``weightquant``'s MatMulNBits layout) with activations quantised per row, and a weight's rows
  dequantised for the prefill GEMM (``quant.py``);
* ``linear`` / ``linear_invariant`` -- ``x @ w^T`` with fp32 registers and accumulation (fp32,
  bf16 or fp16 activations and weights widened exactly; ``dense.py``): the fast form, and the
  form with one fixed reduction order per output element (``invariant.py``);
  ``silu_invariant`` / ``sigmoid_invariant``;
* ``greedy_rows`` -- the sampler's greedy pick: each fp32 logits row's first maximum (over the
  tokens a grammar's packed bitmask allows, when one is given), -1 for a row holding a NaN or
  an infinity or allowing nothing; ``apply_token_bitmask_`` -- ``-inf`` over the tokens such a
  mask refuses, in place (``sampling.py``).

Every op checks its arguments before it touches memory -- shapes, dtypes, the head ratio,
contiguity, every page-table entry it reads inside the page pool, state slots in range and
distinct -- and raises ``ValueError`` ("pagedhybrid.<op>: <argument>: <rule> (got ...)").

CPU forms. The kernels are written once against a vector type (``csrc/vec.h``) and compiled
once per form the CPU can run, fastest first:

* ``avx512_bf16`` -- AVX-512 F/BW/VL/DQ + AVX512-BF16: bf16 pages are multiplied as pairs by
  ``vdpbf16ps``;
* ``avx512_vnni`` -- AVX-512 + AVX512-VNNI without BF16 dot instructions (a Xeon such as
  Cascade / Ice Lake): bf16 widened to fp32 in registers, the int8 / int4 weights' dot
  products by ``vpdpbusd`` (the ``avx512_bf16`` form has it too: every CPU with AVX512-BF16 has
  VNNI; the others use ``vpmaddubsw`` + ``vpmaddwd``, the same integers);
* ``avx512`` -- AVX-512 without BF16 or VNNI dot instructions (a Skylake Xeon): bf16
  is widened to fp32 in registers (exact: bf16 is the high half of an fp32);
* ``avx2`` -- AVX2 + FMA + F16C, 8 lanes, bf16 widened the same way.

Each form is its own library (``_build/<form>/``) registering its ops under its own namespace, so
all the forms this CPU can run load side by side. ``status()`` picks the form at start: the
fastest whose instructions the CPU has (``/proc/cpuinfo`` flags), or the one named by the
environment variable ``PAGEDHYBRID_CPU_FEATURES`` (``avx512_bf16`` | ``avx512_vnni`` | ``avx512``
| ``avx2``;
``auto`` or unset: the fastest) -- to run the fallback forms on a newer CPU. It says which form
it chose (``NativeStatus.form``, e.g. ``"avx512 (bf16 via fp32 registers)"``; ``cpu_form()``).
A form the CPU cannot run is refused with the missing flags, never loaded.

Build: ``python -m pagedhybrid.kernels.native.build`` (``make native``; ``make run`` / ``make
test`` depend on it) compiles ``csrc/*.cpp`` with g++ and ninja through
``torch.utils.cpp_extension`` for every form of this CPU into ``_build/<form>/`` with a
``build.json`` stamp each (form, torch version, source digest) and a summary in
``_build/build.json``. A wheel (``pip install .``, ``pip install <sdist>``, ``python -m build``,
``make wheel``) runs the same build from its hook (``hatch_build.py``) for every form the
compiler builds and carries each form's library and stamp in the same place, so an installed
package loads them from its own ``_build/``.

Threads (``csrc/common.h``): an op's work items are claimed from a shared counter by the
calling thread and by helper threads (``torch.get_num_threads()`` in all, or
``set_pool_threads(n)``) that join when they get a core; the call never waits for a helper
that was not scheduled -- an OpenMP region's join barrier does, which on cores shared with
another busy process costs a scheduler tick (4-12 ms) per region. Calls below ~260k
multiply-adds run inline. Nothing is
compiled at import or on a request: ``status()`` says whether the library is present and
current, and why not.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD_DIR = HERE / "_build"
LIB_NAME = "pagedhybrid_native"
STAMP = BUILD_DIR / "build.json"  # summary of the last build (every form)
KV_SPLIT = 512  # tokens per KV split of the native attention (a multiple of every block size)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")  # + the form's ISA flags (build.py)
LDFLAGS = ("-fopenmp",)
ENV_FORM = "PAGEDHYBRID_CPU_FEATURES"

_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2"})
FORMS: dict[str, frozenset[str]] = {  # form -> the /proc/cpuinfo flags it needs, fastest first
    "avx512_bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},
    "avx512_vnni": _AVX512 | {"avx512_vnni"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
FORM_DESCRIPTIONS = {
    "avx512_bf16": "avx512_bf16 (bf16 pairs by vdpbf16ps, int8 by vpdpbusd)",
    "avx512_vnni": "avx512_vnni (bf16 via fp32 registers, int8 by vpdpbusd)",
    "avx512": "avx512 (bf16 via fp32 registers)",
    "avx2": "avx2 (bf16 via fp32 registers)",
}
VNNI_FORMS = ("avx512_bf16", "avx512_vnni")  # int8 dot products by vpdpbusd


class NativeStatus(NamedTuple):
    available: bool
    reason: str  # why not, or what was loaded
    isa: str | None  # the form (a key of FORMS)
    form: str | None = None  # what the form does, e.g. "avx512 (bf16 via fp32 registers)"
    forced: bool = False  # chosen by PAGEDHYBRID_CPU_FEATURES rather than by the CPU


def source_digest() -> str:
    """Digest of the sources and the compiler flags (a change of either makes a build stale)."""
    h = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in sorted(CSRC.glob("*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of ``/proc/cpuinfo``)."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_forms(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The forms whose instructions the CPU has, fastest first."""
    flags = cpu_flags() if flags is None else flags
    return tuple(f for f, need in FORMS.items() if need <= flags)


def namespace(form: str) -> str:
    return f"pagedhybrid_{form}"


def form_dir(form: str) -> Path:
    return BUILD_DIR / form


def library_path(form: str | None = None) -> Path:
    form = form or chosen_form()[0] or next(iter(FORMS))
    return form_dir(form) / f"{LIB_NAME}_{form}.so"


def form_stamp(form: str) -> Path:
    return form_dir(form) / "build.json"


def chosen_form(env: str | None = None,
                flags: frozenset[str] | None = None) -> tuple[str | None, bool, str]:
    """(form, forced, why): the fastest runnable form, or the one ``PAGEDHYBRID_CPU_FEATURES``
    names; form None (and why) when there is none or the named one cannot run here."""
    env = os.environ.get(ENV_FORM, "") if env is None else env
    want = env.strip().lower()
    runnable = runnable_forms(flags)
    if want in ("", "auto"):
        if not runnable:
            return None, False, "native kernels need a CPU with AVX2, FMA and F16C (or AVX-512)"
        return runnable[0], False, f"the fastest form this CPU runs (of {', '.join(runnable)})"
    if want not in FORMS:
        return None, True, (f"{ENV_FORM}={env!r} is not a CPU form; use one of "
                            f"{', '.join(FORMS)} or auto")
    if want not in runnable:
        missing = sorted(FORMS[want] - (cpu_flags() if flags is None else flags))
        return None, True, (f"{ENV_FORM}={want} needs CPU flags this CPU lacks: "
                            f"{', '.join(missing)}")
    return want, True, f"forced by {ENV_FORM}={want}"


def form_status(form: str) -> NativeStatus:
    """Whether the prebuilt library of ``form`` is present, current and loads here (it is
    loaded once; never compiled); why not when it is not."""
    if form not in FORMS:
        return NativeStatus(False, f"unknown CPU form {form!r} (one of {', '.join(FORMS)})", None)
    desc = FORM_DESCRIPTIONS[form]
    if form not in runnable_forms():
        missing = sorted(FORMS[form] - cpu_flags())
        return NativeStatus(False, f"this CPU cannot run the {form} form (lacks "
                            f"{', '.join(missing)})", form, desc)
    lib, stamp_path = library_path(form), form_stamp(form)
    if not lib.is_file() or not stamp_path.is_file():
        return NativeStatus(False, f"native extension ({form}) not built (run `make native` or "
                            "`python -m pagedhybrid.kernels.native.build`)", form, desc)
    stamp = json.loads(stamp_path.read_text())
    if stamp.get("sources") != source_digest():
        return NativeStatus(False, f"native extension ({form}) is stale: its sources changed "
                            "since the build (run `make native`)", form, desc)
    if stamp.get("torch") != torch.__version__:
        return NativeStatus(False, f"native extension ({form}) was built for torch "
                            f"{stamp.get('torch')}, this is {torch.__version__} (run `make "
                            "native`)", form, desc)
    error = _load(str(lib), form)
    if error:
        return NativeStatus(False, f"native extension ({form}) in {lib}: {error}", form, desc)
    return NativeStatus(True, f"native extension, {desc}, loaded from {lib}", form, desc)


@cache
def _load(lib: str, form: str) -> str | None:
    """Load ``lib`` once; None, or why it failed."""
    try:
        torch.ops.load_library(lib)
        built = getattr(torch.ops, namespace(form)).cpu_form()
    except (OSError, RuntimeError, AttributeError) as exc:
        return f"failed to load: {exc}"
    return None if built == form else f"is the {built} form, not {form} (run `make native`)"


@cache
def status() -> NativeStatus:
    """The chosen form's library, loaded once (never compiles); why not when it cannot be."""
    form, forced, why = chosen_form()
    if form is None:
        return NativeStatus(False, why, None, None, forced)
    st = form_status(form)
    reason = f"{st.reason} ({why})" if st.available else st.reason
    return st._replace(reason=reason, forced=forced)


def cpu_form() -> str:
    """Which form the native kernels run in (``"avx512_bf16 (bf16 pairs by vdpbf16ps)"``,
    ``"avx512 (bf16 via fp32 registers)"``, ``"avx2 (bf16 via fp32 registers)"``), with
    ``", forced by PAGEDHYBRID_CPU_FEATURES"`` when chosen by the variable; or why none runs."""
    st = status()
    if not st.available:
        return f"none ({st.reason})"
    return f"{st.form}, forced by {ENV_FORM}" if st.forced else str(st.form)


def form_library(form: str) -> Any:
    """``torch.ops.pagedhybrid_<form>`` (raises ``UnsupportedConfiguration`` when that form
    cannot be loaded here)."""
    st = form_status(form)
    if not st.available:
        from pagedhybrid.errors import UnsupportedConfiguration

        raise UnsupportedConfiguration(st.reason)
    return getattr(torch.ops, namespace(form))


def library() -> Any:
    """The chosen form's ops, ``torch.ops.pagedhybrid_<form>`` (raises when not loaded)."""
    st = status()
    if not st.available:
        from pagedhybrid.errors import UnsupportedConfiguration

        raise UnsupportedConfiguration(st.reason)
    return getattr(torch.ops, namespace(str(st.isa)))


def classes() -> Any:
    """The chosen form's classes, ``torch.classes.pagedhybrid_<form>`` (raises when not
    loaded)."""
    library()
    return getattr(torch.classes, namespace(str(status().isa)))


def set_pool_threads(n: int) -> None:
    """The threads of the native kernels' pool from now on (0: ``torch.get_num_threads()`` at
    each call); nothing when the library is not loaded."""
    if status().available:
        library().set_num_threads(int(n))
