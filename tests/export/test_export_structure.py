"""Structural export of Qwen3.5-27B-class configs (``--no-weights``) and of the tiny model.

The 27B-class config (64 layers, hidden 5120, 24/4 heads of 256, linear 16/48 heads of 128,
conv 4) with ``full_attention_interval`` 4 gives exactly 16 PagedAttention and 48 GatedDeltaNet /
VarlenCausalConvWithState nodes; intervals 2 and 3 give the counts their layer partition implies
(computed here from HF's rule ``(i + 1) % interval == 0``, not from the exporter). The packed ABI
is checked name by name: only full-attention layers own page buffers, no dense inputs, float
logits, V-major float recurrent state, and the genai config carries the exact layer groups.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir
import pytest
from export_helpers import TINY_OPTIONS, tiny_config, write_tiny

from pagedhybrid.export import constants as c
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.export.verify import verify_package

CUDA_BF16 = ExportOptions(ep="cuda", dtype="bf16", weights=False)


def _hf_partition(n_layers: int, interval: int) -> tuple[list[int], list[int]]:
    full = [i for i in range(n_layers) if (i + 1) % interval == 0]
    return full, [i for i in range(n_layers) if (i + 1) % interval != 0]


def _io(model: ir.Model) -> tuple[dict[str, ir.Value], dict[str, ir.Value]]:
    return ({v.name: v for v in model.graph.inputs}, {v.name: v for v in model.graph.outputs})


@pytest.mark.parametrize("interval", [4, 2, 3])
def test_qwen27b_structure(interval: int, qwen27b_config_dir: Callable[..., Path],
                           tmp_path: Path) -> None:
    start = time.perf_counter()
    result = export_package(qwen27b_config_dir(interval), tmp_path, CUDA_BF16)
    seconds = time.perf_counter() - start
    print(f"interval {interval}: structural export {seconds:.1f} s")
    full, linear = _hf_partition(64, interval)
    if interval == 4:
        assert (len(full), len(linear)) == (16, 48)
        assert full == list(range(3, 64, 4))
    counts = result.op_counts
    assert counts["PagedAttention"] == len(full)
    assert counts["GatedDeltaNet"] == len(linear)
    assert counts["VarlenCausalConvWithState"] == len(linear)
    assert not (tmp_path / c.WEIGHTS_FILE).exists()
    model = ir.load(tmp_path / c.MODEL_FILE)
    inputs, outputs = _io(model)
    kv = {n for n in inputs if n.endswith((".key", ".value"))}
    assert kv == {c.PAST_KEY % i for i in full} | {c.PAST_VALUE % i for i in full}
    assert {n for n in inputs if n.endswith(".conv_state")} == {c.PAST_CONV % i for i in linear}
    assert {n for n in inputs if n.endswith(".recurrent_state")} == {
        c.PAST_RECURRENT % i for i in linear}
    assert "attention_mask" not in inputs and "slot_mapping" not in inputs
    key = inputs[c.PAST_KEY % full[0]]
    assert key.dtype == ir.DataType.BFLOAT16 and list(key.shape)[1:] == [256, 4, 256]
    conv = inputs[c.PAST_CONV % linear[0]]
    assert conv.dtype == ir.DataType.BFLOAT16
    assert list(conv.shape)[1:] == [2 * 16 * 128 + 48 * 128, 3]
    rec = inputs[c.PAST_RECURRENT % linear[0]]
    assert rec.dtype == ir.DataType.FLOAT and list(rec.shape)[1:] == [48, 128, 128]
    assert outputs[c.LOGITS].dtype == ir.DataType.FLOAT
    assert list(outputs[c.LOGITS].shape)[1] == 248320
    genai = json.loads((tmp_path / c.GENAI_CONFIG_FILE).read_text())
    assert genai["model"]["decoder"]["state_groups"] == [
        {"kind": "paged_kv", "layer_ids": full},
        {"kind": "fixed_conv", "layer_ids": linear},
        {"kind": "fixed_recurrent", "layer_ids": linear},
    ]
    meta = model.metadata_props
    assert meta[c.META_FULL_LAYERS] == ",".join(map(str, full))
    assert meta[c.META_BLOCK_SIZE] == "256"
    assert meta[c.META_ORT] == "1.32.0" and meta[c.META_GENAI] == "0.18.0"
    report = verify_package(tmp_path)
    assert report.ok, report.format()


def test_paged_attention_operands(qwen27b_config_dir: Callable[..., Path],
                                  tmp_path: Path) -> None:
    export_package(qwen27b_config_dir(4), tmp_path, CUDA_BF16)
    model = ir.load(tmp_path / c.MODEL_FILE)
    pa = [n for n in model.graph if n.op_type == "PagedAttention"]
    for node in pa:
        names = [v.name if v is not None else "" for v in node.inputs]
        i = int(names[3].split(".")[1])
        assert len(names) == 17 and node.domain == "com.microsoft"
        assert names[3:8] == [c.PAST_KEY % i, c.PAST_VALUE % i, c.CU_SEQLENS, c.PAST_SEQLENS,
                              c.BLOCK_TABLE]
        assert names[8:16] == [""] * 8 and names[16] == c.ATTENTION_METADATA
        assert [v.name for v in node.outputs][1:] == [c.PRESENT_KEY % i, c.PRESENT_VALUE % i]
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["num_heads"] == 24 and attrs["kv_num_heads"] == 4
        assert attrs["kv_cache_layout"] == "SEPARATE" and attrs["do_rotary"] == 0
    gdn = [n for n in model.graph if n.op_type == "GatedDeltaNet"]
    for node in gdn:
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["gate_activation"] == "qwen" and attrs["beta_activation"] == "sigmoid"
        assert attrs["qk_l2_norm"] == 0 and attrs["update_rule"] == "gated_delta"
        # q, k: HF's l2 norm in float32 before the op, q and k heads in one pass
        for k in (0, 1):
            split = node.inputs[k].producer()
            ops = [split.op_type]
            v = split.inputs[0]
            while v.producer() is not None and v.producer().op_type != "Reshape":
                ops.append(v.producer().op_type)
                v = v.producer().inputs[1 if v.producer().op_type == "Mul" else 0]
            assert ops == ["Split", "Mul", "Reciprocal", "Sqrt", "Add", "ReduceSumSquare",
                           "Cast"], ops
        a_log, dt_bias = node.inputs[7], node.inputs[8]
        assert a_log.dtype == dt_bias.dtype == ir.DataType.FLOAT
        assert list(a_log.shape) == [48]
        # raw a/b straight from their projections (no transformed gates in the graph)
        for k in (4, 5):
            cast = node.inputs[k].producer()
            split = cast.inputs[0].producer()
            assert cast.op_type == "Cast" and split.op_type == "Split"
            assert split.inputs[0].producer().op_type == "MatMul"
    # the gate math is the kernel's: no Softplus/Exp anywhere in the graph
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Softplus"] == 0 and ops["Exp"] == 0


def test_tiny_tied_and_fp16(tmp_path: Path) -> None:
    """Tied embeddings reuse the embedding (no lm_head initializer); webgpu fp16 ABI."""
    ckpt = write_tiny(tmp_path / "ckpt", tiny_config(tie_word_embeddings=True))
    out = tmp_path / "pkg"
    result = export_package(ckpt, out, TINY_OPTIONS)
    assert (out / c.WEIGHTS_FILE).is_file() and "pagedhybrid_tokenizer.json" in result.files
    model = ir.load(out / c.MODEL_FILE)
    assert not any("lm_head" in name for name in model.graph.initializers)
    assert any(n.name == "/lm_head/TransposeEmbedding" for n in model.graph)
    inputs, _ = _io(model)
    assert inputs[c.PAST_KEY % 2].dtype == ir.DataType.FLOAT16
    assert list(inputs[c.PAST_RECURRENT % 0].shape)[1:] == [4, 8, 16]  # [Hv, Dv, Dk]
    genai = json.loads((out / c.GENAI_CONFIG_FILE).read_text())
    dec = genai["model"]["decoder"]
    assert dec["inputs"]["past_conv_names"] == "past_key_values.%d.conv_state"
    assert dec["inputs"]["past_recurrent_names"] == "past_key_values.%d.recurrent_state"
    assert dec["outputs"]["present_recurrent_names"] == "present.%d.recurrent_state"
    assert dec["session_options"]["provider_options"] == [
        {"webgpu": {"enableGraphCapture": "0", "validationMode": "basic"}}]
    assert genai["engine"]["dynamic_batching"] == {"block_size": 16, "max_batch_size": 8,
                                                   "num_blocks": 32}
    assert genai["search"]["past_present_share_buffer"] is True
    workflow = json.loads((out / c.WORKFLOW_FILE).read_text())
    kinds = {s["discipline"]: s for s in workflow["states"]}
    assert kinds["paged_kv"]["update"] == {"kind": "paged_scatter", "aliasing": "required"}
    assert kinds["fixed_recurrent"]["batch_layout"]["kind"] == "request_aligned"
    assert verify_package(out).ok


def test_weights_in_graph_layout(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """bf16 (cuda) export with weights: every initializer is the checkpoint tensor in the
    layout the graph consumes (transposed and fused projections, ``1 + w`` offset norms, raw
    gated-norm weight, float32 gates), read back from the external data file."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "pkg"
    export_package(tiny_checkpoint, out, ExportOptions(ep="cuda", dtype="bf16", block_size=16,
                                                       num_blocks=8))
    assert verify_package(out).ok
    model = ir.load(out / c.MODEL_FILE)
    inits = model.graph.initializers
    ckpt = load_file(str(tiny_checkpoint / "model.safetensors"))

    def graph(name: str) -> torch.Tensor:
        t = inits[name].const_value
        assert t is not None, name
        return torch.from_numpy(t.numpy().astype("float32"))

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    lin = "model.layers.0.linear_attn"
    attn = "model.layers.2.self_attn"
    assert inits[f"{lin}.A_log"].dtype == ir.DataType.FLOAT
    assert torch.equal(graph(f"{lin}.A_log"), ckpt[f"{lin}.A_log"])
    assert torch.equal(graph(f"{lin}.dt_bias"), ckpt[f"{lin}.dt_bias"])
    qkv = f"{attn}.qkv_proj.weight.transpose"
    assert inits[qkv].dtype == ir.DataType.BFLOAT16
    fused = torch.cat([ckpt[f"{attn}.{n}_proj.weight"].t() for n in "qkv"], dim=1)
    assert torch.equal(graph(qkv), bf16(fused))  # [hidden, 2*H*hd + 2*Hkv*hd]
    gdn = torch.cat([ckpt[f"{lin}.in_proj_{n}.weight"].t() for n in ("qkv", "z", "b", "a")], 1)
    assert torch.equal(graph(f"{lin}.in_proj_qkvzba.weight.transpose"), bf16(gdn))
    assert torch.equal(graph(f"{attn}.q_norm.weight.offset"),
                       bf16(1.0 + ckpt[f"{attn}.q_norm.weight"]))
    assert torch.equal(graph(f"{lin}.norm.weight"), bf16(ckpt[f"{lin}.norm.weight"]))
    assert torch.equal(graph(f"{lin}.conv1d.weight"), bf16(ckpt[f"{lin}.conv1d.weight"]))
    assert torch.equal(graph("lm_head.weight.transpose"), bf16(ckpt["lm_head.weight"].t()))


