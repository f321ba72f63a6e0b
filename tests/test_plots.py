"""benchmarks/plots.py: the committed result files become the PNGs the docs link to."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "plots.py"
RESULTS = ROOT / "benchmarks" / "results"
# the PNGs docs/benchmarks.md and the README link (docs/assets/plots/<name>) and their sources
FIGURES = {
    "engine-throughput.png": "weights-xeon-grouped.json",
    "real-size-throughput.png": "real_size-packed.json",
    "latency-distribution.png": "latency-final.json",
    "drafter-acceptance.png": "speculative-builtin.json",
}


def run_plots(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_every_figure_is_drawn_from_its_committed_result(tmp_path):
    done = run_plots("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    for png, source in FIGURES.items():
        path = tmp_path / png
        assert path.is_file(), f"{png} not written"
        assert 5_000 < path.stat().st_size < 100_000, (png, path.stat().st_size)
        with Image.open(path) as image:
            assert image.format == "PNG"
            width, height = image.size
            assert width >= 600 and height >= 300, (png, image.size)
            # not a blank canvas: a plot has lines, text and colour
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colours is None or len(colours) > 20, (png, colours)
        line = next(x for x in done.stdout.splitlines() if png in x)
        assert source in line, line


@pytest.mark.parametrize("content, reason", [
    ("{not json", "not valid JSON"),
    (json.dumps({"cpu": "CPU: X, 2 cores", "speed": {"ours int8": {"b8": 1.0}}}), "tg128"),
    (json.dumps({"speed": {"ours int8": {"tg128": 1.0, "b8": 2.0}}}), "no field cpu"),
    (json.dumps({"cpu": "CPU: X", "speed": {"ours int8": {"tg128": "fast"}}}), "tg128"),
])
def test_a_malformed_result_file_is_named(tmp_path, content, reason):
    results = tmp_path / "results"
    results.mkdir()
    for source in FIGURES.values():
        shutil.copy(RESULTS / source, results / source)
    broken = results / FIGURES["engine-throughput.png"]
    broken.write_text(content, encoding="utf-8")
    done = run_plots("--out", str(tmp_path / "out"), "--results", str(results))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert str(broken) in done.stderr and reason in done.stderr, done.stderr
    assert not (tmp_path / "out" / "engine-throughput.png").exists()


def test_a_missing_result_file_is_named(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for source in FIGURES.values():
        shutil.copy(RESULTS / source, results / source)
    done = run_plots("--out", str(tmp_path / "out"), "--results", str(results),
                     "--drafter-acceptance", "nope.json")
    assert done.returncode == 2
    assert f"{results / 'nope.json'}: no such result file" in done.stderr, done.stderr
