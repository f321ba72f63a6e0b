"""ONNX export of the packed paged hybrid Qwen3.5 model for ONNX Runtime GenAI.

* ``export_package(model_dir, out_dir, ExportOptions(...))`` -- ``model.onnx`` (+ weights),
  ``genai_config.json``, workflow metadata, tokenizer files (``package.py``);
* ``build_packed_model`` -- the ``onnx_ir`` graph (``graph.py``, ``full.py``, ``linear.py``);
* ``PackedAbi`` -- the graph ABI derived from the config (``abi.py``);
* ``--weights int4|int8[:BLOCK][:asym]`` -- every projection one ``com.microsoft.MatMulNBits``
  with the engine's weightquant codes (``nbits.py``);
* ``verify_package`` -- the independent ABI check behind ``pagedhybrid verify`` (``verify.py``);
* ``PackedGraphSession`` -- runs a package in onnxruntime with caches bound in place
  (``session.py``; tests and benchmarks).
"""

from __future__ import annotations

from pagedhybrid.export.abi import PackedAbi, TensorSpec
from pagedhybrid.export.graph import build_packed_model
from pagedhybrid.export.options import ExportOptions, check_export
from pagedhybrid.export.package import ExportResult, export_package
from pagedhybrid.export.verify import Finding, VerifyReport, verify_package

__all__ = [
    "ExportOptions",
    "ExportResult",
    "Finding",
    "PackedAbi",
    "TensorSpec",
    "VerifyReport",
    "build_packed_model",
    "check_export",
    "export_package",
    "verify_package",
]
