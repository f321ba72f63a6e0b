"""``--weights int4|int8[:BLOCK][:asym]``: every projection one ``com.microsoft.MatMulNBits``
holding ``pagedhybrid.weightquant``'s codes and scales (``export/nbits.py``).

* Round trip: for int4, int4:128, int4:32:asym, int8:32 (and per-channel int8, whose padded
  K are powers of two in the tiny shape) the package's codes, scales and zero points equal
  ``weightquant.quantize`` of the checkpoint tensors byte for byte -- read here from the
  initializers, independently of ``pagedhybrid verify``, which passes with ``--checkpoint``.
* The engine agrees on what is quantised and on every byte: a tiny mixture-of-experts model
  with an MTP head and a tied LM head, ``model.quantize(fmt)``: each quantised module's
  ``QuantizedWeight`` equals the rows of the package node that names it (router gates and
  routed experts float on both sides; the tied head quantised from the embedding table).
* Numerics, in onnxruntime 1.32 (MatMulNBits on the CPU EP, PagedAttention on the WebGPU plugin):
  - ``--accuracy-level 0`` (A not quantised) against the engine holding the same codes with
    the float product ``x @ dequantize(q)^T``: within the float16 export's 2.5e-2 (measured
    6e-3..8e-3 on the tiny model, 1.3e-2 on the built-in one -- the float16 package's own error),
    while the codes move the logits of the float model by far more;
  - the default level 4 (A quantised to int8 per block on the CPU, as the engine's kernels do
    per 32) against the engine's own ``reference`` forward of the built-in model: the two int8
    roundings of A are independent (onnxruntime rounds the float16 activations), each ~0.1 from
    the float product, so the bound is ``ACT_TOL`` = 0.4 (measured over 10 steps: 0.16 int4,
    0.20 int4:128, 0.14 int4:32:asym, 0.13 int8:32, on logits up to 19) -- and the greedy
    tokens are equal.
* onnxruntime-genai 0.18.0's Engine on the WebGPU EP runs the built-in int4 package: its greedy
  tokens equal the engine's with ``quantization="int4"`` (and differ from the float32 ones:
  the int4 weights are really used).
* ``pagedhybrid verify`` catches a changed code byte, a wrong ``block_size`` and a projection
  left float, naming the node and attribute.
* The kernels behind the refusals, on one-node models: the CPU EP and the WebGPU plugin run
  float16 MatMulNBits with 4 and 8 bits (so no EP refuses int8), neither has bfloat16.
* Refusals, each naming the option and writing nothing: ``--weights`` with bf16 (cuda),
  per-channel int8 where a padded K is no power of two (the built-in model's down_proj, K 640),
  a bad spelling, ``--accuracy-level`` out of range or without ``--weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from export_helpers import (
    ADMIT_AFTER,
    BLOCK_SIZE,
    MAX_NEW,
    NUM_BLOCKS,
    PROMPTS,
    TINY_OPTIONS,
    engine_prompts,
    write_tiny,
)
from onnx import TensorProto, helper, numpy_helper

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.nbits import layout, pack_zero_points, unpack_zero_points
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.export.session import PackedGraphSession, batch_inputs
from pagedhybrid.export.verify import verify_package
from pagedhybrid.export.weights import CheckpointWeights
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.onnxruntime.session import webgpu_ep_device
from pagedhybrid.models.qwen35 import Qwen35Config, default_model_dir
from pagedhybrid.models.qwen35.model import Qwen35ForCausalLM, load
from pagedhybrid.models.qwen35.packed import PackedBatch, PagedHybridCache
from pagedhybrid.models.qwen35.synthetic import tiny_moe_config
from pagedhybrid.parallel.linear import ReplicatedLinear
from pagedhybrid.weightquant import (
    QuantizedWeight,
    WeightFormat,
    dequantize,
    quantize,
    ungroup,
)

FORMATS = ("int4", "int4:128", "int4:32:asym", "int8:32")
LOGITS_TOL = 2.5e-2  # accuracy level 0: the float16 export's tolerance (test_export_numerics)
ACT_TOL = 0.4  # accuracy level 4 vs the engine's int8 activations (module docstring)

Rows = dict[str, list[QuantizedWeight]]  # checkpoint tensor -> its rows in each graph


def _export(ckpt: Path, out: Path, spec: str | None, **options: object) -> Path:
    export_package(ckpt, out, dataclasses.replace(TINY_OPTIONS, weight_format=spec, **options))
    return out


def _package_rows(package: Path, shapes: dict[str, tuple[int, ...]]) -> Rows:
    """Every MatMulNBits node's rows, split by the checkpoint tensors its metadata names (of
    ``shapes``), as ``QuantizedWeight`` (zero points unpacked), from the initializers on disk."""
    rows: Rows = {}
    for graph in (c.MODEL_FILE, c.MTP_FILE):
        if not (package / graph).is_file():
            continue
        model = ir.load(package / graph)
        fmt = WeightFormat.parse(model.metadata_props[c.META_WEIGHT_FORMAT])
        for node in model.graph:
            if node.op_type != c.MATMUL_NBITS:
                continue
            codes, scales = (torch.from_numpy(np.array(v.const_value.numpy()))
                             for v in node.inputs[1:3])
            zp = node.inputs[3] if len(node.inputs) > 3 else None
            zeros = None if zp is None else unpack_zero_points(
                torch.from_numpy(np.array(zp.const_value.numpy())), fmt.bits, scales.shape[1])
            row, k = 0, node.attributes["K"].value
            for part in node.metadata_props[c.META_PROJECTIONS].split(","):
                sl = slice(row, row + shapes[part][0])
                rows.setdefault(part, []).append(QuantizedWeight(
                    codes[sl], scales[sl], None if zeros is None else zeros[sl], fmt, k))
                row = sl.stop
            assert row == codes.shape[0], node.name
    return rows


def _same(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    """Byte-identical codes, scales and zero points in MatMulNBits' layout (the engine holds
    weights in groups of 16 rows: ``ungroup``)."""
    a, b = ungroup(a), ungroup(b)
    if (a.zeros is None) != (b.zeros is None) or a.codes.shape != b.codes.shape:
        return False
    same = torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.int16),
                                                         b.scales.view(torch.int16))
    return same and (a.zeros is None or torch.equal(a.zeros, b.zeros))


def _checkpoint_rows(ckpt: Path, package: Path, mtp: bool = False
                     ) -> tuple[Rows, CheckpointWeights]:
    weights = CheckpointWeights(ckpt, Qwen35Config.from_model_dir(ckpt), "float16", mtp)
    return _package_rows(package, weights.shapes), weights


# -- round trip ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [*FORMATS, "int8"])
def test_package_holds_weightquant_codes(spec: str, tiny_checkpoint: Path,
                                         tmp_path: Path) -> None:
    pkg = _export(tiny_checkpoint, tmp_path / "pkg", spec)
    rows, weights = _checkpoint_rows(tiny_checkpoint, pkg)
    fmt = WeightFormat.parse(spec)
    projections = {n for n, s in weights.shapes.items()
                   if len(s) == 2 and n != "model.embed_tokens.weight"}
    assert set(rows) == projections  # every projection, the untied LM head included
    for name, held in rows.items():
        want = quantize(weights.read(name), fmt, name)
        assert all(_same(got, want) for got in held), name
    report = verify_package(pkg, tiny_checkpoint)
    assert report.ok, report.format()
    checked = [f for f in report.findings if f.check == "MatMulNBits weights"]
    assert len(checked) == 25  # 6 layers x 4 products + the LM head


@pytest.fixture(scope="module")
def moe_mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny MoE (8 experts, top-2, shared expert of 48: K 48 is padded to 64), an MTP head and
    a tied LM head."""
    cfg = dataclasses.replace(tiny_moe_config(), mtp_num_hidden_layers=1)
    return write_tiny(tmp_path_factory.mktemp("tiny-moe-mtp"), cfg)


