"""``pagedhybrid verify`` accepts a pristine package and rejects each mutated one.

The package is the tiny model's structure (``Dk = 16 != Dv = 8``, so a transposed recurrent
state is visible); each test copies it, breaks one thing (with onnx_ir or by editing the JSON)
and checks that verification fails on the check that owns that rule, and that the CLI exits
non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from export_helpers import TINY_OPTIONS, tiny_config, write_tiny

from pagedhybrid.export import constants as c
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.package import export_package
from pagedhybrid.export.verify import verify_package

FULL, LINEAR = 2, 0  # a full-attention and a linear layer of the tiny config


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    ckpt = write_tiny(root / "ckpt", tiny_config())
    out = root / "pkg"
    export_package(ckpt, out, dataclasses.replace(TINY_OPTIONS, weights=False))
    return out


def _copy(pristine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "pkg"
    shutil.copytree(pristine, out)
    return out


def _edit_model(pkg: Path, fn: Callable[[ir.Model], None]) -> None:
    model = ir.load(pkg / c.MODEL_FILE)
    fn(model)
    ir.save(model, pkg / c.MODEL_FILE)


def _edit_json(pkg: Path, name: str, fn: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    data = json.loads((pkg / name).read_text())
    fn(data)
    (pkg / name).write_text(json.dumps(data))


def _value(model: ir.Model, name: str) -> ir.Value:
    for v in [*model.graph.inputs, *model.graph.outputs]:
        if v.name == name:
            return v
    raise KeyError(name)


def _node(model: ir.Model, op: str, reads: str) -> ir.Node:
    return next(n for n in model.graph if n.op_type == op
                and any(v is not None and v.name == reads for v in n.inputs))


# -- mutations --------------------------------------------------------------------------------
def drop_kv_input(m: ir.Model) -> None:
    m.graph.inputs.remove(_value(m, c.PAST_KEY % FULL))


def k_major_recurrent(m: ir.Model) -> None:  # [B, Hv, Dk, Dv] instead of [B, Hv, Dv, Dk]
    for name in (c.PAST_RECURRENT % LINEAR, c.PRESENT_RECURRENT % LINEAR):
        v = _value(m, name)
        v.shape = ir.Shape([c.DIM_BATCH, 4, 16, 8])


def channels_last_conv(m: ir.Model) -> None:
    for name in (c.PAST_CONV % LINEAR, c.PRESENT_CONV % LINEAR):
        v = _value(m, name)
        b, ch, k = list(v.shape)
        v.shape = ir.Shape([b, k, ch])


def fp16_recurrent(m: ir.Model) -> None:
    for name in (c.PAST_RECURRENT % LINEAR, c.PRESENT_RECURRENT % LINEAR):
        _value(m, name).type = ir.TensorType(ir.DataType.FLOAT16)


def latent_layout(m: ir.Model) -> None:
    node = _node(m, c.PAGED_ATTENTION, c.PAST_KEY % FULL)
    node.attributes["kv_cache_layout"] = ir.AttrString("kv_cache_layout", "LATENT")


def no_attention_metadata(m: ir.Model) -> None:
    _node(m, c.PAGED_ATTENTION, c.PAST_KEY % FULL).resize_inputs(16)


def swapped_aliases(m: ir.Model) -> None:
    node = _node(m, c.PAGED_ATTENTION, c.PAST_KEY % FULL)
    key, value = node.outputs[1], node.outputs[2]
    key.name, value.name = "tmp", c.PRESENT_KEY % FULL
    key.name = c.PRESENT_VALUE % FULL


def extra_mask_input(m: ir.Model) -> None:
    m.graph.inputs.append(ir.Value(name="attention_mask", type=ir.TensorType(
        ir.DataType.INT64), shape=ir.Shape(["batch_size", "total_sequence_length"])))


def transformed_gates(m: ir.Model) -> None:
    node = _node(m, c.GATED_DELTA_NET, c.PAST_RECURRENT % LINEAR)
    node.attributes["gate_activation"] = ir.AttrString("gate_activation", "none")


def kernel_l2_norm(m: ir.Model) -> None:  # the op's own norm (eps 1e-12) instead of HF's
    node = _node(m, c.GATED_DELTA_NET, c.PAST_RECURRENT % LINEAR)
    node.attributes["qk_l2_norm"] = ir.AttrInt64("qk_l2_norm", 1)


def _l2_add(m: ir.Model) -> ir.Node:
    gdn = _node(m, c.GATED_DELTA_NET, c.PAST_RECURRENT % LINEAR)
    node = gdn.inputs[1].producer()  # k: Split -> Mul -> Reciprocal -> Sqrt -> Add
    while node.op_type != "Add":
        node = (node.inputs[1] if node.op_type == "Mul" else node.inputs[0]).producer()
    return node


def ort_l2_eps(m: ir.Model) -> None:
    eps = ir.Value(name="eps_ort", const_value=ir.tensor(np.array([1e-12], dtype=np.float32),
                                                         name="eps_ort"))
    m.graph.register_initializer(eps)
    _l2_add(m).replace_input_with(1, eps)


def unnormalized_q(m: ir.Model) -> None:
    gdn = _node(m, c.GATED_DELTA_NET, c.PAST_RECURRENT % LINEAR)
    q_reshape = next(n for n in m.graph
                     if n.name.endswith(f"layers.{LINEAR}/linear_attn/qk/Reshape"))
    gdn.replace_input_with(0, q_reshape.outputs[0])


def conv_without_boundaries(m: ir.Model) -> None:
    node = _node(m, c.VARLEN_CONV, c.PAST_CONV % LINEAR)
    node.replace_input_with(2, None)


def incomplete_partition(m: ir.Model) -> None:
    m.metadata_props[c.META_LINEAR_LAYERS] = "0,1,3"


MODEL_MUTATIONS = [
    (drop_kv_input, "state input"),
    (k_major_recurrent, "recurrent state layout"),
    (channels_last_conv, "conv state layout"),
    (fp16_recurrent, "state input"),
    (latent_layout, "PagedAttention attributes"),
    (no_attention_metadata, "PagedAttention operands"),
    (swapped_aliases, "cache aliasing"),
    (extra_mask_input, "inputs exact"),
    (transformed_gates, "GatedDeltaNet attributes"),
    (kernel_l2_norm, "GatedDeltaNet attributes"),
    (ort_l2_eps, "q/k l2 norm"),
    (unnormalized_q, "q/k l2 norm"),
    (conv_without_boundaries, "VarlenCausalConvWithState operands"),
    (incomplete_partition, "partition complete"),
]


def test_pristine_package_verifies(pristine: Path) -> None:
    report = verify_package(pristine)
    assert report.ok, report.format()
    assert cli_main(["verify", str(pristine), "--quiet"]) == 0


@pytest.mark.parametrize(("mutate", "check"), MODEL_MUTATIONS,
                         ids=[m.__name__ for m, _ in MODEL_MUTATIONS])
def test_model_mutation_rejected(mutate: Callable[[ir.Model], None], check: str,
                                 pristine: Path, tmp_path: Path) -> None:
    pkg = _copy(pristine, tmp_path)
    _edit_model(pkg, mutate)
    report = verify_package(pkg)
    assert not report.ok
    assert check in {f.check for f in report.failures}, report.format()
    assert cli_main(["verify", str(pkg), "--quiet"]) == 1


def _move_layer_to_paged(d: dict) -> None:  # type: ignore[type-arg]
    groups = d["model"]["decoder"]["state_groups"]
    groups[0]["layer_ids"].append(LINEAR)
    groups[1]["layer_ids"].remove(LINEAR)


GENAI_MUTATIONS = [
    ("wrong_group_ids", _move_layer_to_paged, "genai state_groups"),
    ("missing_recurrent_group",
     lambda d: d["model"]["decoder"]["state_groups"].pop(), "genai state_groups"),
    ("builder_conv_names",
     lambda d: d["model"]["decoder"]["inputs"].update(past_conv_names="past.%d.conv"),
     "genai state names"),
    ("block_size_mismatch",
     lambda d: d["engine"]["dynamic_batching"].update(block_size=32), "genai dynamic_batching"),
    ("two_page_budgets",
     lambda d: d["engine"]["dynamic_batching"].update(gpu_utilization_factor=0.5),
     "genai dynamic_batching"),
    ("provider_mismatch",
     lambda d: d["model"]["decoder"]["session_options"].update(
         provider_options=[{"cuda": {}}]), "genai provider"),
    ("no_share_buffer",
     lambda d: d["search"].update(past_present_share_buffer=False), "genai search"),
    ("head_count_mismatch",
     lambda d: d["model"]["decoder"].update(num_key_value_heads=4), "state input"),
]


@pytest.mark.parametrize(("mutate", "check"), [(m, ch) for _, m, ch in GENAI_MUTATIONS],
                         ids=[name for name, _, _ in GENAI_MUTATIONS])
def test_genai_config_mutation_rejected(mutate: Callable[[dict], None], check: str,  # type: ignore[type-arg]
                                        pristine: Path, tmp_path: Path) -> None:
    pkg = _copy(pristine, tmp_path)
    _edit_json(pkg, c.GENAI_CONFIG_FILE, mutate)
    report = verify_package(pkg)
    assert not report.ok
    assert check in {f.check for f in report.failures}, report.format()


def test_workflow_mismatch_and_missing_files(pristine: Path, tmp_path: Path) -> None:
    pkg = _copy(pristine, tmp_path)
    _edit_json(pkg, c.WORKFLOW_FILE, lambda d: d["states"].pop())
    assert "workflow states" in {f.check for f in verify_package(pkg).failures}
    (pkg / c.GENAI_CONFIG_FILE).unlink()
    report = verify_package(pkg)
    assert not report.ok and "files" in {f.check for f in report.failures}
