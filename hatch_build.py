"""Hatch build hook: the native CPU kernels compiled ahead of time into every wheel.

``pip install .``, ``pip install <sdist>`` and ``python -m build`` build a wheel through
hatchling, which runs this hook first (``[tool.hatch.build.targets.wheel.hooks.custom]`` in
``pyproject.toml``). It runs the one native build, ``python -m pagedhybrid.kernels.native.build``
(``make native`` runs the same module), from this source tree in a child process, and puts each
built form's library and ``build.json`` stamp into the wheel at the place the runtime looks
(``pagedhybrid/kernels/native/_build/<form>/``; ``csrc/`` ships too, since the stamp's source
digest is checked against it at load). The wheel is then platform-specific (a CPython ABI and
platform tag, not ``py3-none-any``): its libraries link this torch and this Python.

Which forms (the environment variable ``PAGEDHYBRID_NATIVE_FORMS``, passed to the build's
``--forms``): a wheel gets ``all`` (every form the compiler can compile here, whatever this CPU
runs), an editable install ``cpu`` (the forms this machine runs, built in place in ``src/``, as
``make native`` does); a comma-separated list of forms builds those; ``none`` builds nothing (a
wheel of the torch kernels alone, for a machine without g++). A failed build fails the wheel: it
never falls back to a wheel without the kernels unasked.

The build needs torch (its headers and libraries, the very version the package pins) and ninja;
``dependencies()`` hands the project's own requirements for both to the frontend, which installs
them into the isolated build environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ENV_FORMS = "PAGEDHYBRID_NATIVE_FORMS"
NATIVE = "pagedhybrid/kernels/native"  # inside src/ and inside the wheel
BUILD_REQUIREMENTS = ("torch", "ninja")  # the project's own pins of these are the build's


def _name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name.lower()


class NativeKernelsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        return [r for r in self.metadata.core.dependencies if _name(r) in BUILD_REQUIREMENTS]

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        editable = version == "editable"
        spec = os.environ.get(ENV_FORMS, "").strip() or ("cpu" if editable else "all")
        if spec.lower() == "none":
            self.app.display_warning(f"{ENV_FORMS}=none: no native kernels in this build "
                                     "(the torch kernels alone)")
            return
        src = Path(self.root) / "src"
        env = dict(os.environ)
        # prepend: the frontend's isolated environment may live on PYTHONPATH (pip's does)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
        self.app.display_info(f"building the native kernels ({ENV_FORMS}={spec}) ...")
        quiet = "ignore:Failed to initialize NumPy:UserWarning"  # torch without numpy: harmless
        # src/ first on sys.path inside the child too: pip's isolated build environment has a
        # sitecustomize that drops PYTHONPATH entries it did not put there
        run = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
               "runpy.run_module('pagedhybrid.kernels.native.build', run_name='__main__', "
               "alter_sys=True)")
        done = subprocess.run([sys.executable, "-W", quiet, "-c", run, str(src), "--forms", spec],
                              cwd=self.root, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the native kernel build failed (exit {done.returncode}); "
                               f"set {ENV_FORMS}=none to build without the native kernels")
        if editable:
            return  # the editable install reads src/ in place, _build/ included
        build_dir = src / NATIVE / "_build"
        summary = json.loads((build_dir / "build.json").read_text())
        include = build_data["force_include"]
        include[str(build_dir / "build.json")] = f"{NATIVE}/_build/build.json"
        for form in summary["forms"]:
            for name in (f"pagedhybrid_native_{form}.so", "build.json"):
                include[str(build_dir / form / name)] = f"{NATIVE}/_build/{form}/{name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