def test_cli_export_and_verify(qwen27b_config_dir: Callable[..., Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pkg"
    rc = cli_main(["export", str(qwen27b_config_dir(4)), str(out), "--ep", "cuda", "--dtype",
                   "fp16", "--block-size", "128", "--gpu-utilization", "0.8",
                   "--max-batch-size", "32", "--max-scheduled-tokens", "4096",
                   "--prefill-chunk-size", "512", "--prune-logits", "--no-weights"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "PagedAttention x16" in printed and "GatedDeltaNet x48" in printed
    genai = json.loads((out / c.GENAI_CONFIG_FILE).read_text())
    assert genai["engine"]["dynamic_batching"] == {
        "block_size": 128, "max_batch_size": 32, "gpu_utilization_factor": 0.8,
        "max_scheduled_tokens": 4096}
    assert genai["search"]["chunk_size"] == 512
    assert genai["model"]["decoder"]["session_options"]["provider_options"] == [
        {"cuda": {"enable_cuda_graph": "0"}}]
    model = ir.load(out / c.MODEL_FILE)
    _, outputs = _io(model)
    assert outputs[c.LOGITS].shape[0] == c.DIM_BATCH
    assert cli_main(["verify", str(out)]) == 0
    assert "0 failed" in capsys.readouterr().out
