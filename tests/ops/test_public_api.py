"""The public op functions resolve to the same function on every access, in a fresh interpreter
(whatever was imported before), and ``python -m pagedhybrid`` runs the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import importlib, types
import torch
{pre}
import pagedhybrid.ops as ops
for name in ("paged_attention", "varlen_causal_conv", "gated_delta_net"):
    mod = importlib.import_module("pagedhybrid.ops." + name)
    first = getattr(ops, name)
    importlib.import_module("pagedhybrid.ops." + name)  # importing it again changes nothing
    second = getattr(ops, name)
    assert isinstance(first, types.FunctionType), (name, type(first))
    assert first is second is getattr(mod, name), name
    for call in range(2):  # callable twice through the package: the reference runs
        inputs, attrs = mod.make_inputs(mod.conformance_recipes()[0], torch.float32, call)
        out = getattr(ops, name)(*inputs, **attrs)
        assert isinstance(out, tuple) and isinstance(out[0], torch.Tensor), (name, call)
print("ok")
"""


@pytest.mark.parametrize("pre", ["", "import pagedhybrid.ops.gated_delta_net",
                                 "from pagedhybrid.ops.paged_attention import SPEC",
                                 "import pagedhybrid.kernels.cpu"])
def test_op_functions_resolve_stably(pre: str) -> None:
    r = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_python_dash_m_runs_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "pagedhybrid", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for command in ("run", "generate", "export", "verify", "conformance"):
        assert command in r.stdout
    bad = subprocess.run([sys.executable, "-m", "pagedhybrid", "no-such-command"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
