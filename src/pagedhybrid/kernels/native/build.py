"""Build the native CPU kernels ahead of time: ``python -m pagedhybrid.kernels.native.build``.

CPU forms (``native.FORMS``, fastest first): ``avx512_bf16`` (AVX-512 F/BW/VL/DQ, AVX512-BF16
and AVX512-VNNI), ``avx512_vnni`` (AVX-512 and VNNI), ``avx512`` (AVX-512 alone), ``avx2``
(AVX2 + FMA + F16C). Which forms a run builds (``--forms``):

* ``cpu`` (the default; ``make native``): every form this machine can run
  (``native.runnable_forms()``; anything older than AVX2 is refused);
* ``all`` (the wheel: ``hatch_build.py``): every form the C++ compiler can compile here
  (``compilable_forms()``), whether or not this CPU runs it, so that a wheel built on one
  machine carries the form of each CPU it is installed on;
* a comma-separated list of forms (``--isa FORM``: that form alone).

First ``csrc/layer_spec.h`` is written from ``kernels/layer_spec.py`` where it differs. Each form
compiles ``csrc/*.cpp`` through ``torch.utils.cpp_extension`` (g++, ninja; the same
ninja file ``cpp_extension.load`` writes) with its ISA flags, ``-DPH_FORM_ID=<form>`` and
``-DPH_NS=pagedhybrid_<form>`` into ``_build/<form>/``; a form this CPU runs is then loaded
once as a check (``cpu_form()`` must name it), one it cannot run is never loaded. Each form
writes its ``build.json`` (form, torch version, source digest, seconds); ``_build/build.json``
lists the forms of the last build. A current form is kept (``--force`` rebuilds). The forms are
built fastest first, so that the form ``status()`` picks is current soonest. Exit status 0 on
success.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
FORM_SETS = ("cpu", "all")  # the named sets of --forms (besides a list of forms)


def cpu_isa(cpuinfo: str | None = None) -> str | None:
    """The fastest form this CPU runs (None: none)."""
    from pagedhybrid.kernels import native

    forms = native.runnable_forms(native.cpu_flags(cpuinfo))
    return forms[0] if forms else None


def compiler() -> str:
    """The C++ compiler ``torch.utils.cpp_extension`` builds with (``$CXX``, else ``c++``)."""
    from torch.utils import cpp_extension

    return cpp_extension.get_cxx_compiler()


def compilable_forms(cxx: str | None = None) -> tuple[str, ...]:
    """The forms whose ISA flags the C++ compiler accepts (every form on x86-64 with a
    current g++; none on another architecture), fastest first."""
    cxx = cxx or compiler()
    if shutil.which(cxx) is None:
        return ()
    out = []
    for form, flags in ISA_FLAGS.items():
        probe = subprocess.run([cxx, *flags, "-x", "c++", "-c", "-", "-o", os.devnull],
                               input="int pagedhybrid_probe() { return 0; }\n", text=True,
                               capture_output=True, check=False)
        if probe.returncode == 0:
            out.append(form)
    return tuple(out)


def select_forms(spec: str) -> tuple[str, ...]:
    """The forms ``spec`` names (``cpu``, ``all`` or a comma-separated list), fastest first;
    raises ``SystemExit`` with the reason when one cannot be built here."""
    from pagedhybrid.kernels import native

    spec = spec.strip().lower()
    if spec == "cpu":
        forms = native.runnable_forms()
        if not forms:
            raise SystemExit("native kernels need a CPU with AVX2, FMA and F16C (or AVX-512); "
                             "`--forms all` compiles them for other CPUs")
        return forms
    compilable = compilable_forms()
    if spec == "all":
        if not compilable:
            raise SystemExit(f"the C++ compiler {compiler()!r} compiles none of the CPU forms "
                             f"({', '.join(ISA_FLAGS)}): the native kernels need g++ for x86-64")
        return compilable
    named = [f.strip() for f in spec.split(",") if f.strip()]
    for form in named:
        if form not in ISA_FLAGS:
            raise SystemExit(f"{form!r} is not a CPU form (one of {', '.join(ISA_FLAGS)}, or "
                             f"{' / '.join(FORM_SETS)})")
        if form not in compilable:
            raise SystemExit(f"the C++ compiler {compiler()!r} cannot compile the {form} form "
                             f"(flags {' '.join(ISA_FLAGS[form])})")
    return tuple(f for f in ISA_FLAGS if f in named)


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
    """Compile ``form`` (kept when current); load it once as a check when this CPU runs it."""
    import torch
    from torch.utils import cpp_extension

    from pagedhybrid.kernels import native

    digest = native.source_digest()
    lib = native.library_path(form)
    if not force and _current(form, digest):
        print(f"native kernels up to date ({form}): {lib}", flush=True)
        return lib
    out = native.form_dir(form)
    out.mkdir(parents=True, exist_ok=True)
    native.form_stamp(form).unlink(missing_ok=True)  # no stamp until the library is built
    start = time.perf_counter()
    # cpp_extension.load() minus its final torch.ops.load_library(): the same ninja file and
    # flags, but a form this CPU cannot run is never loaded (its static initialisers may use
    # instructions the CPU lacks). torch is pinned (pyproject.toml), so is this function.
    cpp_extension._write_ninja_file_and_build_library(
        name=f"{native.LIB_NAME}_{form}",
        sources=[str(p) for p in sorted(native.CSRC.glob("*.cpp"))],
        extra_cflags=[*native.CFLAGS, *ISA_FLAGS[form], f"-DPH_FORM_ID={form}",
                      f"-DPH_NS={native.namespace(form)}"],
        extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=list(native.LDFLAGS),
        extra_include_paths=[], build_directory=str(out), verbose=verbose, with_cuda=False,
        with_sycl=False)
    seconds = time.perf_counter() - start
    if form in native.runnable_forms():
        error = native._load(str(lib), form)
        if error:
            raise SystemExit(f"native kernels ({form}) in {lib}: {error}")
    native.form_stamp(form).write_text(json.dumps(
        {"form": form, "torch": torch.__version__, "sources": digest,
         "seconds": round(seconds, 1)}) + "\n")
    print(f"built native kernels ({form}) in {seconds:.1f} s: {lib}", flush=True)
    return lib


def build(force: bool = False, isa: str | None = None, verbose: bool = False,
          forms: str = "cpu") -> Path:
    """Build the forms ``forms`` names (``isa``: that form alone), fastest first; the fastest's
    path."""
    import torch

    from pagedhybrid.kernels import layer_spec, native

    if shutil.which(compiler()) is None:
        raise SystemExit(f"native kernels need g++ (no C++ compiler {compiler()!r} found)")
    chosen = select_forms(isa if isa is not None else forms)
    if layer_spec.write_header():  # csrc/layer_spec.h, from the layers' declaration
        print(f"wrote {layer_spec.HEADER}", flush=True)
    native.BUILD_DIR.mkdir(parents=True, exist_ok=True)
    _remove_old_layout()
    libs = [build_form(form, force, verbose) for form in chosen]
    native.STAMP.write_text(json.dumps(
        {"forms": list(chosen), "torch": torch.__version__,
         "sources": native.source_digest()}) + "\n")
    return libs[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true")
    p.add_argument("--forms", default="cpu",
                   help="cpu (every form this CPU runs; the default), all (every form the "
                        "compiler compiles: the wheel) or a comma-separated list of forms")
    p.add_argument("--isa", choices=sorted(ISA_FLAGS), default=None,
                   help="build this CPU form alone")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    build(a.force, a.isa, a.verbose, a.forms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