@pytest.mark.parametrize("spec", ["int4:32:asym", "int8"])
def test_engine_and_package_quantise_the_same_projections(spec: str, moe_mtp_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    pkg = _export(moe_mtp_checkpoint, tmp_path / "pkg", spec, mtp=True,
                  state_update_capacity=2)
    report = verify_package(pkg, moe_mtp_checkpoint)
    assert report.ok, report.format()
    rows, _ = _checkpoint_rows(moe_mtp_checkpoint, pkg, mtp=True)
    model = load(moe_mtp_checkpoint, torch.float32, mtp=True)
    model.quantize(WeightFormat.parse(spec))
    held = {f"{name}.weight": m.quant for name, m in model.named_modules()
            if isinstance(m, ReplicatedLinear) and m.quant is not None}
    held["model.embed_tokens.weight"] = held.pop("lm_head.weight")  # tied: the table's codes
    assert set(held) == set(rows)
    assert not any(".mlp.gate." in n or "shared_expert_gate" in n or ".experts." in n
                   for n in held)
    assert any(q.grouped for q in held.values()) and not all(q.grouped for q in held.values())
    for name, q in held.items():
        assert all(_same(got, q) for got in rows[name]), name
    assert len(rows["model.embed_tokens.weight"]) == 2  # the main graph's head and the MTP's
    head = ir.load(pkg / c.MTP_FILE)
    router = [n for n in ir.load(pkg / c.MODEL_FILE).graph if n.op_type == "MatMul"
              and (n.inputs[1].name or "").endswith(c.ROUTER_WEIGHT + ".transpose")]
    assert len(router) == 6 and any(n.op_type == c.MATMUL_NBITS and n.name == "/mtp/fc/MatMulNBits"
                                    for n in head.graph)


# -- numerics --------------------------------------------------------------------------------------
def _schedule(model: Qwen35ForCausalLM, package: Path, prompts: list[list[int]], decodes: int
              ) -> tuple[float, list[list[int]], list[list[int]]]:
    """Prefill ``prompts`` then ``decodes`` greedy steps through both (the graph fed the
    engine's tokens): (max |logit difference|, engine tokens, graph tokens)."""
    cfg = model.config
    n = len(prompts)
    cache = PagedHybridCache.allocate(cfg, num_pages=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                      num_slots=n)
    graph = PackedGraphSession(package, NUM_BLOCKS)
    conv = {i: np.zeros((n, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), np.float16)
            for i in cfg.linear_attention_layers}
    rec = {i: np.zeros((n, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                        cfg.linear_key_head_dim), np.float32) for i in cfg.linear_attention_layers}
    pages = [[3 * b, 3 * b + 1, 3 * b + 2] for b in range(n)]
    new, past = [list(p) for p in prompts], [0] * n
    err, ours, theirs = 0.0, [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(decodes + 1):
        batch = PackedBatch.from_sequences(new, past, pages, list(range(n)))
        ref = model.forward_packed(batch, cache).numpy()  # [N, V]
        out = graph.step(**batch_inputs(batch), conv=conv, recurrent=rec)
        err = max(err, float(np.abs(out.logits - ref).max()))
        last = batch.last_token_rows().numpy()
        for b, (t, g) in enumerate(zip(ref[last].argmax(-1), out.logits[last].argmax(-1),
                                       strict=True)):
            ours[b].append(int(t))
            theirs[b].append(int(g))
        past = [p + len(x) for p, x in zip(past, new, strict=True)]
        new = [[t[-1]] for t in ours]
    return err, ours, theirs


def _float_product(model: Qwen35ForCausalLM) -> Qwen35ForCausalLM:
    """The engine holding its codes (after ``quantize``, which sets the bundle's product),
    multiplying by the dequantised weights in float: what MatMulNBits computes at accuracy
    level 0."""
    for m in model.modules():
        if isinstance(m, ReplicatedLinear) and m.quant is not None:
            m.qmatmul = lambda x, q: x @ dequantize(q, x.dtype).T
    return model


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [np.random.default_rng(k).integers(0, 256, n).tolist()
            for k, n in enumerate(lengths)]


@pytest.mark.parametrize("spec", FORMATS)
def test_level0_graph_computes_the_engines_codes(spec: str, tiny_checkpoint: Path,
                                                 tmp_path: Path) -> None:
    pkg = _export(tiny_checkpoint, tmp_path / "pkg", spec, accuracy_level=0)
    model = load(tiny_checkpoint, torch.float32, backend=backend("reference"))
    plain = model.forward_packed(*_one_step(model))
    model.quantize(WeightFormat.parse(spec))
    moved = float((model.forward_packed(*_one_step(_float_product(model))) - plain).abs().max())
    err, _, _ = _schedule(model, pkg, _prompts((25, 7, 18)), decodes=3)
    print(f"{spec}: max |logit error| {err:.2e}, the codes move float logits by {moved:.2e}")
    assert err <= LOGITS_TOL
    assert moved > 2 * LOGITS_TOL  # the comparison tells these codes from the float weights


def _one_step(model: Qwen35ForCausalLM) -> tuple[PackedBatch, PagedHybridCache]:
    cache = PagedHybridCache.allocate(model.config, num_pages=NUM_BLOCKS,
                                      block_size=BLOCK_SIZE, num_slots=1)
    return PackedBatch.from_sequences(_prompts((20,)), [0], [[0, 1]], [0]), cache


@pytest.fixture(scope="module")
def builtin_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model's int4 package (the webgpu default: accuracy level 4)."""
    return _export(default_model_dir(), tmp_path_factory.mktemp("builtin-int4"), "int4")


def test_level4_graph_tracks_the_engines_int8_activations(builtin_int4: Path) -> None:
    assert ir.load(builtin_int4 / c.MODEL_FILE).metadata_props[c.META_ACCURACY_LEVEL] == "4"
    model = load(default_model_dir(), torch.float32, backend=backend("reference"))
    model.quantize(WeightFormat.parse("int4"))
    err, ours, theirs = _schedule(model, builtin_int4, engine_prompts(), decodes=5)
    print(f"int4, accuracy level 4: max |logit error| {err:.3f}")
    assert err <= ACT_TOL
    assert ours == theirs


@pytest.fixture(scope="module")
def engine_int4_tokens() -> list[list[int]]:
    """The engine's greedy tokens of the Engine scenario with int4 weights (reference)."""
    engine = Engine(load(default_model_dir(), torch.float32),
                    EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=8,
                                 quantization="int4", backend="reference",
                                 enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for k, prompt in enumerate(engine_prompts()):
        engine.add_request(str(k), prompt, params)
    done = {o.request_id: list(o.token_ids) for o in engine.stream() if o.finished}
    return [done[str(k)] for k in range(len(PROMPTS))]


def test_genai_engine_runs_the_int4_package(builtin_int4: Path,
                                            engine_int4_tokens: list[list[int]],
                                            torch_tokens: list[list[int]]) -> None:
    import onnxruntime_genai as og
    from genai_runner import register_webgpu, run_schedule

    register_webgpu()
    engine = og.Engine(og.Model(og.Config(str(builtin_int4))))
    tokens, _ = run_schedule(engine, engine_prompts(), MAX_NEW, ADMIT_AFTER)
    print(f"genai int4 tokens {tokens}")
    assert tokens == engine_int4_tokens
    assert tokens != torch_tokens  # the float32 model's: the package runs its int4 codes


# -- verify ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_package(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tiny_checkpoint, tmp_path_factory.mktemp("tiny-int4"), "int4:32:asym")


def _damaged(package: Path, out: Path, damage: Callable[[ir.Model], None]) -> Path:
    model = ir.load(package / c.MODEL_FILE)
    for init in model.graph.initializers.values():  # read every tensor before re-saving
        init.const_value = ir.tensor(np.array(init.const_value.numpy()), name=init.name)
    damage(model)
    out.mkdir()
    ir.save(model, out / c.MODEL_FILE, external_data=c.WEIGHTS_FILE)
    for f in (c.GENAI_CONFIG_FILE, c.WORKFLOW_FILE):
        (out / f).write_bytes((package / f).read_bytes())
    return out


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


DOWN = "/model/layers.1/mlp/down_proj/MatMulNBits"


def _flip_code(model: ir.Model) -> None:
    b = _node(model, DOWN).inputs[1]
    codes = np.array(b.const_value.numpy())
    codes[3, 0, 5] ^= 0x10
    b.const_value = ir.tensor(codes, name=b.name)


def _block_size(model: ir.Model) -> None:
    _node(model, DOWN).attributes["block_size"] = ir.AttrInt64("block_size", 64)


def _float_down(model: ir.Model) -> None:
    """down_proj back to a float MatMul over an ordinary transposed weight."""
    node = _node(model, DOWN)
    k = node.attributes["K"].value
    n = node.attributes["N"].value
    w = ir.Value(name="model.layers.1.mlp.down_proj.weight.transpose",
                 const_value=ir.tensor(np.zeros((k, n), np.float16)))
    model.graph.register_initializer(w)
    mm = ir.Node("", "MatMul", [node.inputs[0], w], name="/model/layers.1/mlp/down_proj/MatMul")
    model.graph.insert_after(node, mm)
    node.outputs[0].replace_all_uses_with(mm.outputs[0])
    model.graph.remove(node, safe=True)


@pytest.mark.parametrize(("damage", "check", "words"), [
    (_flip_code, "MatMulNBits weights", ["B row 3 (1 of model.layers.1.mlp.down_proj.weight"]),
    (_block_size, "MatMulNBits node", ["block_size 64", "expected 32"]),
    (_float_down, "MatMulNBits coverage", ["/model/layers.1/mlp/down_proj/MatMul"]),
])
def test_verify_catches_a_wrong_projection(damage: Callable[[ir.Model], None], check: str,
                                           words: list[str], int4_package: Path,
                                           tiny_checkpoint: Path, tmp_path: Path) -> None:
    assert verify_package(int4_package, tiny_checkpoint).ok
    bad = verify_package(_damaged(int4_package, tmp_path / "bad", damage), tiny_checkpoint)
    failures = [f for f in bad.failures if f.check == check]
    assert failures and all(w in failures[0].detail for w in words), bad.format()
    if check != "MatMulNBits coverage":
        assert DOWN in failures[0].detail


def test_structure_only_export_declares_the_quantized_tensors(tiny_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    pkg = _export(tiny_checkpoint, tmp_path / "pkg", "int4:128", weights=False)
    assert not (pkg / c.WEIGHTS_FILE).exists()
    report = verify_package(pkg)
    assert report.ok, report.format()
    model = ir.load(pkg / c.MODEL_FILE)
    codes = model.graph.initializers["model.layers.0.mlp.down_proj.weight.codes"]
    assert tuple(codes.shape) == (64, 1, 64)  # K 128 in one block of 128, 4 bits: 64 bytes


# -- the kernels behind the refusals ---------------------------------------------------------------
def _one_node(fmt: WeightFormat, elem: int, w: torch.Tensor) -> bytes:
    n, k = w.shape
    q = quantize(w, fmt)
    lay = layout(fmt, n, k, "w")
    scales = (numpy_helper.from_array(q.scales.numpy(), "scales") if elem == TensorProto.FLOAT16
              else helper.make_tensor("scales", elem, list(lay.scales),
                                      q.scales.to(torch.bfloat16).view(torch.int16).numpy()
                                      .tobytes(), raw=True))
    inits = [numpy_helper.from_array(q.codes.numpy(), "B"), scales]
    if q.zeros is not None:
        inits.append(numpy_helper.from_array(pack_zero_points(q.zeros, fmt.bits).numpy(), "zp"))
    node = helper.make_node(c.MATMUL_NBITS, ["A", "B", "scales"]
                            + (["zp"] if q.zeros is not None else []), ["Y"],
                            domain=c.MS_DOMAIN, K=k, N=n, bits=fmt.bits, block_size=lay.block,
                            accuracy_level=0)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", elem, ["M", k])],
                              [helper.make_tensor_value_info("Y", elem, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.OPSET),
                                                    helper.make_opsetid(c.MS_DOMAIN, c.MS_OPSET)])
    model.ir_version = c.IR_VERSION
    return model.SerializeToString()


def _session(model: bytes, ep: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    if ep == "webgpu":
        so.add_provider_for_devices([webgpu_ep_device()], {})
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # on WebGPU or fail
        return ort.InferenceSession(model, sess_options=so)
    return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("ep", ["cpu", "webgpu"])
def test_matmul_nbits_kernels(ep: str) -> None:
    """float16 with 4 and 8 bits (zero points, K 80 padded to 96 / to 128) runs on both EPs,
    as the float product of the dequantised weights; bfloat16 has a kernel on neither."""
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(1)) * 0.1
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(2))
    for spec in ("int4:32:asym", "int8:128"):
        fmt = WeightFormat.parse(spec)
        y = _session(_one_node(fmt, TensorProto.FLOAT16, w), ep).run(
            None, {"A": x.half().numpy()})[0]
        want = x.half().float() @ dequantize(quantize(w, fmt)).T
        assert float(np.abs(y.astype(np.float32) - want.numpy()).max()) < 1e-2, spec
    with pytest.raises(Exception, match="MatMulNBits"):
        _session(_one_node(WeightFormat.parse("int4"), TensorProto.BFLOAT16, w), ep)


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ckpt", "options", "words"), [
    ("tiny", {"ep": "cuda", "dtype": "bf16", "num_blocks": None, "gpu_utilization": 0.5,
              "weight_format": "int4"}, ["--weights int4", "--dtype bf16", "--dtype fp16"]),
    ("builtin", {"weight_format": "int8"}, ["--weights int8", "down_proj", "K 640",
                                            "int8:32"]),
    ("tiny", {"weight_format": "int3"}, ["--weights 'int3'"]),
    ("tiny", {"weight_format": "int4", "accuracy_level": 7}, ["--accuracy-level 7"]),
    ("tiny", {"accuracy_level": 4}, ["--accuracy-level", "--weights"]),
    ("tiny", {"quantize_lm_head": False}, ["--no-quantize-lm-head", "--weights"]),
])
def test_refusals_name_the_option_and_write_nothing(ckpt: str, options: dict[str, object],
                                                    words: list[str], tiny_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    model_dir = tiny_checkpoint if ckpt == "tiny" else default_model_dir()
    with pytest.raises(UnsupportedConfiguration) as err:
        export_package(model_dir, out, dataclasses.replace(TINY_OPTIONS, **options))
    assert all(w in err.value.reason for w in words), err.value.reason
    assert not out.exists()


def test_cli_weights_options(tiny_checkpoint: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    base = ["export", str(tiny_checkpoint), str(tmp_path / "pkg"), "--ep", "webgpu",
            "--block-size", "16", "--num-blocks", "32"]
    assert cli_main([*base, "--weights", "int4:64", "--accuracy-level", "0",
                     "--no-quantize-lm-head"]) == 0
    meta = dict(ir.load(tmp_path / "pkg" / c.MODEL_FILE).metadata_props)
    assert (meta[c.META_WEIGHT_FORMAT], meta[c.META_ACCURACY_LEVEL],
            meta[c.META_QUANTIZED_LM_HEAD]) == ("int4:64", "0", "0")
    assert cli_main(["verify", str(tmp_path / "pkg"), "--checkpoint", str(tiny_checkpoint),
                     "--quiet"]) == 0
    out = tmp_path / "refused"
    assert cli_main([*base[:2], str(out), *base[3:], "--weights", "int4", "--dtype",
                     "bf16"]) == 2
    assert not out.exists()
    assert ExportOptions(weight_format="int4").weight_quant.accuracy_level == 4  # webgpu
    assert ExportOptions(ep="cuda", weight_format="int4").weight_quant.accuracy_level == 0
