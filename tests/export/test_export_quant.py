"""Exports with quantized KV pages (``--kv-cache-dtype int8|fp8``, per-channel / per-tensor).

* the CUDA package: int8 / float8e4m3fn page buffers, the calibrated scales as float
  initializers on operands 14/15 with matching ``k_quant_type``/``v_quant_type``; verify passes;
  genai_config is the unquantized export's (genai takes the cache type from the graph input);
  ORT (CPU EP, no PagedAttention kernel) loads the graph past its schema type checks -- and a
  float16 scale is caught by those checks, so they are live;
* verify rejects a scale of the wrong layout, a quant attribute that disagrees, page buffers of
  another type than the metadata's, and a workflow that disagrees;
* refusals: WebGPU (by ORT's measured answer), a missing or mismatched scale file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from export_helpers import TINY_OPTIONS, write_tiny

from pagedhybrid.calibrate_kv import channel_amax, scales_from_amax
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.options import ExportOptions, check_options
from pagedhybrid.export.package import export_package
from pagedhybrid.export.verify import verify_package
from pagedhybrid.kvquant import KV_DTYPES, default_scales_path, load_scales, save_scales
from pagedhybrid.models.qwen35 import load

CUDA = ExportOptions(ep="cuda", dtype="fp16", block_size=16, gpu_utilization=0.5)
COMBOS = [("int8", "per-channel"), ("int8", "per-tensor"), ("fp8", "per-channel"),
          ("fp8", "per-tensor")]
ONNX_TYPE = {"int8": "int8", "fp8": "float8e4m3fn"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with calibrated scale files of every combination in its kv_scales/."""
    path = write_tiny(tmp_path_factory.mktemp("quant-ckpt"))
    model = load(path)
    amax, _ = channel_amax(model, torch.randint(0, 256, (300,)).tolist(), 128)
    for d, q in COMBOS:
        dt = KV_DTYPES["fp8_e4m3" if d == "fp8" else d]
        save_scales(default_scales_path(path, dt, q), scales_from_amax(amax, dt, q), dt, q)
    return path


