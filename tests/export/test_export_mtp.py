"""``--mtp``: the checkpoint's MTP head exported as its own graph ``mtp.onnx`` (onnxruntime-genai
0.18.0's ``model.mtp`` layout), the main graph's ``hidden_states`` output, ``pagedhybrid verify``
on both, and in ONNX Runtime (PagedAttention on the WebGPU plugin) the head graph's logits and
hidden equal the engine's own ``MtpHead`` over the same rows -- its catch-up over a prompt and a
chain step fed back with its own hidden -- within float16.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import NUM_BLOCKS, TINY_OPTIONS, tiny_config, write_tiny

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.package import export_package
from pagedhybrid.export.session import PackedGraphSession
from pagedhybrid.export.verify import verify_package
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35.model import load
from pagedhybrid.models.qwen35.packed import PackedBatch, PagedHybridCache

TOL = 2.5e-2


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny-mtp"), tiny_config(mtp_num_hidden_layers=1))


@pytest.fixture(scope="module")
def mtp_package(mtp_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-package-mtp")
    export_package(mtp_checkpoint, out, dataclasses.replace(TINY_OPTIONS, mtp=True,
                                                            state_update_capacity=4))
    return out


def test_the_package_holds_the_head_graph(mtp_package: Path) -> None:
    report = verify_package(mtp_package)
    assert report.ok, report.format()
    checks = {f.check for f in report.findings}
    assert {"mtp main output", "genai mtp", "mtp graph inputs", "mtp graph outputs",
            "mtp graph nodes", "mtp graph weights"} <= checks
    assert (mtp_package / c.MTP_FILE).is_file() and (mtp_package / c.MTP_WEIGHTS_FILE).is_file()
    model = json.loads((mtp_package / c.GENAI_CONFIG_FILE).read_text())["model"]
    assert model["decoder"]["outputs"]["hidden_states"] == "hidden_states"
    mtp = model["mtp"]
    assert (mtp["enabled"], mtp["filename"], mtp["num_hidden_layers"]) == (True, "mtp.onnx", 1)
    assert mtp["main_hidden_states"] == "hidden_states"
    assert mtp["inputs"]["hidden_states"] == "hidden_states"
    spec = json.loads((mtp_package / c.GENAI_CONFIG_FILE).read_text())["speculative"]
    assert spec == {"max_draft_tokens": 3}
    assert mtp["outputs"] == {"logits": "logits", "hidden_states": "hidden_states_out",
                              "present_key_names": "present.%d.key",
                              "present_value_names": "present.%d.value"}


@pytest.mark.parametrize("damage", ["no head graph", "section", "hidden output name",
                                    "draft count"])
def test_verify_catches_a_broken_head(mtp_package: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(mtp_package, bad)
    cfg = json.loads((bad / c.GENAI_CONFIG_FILE).read_text())
    if damage == "no head graph":
        (bad / c.MTP_FILE).unlink()
    elif damage == "section":
        cfg["model"]["mtp"]["head_size"] += 1
    elif damage == "draft count":
        cfg["speculative"]["max_draft_tokens"] = 4
    else:
        cfg["model"]["decoder"]["outputs"]["hidden_states"] = "hidden"
    (bad / c.GENAI_CONFIG_FILE).write_text(json.dumps(cfg))
    report = verify_package(bad)
    assert not report.ok
    assert any(f.check in ("files", "genai mtp") for f in report.failures), report.format()


def test_mtp_without_a_head_or_capture_is_refused(tiny_checkpoint: Path, mtp_checkpoint: Path,
                                                  tmp_path: Path) -> None:
    with pytest.raises(UnsupportedConfiguration, match="--mtp: the checkpoint has "
                       "mtp_num_hidden_layers=0"):
        export_package(tiny_checkpoint, tmp_path / "x", dataclasses.replace(
            TINY_OPTIONS, mtp=True, state_update_capacity=4))
    with pytest.raises(UnsupportedConfiguration, match="--state-update-capacity K >= 2"):
        export_package(mtp_checkpoint, tmp_path / "y", dataclasses.replace(TINY_OPTIONS,
                                                                           mtp=True))


def test_onnxruntime_genai_reads_the_head_and_refuses_replay_on_webgpu(
        mtp_package: Path) -> None:
    """The real onnxruntime-genai 0.18.0 parses the package's ``model.mtp`` and
    ``speculative`` sections and builds the model with both graphs; its Engine then refuses the
    compact state replay that verifying drafts needs on the WebGPU EP (the only EP that runs
    PagedAttention on a machine without CUDA), by name."""
    import onnxruntime_genai as og
    from genai_runner import register_webgpu

    register_webgpu()
    model = og.Model(og.Config(str(mtp_package)))
    with pytest.raises(RuntimeError, match="Compact fixed state replay currently supports only "
                       "CPU and CUDA devices"):
        og.Engine(model)


def test_the_head_graph_computes_the_engines_head(mtp_checkpoint: Path,
                                                   mtp_package: Path) -> None:
    """Main graph over a prompt -> hidden_states; head graph over the prompt's rows (each with
    the token after it) -> logits and hidden_states_out; then one chain step at the next
    position fed back with the head's own last hidden: each against the engine's head on the
    same rows (fp32 model, its own cache)."""
    model = load(mtp_checkpoint, torch.float32, mtp=True)
    cfg = model.config
    main = PackedGraphSession(mtp_package, NUM_BLOCKS)
    head = PackedGraphSession(mtp_package, NUM_BLOCKS, graph=c.MTP_FILE)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, 12).tolist()  # 11 computed + the token after the last
    n = 11
    table = [[0, 1]]
    lin = cfg.linear_attention_layers
    conv = {i: np.zeros((1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), np.float16)
            for i in lin}
    rec = {i: np.zeros((1, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                        cfg.linear_key_head_dim), np.float32) for i in lin}

    def feeds(ids: list[int], past: int) -> dict[str, np.ndarray]:
        b = PackedBatch.from_sequences([ids], [past], table, [0])
        return {"input_ids": b.input_ids.numpy(), "position_ids": b.position_ids.numpy(),
                "cu_seqlens": b.cu_seqlens.numpy(), "past_seqlens": b.past_seqlens.numpy(),
                "block_table": b.block_table.numpy(),
                "attention_metadata": b.attention_metadata.numpy()}

    out = main.step(**feeds(tokens[:n], 0), conv=conv, recurrent=rec)
    assert out.hidden is not None and out.hidden.shape == (n, cfg.hidden_size)
    cache = PagedHybridCache.allocate(cfg, num_pages=NUM_BLOCKS, block_size=16, num_slots=1,
                                      mtp=True)
    hidden: list[torch.Tensor] = []
    model.forward_packed(PackedBatch.from_sequences([tokens[:n]], [0], table, [0]), cache,
                         hidden=hidden)
    np.testing.assert_allclose(out.hidden.astype(np.float32), hidden[0].numpy(), atol=TOL)
    got = head.step(**feeds(tokens[1:n + 1], 0), conv={}, recurrent={},
                    hidden_states=out.hidden)
    meta = StepMetadata.build([n], [0], table, [0], block_size=16, num_pages=NUM_BLOCKS,
                              num_slots=1)
    logits, mine = model.forward_mtp(torch.tensor(tokens[1:n + 1]), hidden[0], meta, cache)
    assert got.hidden is not None
    np.testing.assert_allclose(got.logits, logits.numpy(), atol=TOL)
    np.testing.assert_allclose(got.hidden.astype(np.float32), mine.numpy(), atol=TOL)
    draft = int(logits[-1].argmax())
    assert int(got.logits[-1].argmax()) == draft
    nxt = head.step(**feeds([draft], n), conv={}, recurrent={},
                    hidden_states=got.hidden[-1:])
    meta = StepMetadata.build([1], [n], table, [0], block_size=16, num_pages=NUM_BLOCKS,
                              num_slots=1)
    logits2, _ = model.forward_mtp(torch.tensor([draft]), mine[-1:], meta, cache)
    np.testing.assert_allclose(nxt.logits, logits2.numpy(), atol=TOL)
