"""Native CPU kernels: a torch C++ extension (``csrc/``), built ahead of time by ``make``.

Ops (registered as ``torch.ops.pagedhybrid.*``):

* ``paged_attention`` -- decode and short-query attention reading K/V pages in place (fp32,
  bf16, fp16 caches; fp32 accumulation), online softmax, all query heads of a GQA group per kv
  head, fixed KV splits of ``KV_SPLIT`` tokens merged in split order (deterministic, and the same
  whatever else is in the batch);
* ``gated_delta_decode`` -- the Gated DeltaNet recurrent step in place on the state pool;
* ``causal_conv_decode`` -- the varlen causal conv decode update in place on the conv pool.

Build: ``python -m pagedhybrid.kernels.native.build`` (``make native``; ``make run`` / ``make
test`` depend on it) compiles ``csrc/*.cpp`` with g++ and ninja through
``torch.utils.cpp_extension`` for the machine's ISA (AVX-512 when the CPU has
avx512f/bw/vl/dq, else AVX2 + FMA + F16C) into ``_build/`` with a ``build.json`` stamp (ISA,
torch version, source digest). Work items run in parallel through ``at::parallel_for``,
compiled with ``-fopenmp`` so that it is torch's own OpenMP pool (the wheel's ``libgomp.so.1``;
``torch.set_num_threads`` governs it). Nothing is compiled at import or on a request:
``status()`` says whether the library is present and current, and why not.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD_DIR = HERE / "_build"
LIB_NAME = "pagedhybrid_native"
STAMP = BUILD_DIR / "build.json"
KV_SPLIT = 512  # tokens per KV split of the native attention (a multiple of every block size)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")  # + the ISA flags of build.py
LDFLAGS = ("-fopenmp",)


class NativeStatus(NamedTuple):
    available: bool
    reason: str  # why not, or what was loaded
    isa: str | None


def source_digest() -> str:
    """Digest of the sources and the compiler flags (a change of either makes a build stale)."""
    h = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in sorted(CSRC.glob("*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def library_path() -> Path:
    return BUILD_DIR / f"{LIB_NAME}.so"


@cache
def status() -> NativeStatus:
    """Load the prebuilt library once; never compiles."""
    lib = library_path()
    if not lib.is_file() or not STAMP.is_file():
        return NativeStatus(False, "native extension not built (run `make native` or `python -m "
                            "pagedhybrid.kernels.native.build`)", None)
    stamp = json.loads(STAMP.read_text())
    if stamp.get("sources") != source_digest():
        return NativeStatus(False, "native extension is stale: its sources changed since the "
                            "build (run `make native`)", stamp.get("isa"))
    if stamp.get("torch") != torch.__version__:
        return NativeStatus(False, f"native extension was built for torch {stamp.get('torch')}, "
                            f"this is {torch.__version__} (run `make native`)", stamp.get("isa"))
    try:
        torch.ops.load_library(str(lib))
    except OSError as exc:
        return NativeStatus(False, f"native extension failed to load: {exc}", stamp.get("isa"))
    return NativeStatus(True, f"native extension ({stamp.get('isa')}) loaded from {lib}",
                        stamp.get("isa"))


def library() -> object:
    """``torch.ops.pagedhybrid`` once the library is loaded (raises when it is not)."""
    st = status()
    if not st.available:
        from pagedhybrid.errors import UnsupportedConfiguration

        raise UnsupportedConfiguration(st.reason)
    return torch.ops.pagedhybrid
