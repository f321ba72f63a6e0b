"""Structural (``--no-weights``) exports of Qwen3.5-MoE geometries beside the dense 27B.

Configs: ``synthetic.MOE_GEOMETRIES`` (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B and a
Qwen3.8-2.4T-A95B-like one) and, as the peer row, the dense Qwen3.5-27B
(``QWEN35_27B_TEXT_CONFIG``). Each is exported from its ``config.json`` alone with
``pagedhybrid export --ep cuda --dtype bf16 --no-weights`` in its own process (wall time from
process start, imports included, and the peak RSS of that process), then once more in this
process after a warm-up export (imports and first calls warm: the export's own seconds) and
verified (``pagedhybrid verify``'s
seconds). Reported per config: parameters (total / active), PagedAttention / GatedDeltaNet / MoE
node counts, ``model.onnx`` size, the times and peak RSS, and each time as a ratio to the dense
27B's. Writes JSON (``--out``). Not a test: no assertions on timings.

    python benchmarks/export_moe_structure.py
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_RSS_WRAPPER = (
    "import atexit, resource, runpy, sys;"
    "atexit.register(lambda: print('PEAK_RSS_KB', "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr));"
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)
OPS = ("PagedAttention", "GatedDeltaNet", "MoE")


def configs() -> dict[str, dict[str, Any]]:
    from pagedhybrid.models.qwen35.config import QWEN35_27B_TEXT_CONFIG
    from pagedhybrid.models.qwen35.synthetic import MOE_GEOMETRIES

    return {"27B (dense)": QWEN35_27B_TEXT_CONFIG,
            **{name: cfg.to_hf_dict() for name, cfg in MOE_GEOMETRIES.items()}}


def params(config: dict[str, Any]) -> tuple[float, float]:
    """(total, active) parameters in billions, from the model built on the meta device."""
    from pagedhybrid.export.weights import expected_shapes
    from pagedhybrid.models.qwen35.config import Qwen35Config

    cfg = Qwen35Config.from_dict(config)
    shapes = expected_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - (experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
                      if cfg.is_moe else 0)
    return total / 1e9, active / 1e9


def measure(name: str, config: dict[str, Any], root: Path) -> dict[str, Any]:
    import onnx_ir as ir

    from pagedhybrid.export.options import ExportOptions
    from pagedhybrid.export.package import export_package
    from pagedhybrid.export.verify import verify_package

    src = root / "model"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, "pagedhybrid.export.cli",
                           "export", str(src), str(root / "cli"), "--ep", "cuda", "--dtype",
                           "bf16", "--no-weights"], capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: export failed\n{proc.stdout}\n{proc.stderr}")
    rss_kb = [int(line.split()[1]) for line in proc.stderr.splitlines()
              if line.startswith("PEAK_RSS_KB")][-1]
    start = time.perf_counter()
    result = export_package(src, root / "pkg", ExportOptions(ep="cuda", dtype="bf16",
                                                             weights=False))
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    report = verify_package(root / "pkg")
    verify_s = time.perf_counter() - start
    if not report.ok:
        raise RuntimeError(report.format())
    moe = [n for n in ir.load(root / "pkg" / "model.onnx").graph if n.op_type == "MoE"]
    total, active = params(config)
    return {
        "config": name, "params_b": round(total, 1), "active_b": round(active, 1),
        "layers": config["num_hidden_layers"],
        **{op: result.op_counts.get(op, 0) for op in OPS},
        "experts_per_moe": int(moe[0].inputs[2].shape[0]) if moe else 0,
        "top_k": int(moe[0].attributes["k"].value) if moe else 0,
        "model_onnx_kib": (root / "pkg" / "model.onnx").stat().st_size // 1024,
        "process_s": round(process_s, 2), "peak_rss_mib": round(rss_kb / 1024, 1),
        "export_s": round(export_s, 3), "verify_s": round(verify_s, 3),
        "verify_checks": len(report.findings),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/export_moe_structure.json")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        measure("warm-up", configs()["27B (dense)"], Path(tmp) / "warm-up")  # first-call costs
        for k, (name, config) in enumerate(configs().items()):
            rows.append(measure(name, config, Path(tmp) / str(k)))
    base = rows[0]
    for r in rows:
        for key in ("process_s", "export_s", "verify_s", "peak_rss_mib"):
            r[f"{key}_vs_27b"] = round(r[key] / base[key], 2) if base[key] else None
    head = (f"{'config':<12} {'params':>8} {'active':>7} {'PA':>3} {'GDN':>4} {'MoE':>4} "
            f"{'E/k':>7} {'onnx KiB':>9} {'process s':>10} {'peak MiB':>9} {'export s':>9} "
            f"{'verify s':>9} {'export/27B':>11}")
    print(head)
    for r in rows:
        print(f"{r['config']:<12} {r['params_b']:>7.1f}B {r['active_b']:>6.1f}B "
              f"{r['PagedAttention']:>3} {r['GatedDeltaNet']:>4} {r['MoE']:>4} "
              f"{str(r['experts_per_moe']) + '/' + str(r['top_k']):>7} {r['model_onnx_kib']:>9} "
              f"{r['process_s']:>10.2f} {r['peak_rss_mib']:>9.1f} {r['export_s']:>9.3f} "
              f"{r['verify_s']:>9.3f} {r['export_s_vs_27b']:>11.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "export_moe_structure", "machine": platform.platform(),
           "python": platform.python_version(), "rows": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
