"""Write an exported package: ``model.onnx`` (+ ``model.onnx.data``), ``genai_config.json``,
the workflow metadata and the checkpoint's tokenizer files.

``export_package(model_dir, out_dir, options, progress)``:

1. read ``config.json`` (``Qwen35Config``) and reject unsupported configurations
   (``check_export``) before touching weights;
2. build the graph layer by layer from the checkpoint (lazy, memory-mapped) or, with
   ``weights=False``, with weights declared but absent -- and with ``--mtp`` the head's graph --
   so that a refusal raised while building (e.g. a per-channel ``--weights int8`` block size)
   comes before anything is written;
3. save it with ``onnx_ir`` (weights as external data, written tensor by tensor; with
   ``--weights`` the projections' codes are quantised as they are written) -- with
   ``--mtp`` also the MTP head graph ``mtp.onnx`` + ``mtp.onnx.data`` (``export/mtp.py``) --
   then the genai config, the workflow metadata and any tokenizer files present in
   ``model_dir``.

``progress(stage, done, total)`` is called per layer (``"graph"``) and per saved tensor
(``"weights"``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import PackedAbi
from pagedhybrid.export.genai_config import make_genai_config
from pagedhybrid.export.graph import build_packed_model
from pagedhybrid.export.mtp import build_mtp_model
from pagedhybrid.export.options import ExportOptions, check_export
from pagedhybrid.export.pages import PagePlan
from pagedhybrid.export.weights import AbsentWeights, CheckpointWeights, WeightSource
from pagedhybrid.export.workflow import make_workflow
from pagedhybrid.kvquant import KVScales, default_scales_path, kv_dtype, load_scales
from pagedhybrid.models.qwen35.config import Qwen35Config

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    files: tuple[str, ...]
    op_counts: dict[str, int]
    seconds: float
    pages: PagePlan  # the page budget written to genai_config.json


def export_package(model_dir: str | Path, out_dir: str | Path, options: ExportOptions,
                   progress: Progress | None = None) -> ExportResult:
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = Qwen35Config.from_model_dir(model_dir)
    check_export(config, options)
    weights: WeightSource = (
        CheckpointWeights(model_dir, config, options.onnx_dtype, options.mtp) if options.weights
        else AbsentWeights(config, options.onnx_dtype, mtp=options.mtp))
    layer_cb = (lambda done, total: progress("graph", done, total)) if progress else None
    model = build_packed_model(config, options, weights, on_layer=layer_cb,
                               kv_scales=export_scales(model_dir, config, options))
    head = build_mtp_model(config, options, weights if options.weights else AbsentWeights(
        config, options.onnx_dtype, c.MTP_WEIGHTS_FILE, mtp=True)) if options.mtp else None
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    out_dir.mkdir(parents=True, exist_ok=True)  # (both graphs built: every refusal raised)
    for stale in (c.MODEL_FILE, c.WEIGHTS_FILE, c.MTP_FILE, c.MTP_WEIGHTS_FILE):
        (out_dir / stale).unlink(missing_ok=True)
    files = _save(model, out_dir, c.MODEL_FILE, c.WEIGHTS_FILE, options.weights, progress)
    if head is not None:
        files += _save(head, out_dir, c.MTP_FILE, c.MTP_WEIGHTS_FILE, options.weights, progress)
    abi = PackedAbi(config, options)
    _write_json(out_dir / c.GENAI_CONFIG_FILE, make_genai_config(abi))
    _write_json(out_dir / c.WORKFLOW_FILE, make_workflow(abi))
    files += [c.GENAI_CONFIG_FILE, c.WORKFLOW_FILE]
    for name in c.TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
            files.append(name)
    return ExportResult(out_dir, tuple(files), counts, time.perf_counter() - start,
                        options.page_plan(config))


def _save(model: ir.Model, out_dir: Path, name: str, data: str, weights: bool,
          progress: Progress | None) -> list[str]:
    """Write one graph (weights as external data ``data``); its file names."""
    if not weights:
        ir.save(model, out_dir / name)  # external references kept, no data file written
        return [name]

    def saved(tensor: ir.TensorProtocol, info: ir.external_data.CallbackInfo) -> None:
        if progress:
            progress("weights", info.index + 1, info.total)

    ir.save(model, out_dir / name, external_data=data, callback=saved)
    return [name, data]


def export_scales(model_dir: Path, config: Qwen35Config, options: ExportOptions
                  ) -> dict[int, KVScales] | None:
    """The calibrated KV scales of a quantized-page export (``--kv-scales`` or the checkpoint's
    ``kv_scales/`` file), checked against the cache type, quant and shapes."""
    if not options.kv_cache_dtype:
        return None
    dtype = kv_dtype(options.kv_cache_dtype)
    path = Path(options.kv_scales) if options.kv_scales else default_scales_path(
        model_dir, dtype, options.kv_quant)
    if not path.is_file():
        raise UnsupportedConfiguration(
            f"--kv-cache-dtype {options.kv_cache_dtype}: no KV scale file ({path}); pass "
            f"--kv-scales FILE or run `pagedhybrid calibrate-kv --model {model_dir} --dtype "
            f"{options.kv_cache_dtype} --quant {options.kv_quant} --text FILE`")
    scales, _ = load_scales(path, config.full_attention_layers, config.num_key_value_heads,
                            config.head_dim, dtype, options.kv_quant)
    return scales


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=4) + "\n", encoding="utf-8")