@pytest.fixture(scope="module")
def packages(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-pkgs")
    out = {"none": root / "none"}
    export_package(ckpt, out["none"], CUDA)
    for d, q in COMBOS:
        out[f"{d}-{q}"] = root / f"{d}-{q}"
        export_package(ckpt, out[f"{d}-{q}"], dataclasses.replace(CUDA, kv_cache_dtype=d,
                                                                  kv_quant=q))
    return out


@pytest.mark.parametrize(("dtype", "quant"), COMBOS)
def test_quantized_cuda_package(dtype: str, quant: str, ckpt: Path,
                                packages: dict[str, Path]) -> None:
    pkg = packages[f"{dtype}-{quant}"]
    report = verify_package(pkg)
    assert report.ok, report.format()
    model = ir.load(pkg / c.MODEL_FILE)
    meta = dict(model.metadata_props)
    want_quant = "PER_CHANNEL" if quant == "per-channel" else "PER_TENSOR"
    assert meta[c.META_KV_DTYPE] == ONNX_TYPE[dtype] and meta[c.META_KV_QUANT] == want_quant
    cfg_layers = [int(x) for x in meta[c.META_FULL_LAYERS].split(",")]
    kv_type = ir.DataType.INT8 if dtype == "int8" else ir.DataType.FLOAT8E4M3FN
    ins = {v.name: v for v in model.graph.inputs}
    outs = {v.name: v for v in model.graph.outputs}
    dt = KV_DTYPES["fp8_e4m3" if dtype == "fp8" else dtype]
    hkv, hd = (int(ins[c.PAST_KEY % cfg_layers[0]].shape[k]) for k in (2, 3))
    file_scales, _ = load_scales(default_scales_path(ckpt, dt, quant), tuple(cfg_layers), hkv,
                                 hd, dt, quant)
    nodes = [n for n in model.graph if n.op_type == c.PAGED_ATTENTION]
    assert len(nodes) == len(cfg_layers)
    for i, n in zip(cfg_layers, nodes, strict=True):
        for name in (c.PAST_KEY % i, c.PAST_VALUE % i):
            assert ins[name].dtype == kv_type
        assert outs[c.PRESENT_KEY % i].dtype == kv_type
        assert n.attributes["k_quant_type"].value == want_quant
        assert n.attributes["v_quant_type"].value == want_quant
        assert "k_cache_dtype" not in n.attributes  # the type is the page buffer's (as genai)
        k, v = n.inputs[14], n.inputs[15]
        assert k is not None and v is not None
        assert k.name == c.K_SCALE % i and v.name == c.V_SCALE % i
        assert np.array_equal(k.const_value.numpy(), file_scales[i].k.numpy())
        assert np.array_equal(v.const_value.numpy(), file_scales[i].v.numpy())
    # genai reads the cache type from the graph input: its config is the unquantized one's
    assert json.loads((pkg / c.GENAI_CONFIG_FILE).read_text()) == json.loads(
        (packages["none"] / c.GENAI_CONFIG_FILE).read_text())
    flow = json.loads((pkg / c.WORKFLOW_FILE).read_text())
    paged = next(s for s in flow["states"] if s["discipline"] == c.GROUP_PAGED_KV)
    assert paged["element_type"] == ONNX_TYPE[dtype]
    assert paged["quantization"]["type"] == want_quant


def _session_error(path: Path) -> str:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    with pytest.raises(Exception) as info:
        ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    return str(info.value)


def test_ort_schema_accepts_the_quantized_graph(packages: dict[str, Path],
                                                tmp_path: Path) -> None:
    """The CPU EP has no PagedAttention kernel, so a session cannot be made: but ORT resolves and
    type-checks the whole graph against its schemas first. A quantized package fails only at
    kernel lookup, like the unquantized one; a float16 scale fails the type check."""
    for name in ("int8-per-channel", "fp8-per-tensor"):
        err = _session_error(packages[name] / c.MODEL_FILE)
        assert "Could not find an implementation" in err and "Type Error" not in err, err
    model = ir.load(packages["int8-per-channel"] / c.MODEL_FILE)
    init = next(v for k, v in model.graph.initializers.items() if k.endswith("k_scale"))
    init.const_value = ir.tensor(init.const_value.numpy().astype(np.float16), name=init.name)
    init.dtype = ir.DataType.FLOAT16
    bad = tmp_path / "bad"
    shutil.copytree(packages["int8-per-channel"], bad)
    ir.save(model, bad / c.MODEL_FILE, external_data=c.WEIGHTS_FILE)
    err = _session_error(bad / c.MODEL_FILE)
    assert "Type Error" in err and "k_scale" in err, err


def _mutated(pkg: Path, tmp_path: Path, fn) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path / "pkg"
    shutil.copytree(pkg, out)
    model = ir.load(out / c.MODEL_FILE)
    fn(model)
    ir.save(model, out / c.MODEL_FILE, external_data=c.WEIGHTS_FILE)
    return out


def _scale_layout(model: ir.Model) -> None:
    n = next(n for n in model.graph if n.op_type == c.PAGED_ATTENTION)
    v = n.inputs[14]
    v.const_value = ir.tensor(np.ones(1, np.float32), name=v.name)
    v.shape = ir.Shape([1])


def _quant_attr(model: ir.Model) -> None:
    n = next(n for n in model.graph if n.op_type == c.PAGED_ATTENTION)
    n.attributes["v_quant_type"] = ir.AttrString("v_quant_type", "PER_TENSOR")


def _fp16_pages(model: ir.Model) -> None:
    for v in [*model.graph.inputs, *model.graph.outputs]:
        if v.name.endswith((".key", ".value")):
            v.type = ir.TensorType(ir.DataType.FLOAT16)


def _dropped_scale(model: ir.Model) -> None:
    n = next(n for n in model.graph if n.op_type == c.PAGED_ATTENTION)
    n.replace_input_with(15, None)


@pytest.mark.parametrize(("mutate", "check"), [
    (_scale_layout, "PagedAttention kv scales"), (_quant_attr, "PagedAttention kv scales"),
    (_fp16_pages, "state input"), (_dropped_scale, "PagedAttention kv scales")],
    ids=["scale_layout", "quant_attr", "fp16_pages", "dropped_scale"])
def test_verify_rejects_broken_quantized_packages(mutate, check: str,  # type: ignore[no-untyped-def]
                                                  packages: dict[str, Path],
                                                  tmp_path: Path) -> None:
    pkg = _mutated(packages["int8-per-channel"], tmp_path, mutate)
    report = verify_package(pkg)
    assert check in {f.check for f in report.failures}, report.format()
    assert cli_main(["verify", str(pkg), "--quiet"]) == 1


def test_verify_rejects_a_workflow_that_disagrees(packages: dict[str, Path],
                                                  tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(packages["fp8-per-tensor"], pkg)
    flow = json.loads((pkg / c.WORKFLOW_FILE).read_text())
    next(s for s in flow["states"] if s["discipline"] == c.GROUP_PAGED_KV)[
        "element_type"] = "float16"
    (pkg / c.WORKFLOW_FILE).write_text(json.dumps(flow))
    assert "workflow kv cache" in {f.check for f in verify_package(pkg).failures}


def test_refusals(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UnsupportedConfiguration, match="Provider type for PagedAttention"):
        check_options(dataclasses.replace(TINY_OPTIONS, kv_cache_dtype="int8"))
    with pytest.raises(UnsupportedConfiguration, match="int8 or fp8"):
        check_options(dataclasses.replace(CUDA, kv_cache_dtype="int4"))
    with pytest.raises(UnsupportedConfiguration, match="per-channel or per-tensor"):
        check_options(dataclasses.replace(CUDA, kv_cache_dtype="int8", kv_quant="per-head"))
    bare = write_tiny(tmp_path / "bare")
    with pytest.raises(UnsupportedConfiguration, match="calibrate-kv"):
        export_package(bare, tmp_path / "o1", dataclasses.replace(CUDA, kv_cache_dtype="int8"))
    wrong = default_scales_path(ckpt, KV_DTYPES["fp8_e4m3"], "per-channel")
    with pytest.raises(ContractViolation, match="calibrated for 'fp8_e4m3'"):
        export_package(ckpt, tmp_path / "o2", dataclasses.replace(
            CUDA, kv_cache_dtype="int8", kv_scales=str(wrong)))
    assert cli_main(["export", str(ckpt), str(tmp_path / "o3"), "--ep", "webgpu",
                     "--num-blocks", "8", "--kv-cache-dtype", "fp8"]) != 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the line
    assert "WebGPU PagedAttention cannot run quantized pages" in err
