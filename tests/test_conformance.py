"""The conformance cases file is derived from the OpSpecs, and the runner detects errors."""

from __future__ import annotations

import json

import pytest

from pagedhybrid import conformance as conf
from pagedhybrid.cli import main


def test_cases_file_is_up_to_date():
    derived = [c._asdict() for c in conf.derive_cases()]
    shipped = json.loads(conf.CASES_FILE.read_text())
    assert shipped == json.loads(json.dumps(derived)), (
        "run `pagedhybrid conformance --write-cases` and commit the result")


def test_cases_cover_every_op_and_both_backends():
    cases = conf.load_cases()
    assert {c.op for c in cases} == set(conf.OP_MODULES)
    for op in conf.OP_MODULES:
        assert any("onnxruntime" in c.backends for c in cases if c.op == op), op


def test_reference_rows_pass_and_a_wrong_backend_fails(monkeypatch):
    case = next(c for c in conf.load_cases() if c.dtype == "float")
    assert conf.run_case(case, "reference").passed
    real = conf.implementation

    def perturbed(op, backend):
        fn = real(op, "reference")
        return lambda *a, **k: tuple(t + 1e-3 if t.is_floating_point() else t for t in fn(*a, **k))

    monkeypatch.setattr(conf, "implementation", lambda op, b: perturbed(op, b)
                        if b == "onnxruntime" else real(op, b))
    bad = conf.run_case(case, "onnxruntime")
    assert not bad.passed and bad.max_error == pytest.approx(1e-3, rel=1e-2)


def test_cli_reference_backend_on_a_subset(tmp_path, capsys):
    subset = [c._asdict() for c in conf.load_cases() if c.dtype == "float"][::4]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(subset))
    assert main(["conformance", "--backend", "reference", "--cases", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(subset)} passed, 0 failed" in out


def test_cli_fails_on_a_broken_case(tmp_path, capsys):
    case = next(c for c in conf.load_cases() if c.dtype == "float")._asdict()
    case["recipe"] = {**case["recipe"], "dims": {}}  # make_inputs cannot build it
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([case]))
    assert main(["conformance", "--backend", "reference", "--cases", str(path)]) == 1
    assert "0 passed, 1 failed" in capsys.readouterr().out
