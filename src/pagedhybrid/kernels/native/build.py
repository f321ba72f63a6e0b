"""Build the native CPU kernels ahead of time: ``python -m pagedhybrid.kernels.native.build``.

Picks the ISA from ``/proc/cpuinfo`` (AVX-512 F/BW/VL/DQ, with AVX512-BF16 when present, else
AVX2 + FMA + F16C; anything older is refused), compiles ``csrc/*.cpp`` with
``torch.utils.cpp_extension.load`` (g++, ninja) into ``_build/`` and writes ``build.json`` (ISA,
torch version, source digest of sources and flags, seconds). A current build is kept (``--force``
rebuilds). Exit status 0 on success.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx2"]
ISA_FLAGS = {
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],  # + bf16 pair dot products (vdpbf16ps)
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_isa(cpuinfo: str | None = None) -> str | None:
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def build(force: bool = False, isa: str | None = None, verbose: bool = False) -> Path:
    from pagedhybrid.kernels import native

    isa = isa or cpu_isa()
    if isa not in ISA_FLAGS:
        raise SystemExit("native kernels need a CPU with AVX2, FMA and F16C (or AVX-512)")
    digest = native.source_digest()
    if not force and native.STAMP.is_file() and native.library_path().is_file():
        stamp = json.loads(native.STAMP.read_text())
        import torch

        if stamp.get("sources") == digest and stamp.get("torch") == torch.__version__ \
                and stamp.get("isa") == isa:
            print(f"native kernels up to date ({isa}): {native.library_path()}")
            return native.library_path()
    if shutil.which("g++") is None:
        raise SystemExit("native kernels need g++")
    import torch
    from torch.utils import cpp_extension

    native.BUILD_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cpp_extension.load(
        name=native.LIB_NAME, sources=[str(p) for p in sorted(native.CSRC.glob("*.cpp"))],
        extra_cflags=[*native.CFLAGS, *ISA_FLAGS[isa]], extra_ldflags=list(native.LDFLAGS),
        build_directory=str(native.BUILD_DIR), is_python_module=False, verbose=verbose)
    seconds = time.perf_counter() - start
    native.STAMP.write_text(json.dumps({"isa": isa, "torch": torch.__version__,
                                        "sources": digest, "seconds": round(seconds, 1)}) + "\n")
    print(f"built native kernels ({isa}) in {seconds:.1f} s: {native.library_path()}")
    return native.library_path()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true")
    p.add_argument("--isa", choices=sorted(ISA_FLAGS), default=None)
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    build(a.force, a.isa, a.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
