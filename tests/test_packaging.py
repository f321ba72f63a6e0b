"""The package as a new user gets it: a wheel built from a clean copy of the tree, installed
into a fresh venv, run from a folder outside the repository -- it must run the native kernels.

``test_installed_wheel_runs_the_native_kernels`` (slow: about 3-4 minutes on 2 busy cores, most
of it compiling one CPU form and unpacking torch twice):

1. copies the working tree as git sees it (tracked and untracked-but-not-ignored files: no
   ``_build/``, no ``.venv``) into a temporary folder;
2. builds a wheel of it with ``pip wheel`` -- a PEP 517 frontend like ``python -m build``, with
   build isolation: a fresh environment holding only what ``pyproject.toml`` and the build hook
   (``hatch_build.py``) declare, hatchling, torch and ninja;
3. creates a fresh venv (no system site-packages) and ``pip install``\\ s the wheel into it with
   its declared dependencies (pip may take them from its cache and the local wheel folders it is
   configured with; nothing of the repository's ``.venv`` is visible);
4. from a folder outside the repository, with no ``PYTHONPATH`` and no
   ``PAGEDHYBRID_CPU_FEATURES``: ``pagedhybrid --version`` must name this version and the native
   form this CPU picks, loaded from the venv's site-packages, and ``pagedhybrid generate
   --max-tokens 2`` must say at start that the native kernels run in that form.

Honest and fast: a wheel's default is every CPU form the compiler builds (four, ~1 min each
here); the test builds one -- the form this CPU picks at start -- through
``PAGEDHYBRID_NATIVE_FORMS``. Everything else is the user's path: the isolated build, the hook, the
build module ``make native`` runs, the packaging of the form's library and stamp, the wheel's
platform tag, the installed runtime finding and loading it. The other forms differ only in their
compiler flags and are compiled by ``make native`` on every CI run. A wheel without the
libraries fails step 4 (``native kernels: none (native extension (...) not built ...)``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from pagedhybrid.cli import main
from pagedhybrid.kernels import native

REPO = Path(__file__).resolve().parents[1]


def _clean_copy(dest: Path) -> None:
    """The files of the working tree that git tracks or would add (none it ignores)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=REPO, capture_output=True, check=True
                           ).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float,
         what: str) -> subprocess.CompletedProcess[str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    print(f"{what}: {time.perf_counter() - start:.0f} s")
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def test_version_names_the_package_torch_and_the_native_form(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.splitlines()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert out[0] == f"pagedhybrid {version}"
    assert out[1].startswith("torch ")
    assert out[2] == f"native kernels: {native.cpu_form()}"
    assert out[3].startswith("native forms built: ")


@pytest.mark.slow
def test_installed_wheel_runs_the_native_kernels(tmp_path: Path) -> None:
    form = native.chosen_form(env="")[0]
    assert form is not None, "the native kernels need a CPU with AVX2, FMA and F16C"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", native.ENV_FORM)}

    tree, dist, venv, elsewhere = (tmp_path / d for d in ("tree", "dist", "venv", "elsewhere"))
    elsewhere.mkdir()
    _clean_copy(tree)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dist),
          str(tree)], tmp_path, {**env, "PAGEDHYBRID_NATIVE_FORMS": form}, 1500, "build")
    (wheel,) = dist.glob("pagedhybrid-*.whl")
    assert "-py3-none-any" not in wheel.name, wheel.name  # it carries compiled libraries
    lib = f"pagedhybrid/kernels/native/_build/{form}/{native.LIB_NAME}_{form}.so"
    assert lib in zipfile.ZipFile(wheel).namelist()
    print(f"wheel {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")

    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120, "venv")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
         tmp_path, env, 900, "install")

    shown = _run([str(venv / "bin" / "pagedhybrid"), "--version"], elsewhere, env, 120,
                 "pagedhybrid --version").stdout
    print(shown)
    site = next((venv / "lib").glob("python3*/site-packages")).resolve()
    assert f"pagedhybrid {version}\n" in shown
    assert f"native kernels: {native.FORM_DESCRIPTIONS[form]}\n" in shown
    assert f"loaded: {site}/{lib}" in shown

    started = _run([str(venv / "bin" / "pagedhybrid"), "generate", "--prompt",
                    "In the beginning", "--max-tokens", "2"], elsewhere, env, 300,
                   "pagedhybrid generate").stderr
    line = next((x for x in started.splitlines() if x.startswith("pagedhybrid: kernels: ")),
                started)
    print(line)
    assert line.startswith("pagedhybrid: kernels: native kernels (auto); CPU form "
                           f"{native.FORM_DESCRIPTIONS[form]}"), line
