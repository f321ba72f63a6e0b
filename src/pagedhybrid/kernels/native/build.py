"""Build the native CPU kernels ahead of time: ``python -m pagedhybrid.kernels.native.build``.

Builds every CPU form this machine can run (``native.runnable_forms()``: ``avx512_bf16`` when the
CPU has AVX-512 F/BW/VL/DQ, AVX512-BF16 and AVX512-VNNI, ``avx512_vnni`` with AVX-512 and VNNI,
``avx512`` with AVX-512 alone, ``avx2`` with AVX2 +
FMA + F16C; anything older is refused), the fastest first so that the form ``status()`` picks is
current soonest. Each form compiles ``csrc/*.cpp`` with ``torch.utils.cpp_extension.load``
(g++, ninja) with its ISA flags, ``-DPH_FORM_ID=<form>`` and ``-DPH_NS=pagedhybrid_<form>`` into
``_build/<form>/`` and writes its ``build.json`` (form, torch version, source digest, seconds);
``_build/build.json`` sums up the build. A current form is kept (``--force`` rebuilds);
``--isa FORM`` builds that form alone. Exit status 0 on success.
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
    # + bf16 pair dot products (vdpbf16ps) and int8 dot products (vpdpbusd)
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    "avx512_vnni": [*_AVX512, "-mavx512vnni"],
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_isa(cpuinfo: str | None = None) -> str | None:
    """The fastest form this CPU runs (None: none)."""
    from pagedhybrid.kernels import native

    forms = native.runnable_forms(native.cpu_flags(cpuinfo))
    return forms[0] if forms else None


def _current(form: str, digest: str) -> bool:
    import torch

    from pagedhybrid.kernels import native

    stamp_path = native.form_stamp(form)
    if not stamp_path.is_file() or not native.library_path(form).is_file():
        return False
    stamp = json.loads(stamp_path.read_text())
    return (stamp.get("sources") == digest and stamp.get("torch") == torch.__version__
            and stamp.get("form") == form)


def _remove_old_layout() -> None:
    """The single-library layout of earlier builds (``_build/pagedhybrid_native.so``)."""
    from pagedhybrid.kernels import native

    for name in (f"{native.LIB_NAME}.so", "build.ninja", ".ninja_deps", ".ninja_log"):
        (native.BUILD_DIR / name).unlink(missing_ok=True)
    for obj in native.BUILD_DIR.glob("*.o"):
        obj.unlink()


def build_form(form: str, force: bool = False, verbose: bool = False) -> Path:
    import torch
    from torch.utils import cpp_extension

    from pagedhybrid.kernels import native

    digest = native.source_digest()
    lib = native.library_path(form)
    if not force and _current(form, digest):
        print(f"native kernels up to date ({form}): {lib}")
        return lib
    out = native.form_dir(form)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cpp_extension.load(
        name=f"{native.LIB_NAME}_{form}",
        sources=[str(p) for p in sorted(native.CSRC.glob("*.cpp"))],
        extra_cflags=[*native.CFLAGS, *ISA_FLAGS[form], f"-DPH_FORM_ID={form}",
                      f"-DPH_NS={native.namespace(form)}"],
        extra_ldflags=list(native.LDFLAGS), build_directory=str(out), is_python_module=False,
        verbose=verbose)
    seconds = time.perf_counter() - start
    native.form_stamp(form).write_text(json.dumps(
        {"form": form, "torch": torch.__version__, "sources": digest,
         "seconds": round(seconds, 1)}) + "\n")
    print(f"built native kernels ({form}) in {seconds:.1f} s: {lib}")
    return lib


def build(force: bool = False, isa: str | None = None, verbose: bool = False) -> Path:
    """Build ``isa`` alone, or every form this CPU runs (fastest first); the fastest's path."""
    import torch

    from pagedhybrid.kernels import native

    forms = native.runnable_forms()
    if isa is not None:
        if isa not in forms:
            raise SystemExit(f"this CPU cannot run the {isa} form (it runs: "
                             f"{', '.join(forms) or 'none'})")
        forms = (isa,)
    if not forms:
        raise SystemExit("native kernels need a CPU with AVX2, FMA and F16C (or AVX-512)")
    if shutil.which("g++") is None:
        raise SystemExit("native kernels need g++")
    native.BUILD_DIR.mkdir(parents=True, exist_ok=True)
    _remove_old_layout()
    libs = [build_form(form, force, verbose) for form in forms]
    native.STAMP.write_text(json.dumps(
        {"forms": list(forms), "torch": torch.__version__,
         "sources": native.source_digest()}) + "\n")
    return libs[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true")
    p.add_argument("--isa", choices=sorted(ISA_FLAGS), default=None,
                   help="build this CPU form alone")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    build(a.force, a.isa, a.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
