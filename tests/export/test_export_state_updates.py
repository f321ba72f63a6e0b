"""``--state-update-capacity K``: the exported graph returns each linear layer's compact state
updates (ONNX Runtime 1.32's conv values and GatedDeltaNet capsules) with the bindings
onnxruntime-genai 0.18.0 reads, ``pagedhybrid verify`` checks them, and in ONNX Runtime
(PagedAttention on the WebGPU plugin, the linear ops on the CPU EP) the capsules of a verify step
replay (ORT's own rule, ``ops.*.replay_state``) into the states of the capturing call bit for bit
and, for every accepted prefix, into the states the graph leaves after that prefix alone (within
float16: a shorter call rounds its matmuls differently) -- and they carry what the engine's own
capsules carry for the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import BLOCK_SIZE, NUM_BLOCKS, TINY_OPTIONS

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.package import export_package
from pagedhybrid.export.session import PackedGraphSession
from pagedhybrid.export.verify import verify_package
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35.model import load
from pagedhybrid.models.qwen35.packed import PackedBatch, PagedHybridCache
from pagedhybrid.ops.gated_delta_net import replay_state as gdn_replay
from pagedhybrid.ops.varlen_causal_conv import replay_state as conv_replay

CAP = 4


@pytest.fixture(scope="module")
def capture_package(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-package-capture")
    export_package(tiny_checkpoint, out,
                   dataclasses.replace(TINY_OPTIONS, state_update_capacity=CAP))
    return out


def test_the_package_declares_its_state_updates(capture_package: Path) -> None:
    report = verify_package(capture_package)
    assert report.ok, report.format()
    assert any(f.check == "state_update outputs" for f in report.findings)
    dec = json.loads((capture_package / c.GENAI_CONFIG_FILE).read_text())["model"]["decoder"]
    assert dec["state_update_capacity"] == CAP
    assert dec["inputs"]["state_update_capture_count"] == "state_update_capture_count"
    assert dec["inputs"]["state_update_active"] == "state_update_active"
    assert dec["outputs"]["state_update_conv_value_names"] == "state_update.%d.conv_value"
    assert dec["outputs"]["state_update_recurrent_capsule_names"] == \
        "state_update.%d.recurrent_capsule"
    groups = {g["kind"]: g for g in dec["state_groups"]}
    assert groups["fixed_conv"]["state_update"] == {"capacity": CAP}
    assert groups["fixed_recurrent"]["state_update"]["capacity"] == CAP
    assert groups["fixed_recurrent"]["state_update"]["key_head_count"] > 0


def test_verify_catches_a_wrong_capacity(capture_package: Path, tmp_path: Path) -> None:
    """The genai_config's capacity edited away from the graph's: verify fails on it."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(capture_package, bad)
    cfg = json.loads((bad / c.GENAI_CONFIG_FILE).read_text())
    cfg["model"]["decoder"]["state_update_capacity"] = CAP + 1
    (bad / c.GENAI_CONFIG_FILE).write_text(json.dumps(cfg))
    report = verify_package(bad)
    assert not report.ok
    assert any(f.check == "genai state_update" for f in report.failures), report.format()


def test_capacity_out_of_range_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedConfiguration, match="--state-update-capacity 9"):
        export_package(tiny_checkpoint, tmp_path / "x",
                       dataclasses.replace(TINY_OPTIONS, state_update_capacity=9))


def test_capsules_replay_to_the_prefix_states_in_onnxruntime(tiny_checkpoint: Path,
                                                             capture_package: Path) -> None:
    cfg = load(tiny_checkpoint, torch.float32).config
    graph = PackedGraphSession(capture_package, NUM_BLOCKS)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, 11).tolist()
    chunk = rng.integers(0, 256, CAP).tolist()  # a verify step: the last token and 3 drafts
    pages = np.array([[0, 1]], np.int32)
    lin = cfg.linear_attention_layers
    conv0 = {i: np.zeros((1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), np.float16)
             for i in lin}
    rec0 = {i: np.zeros((1, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                         cfg.linear_key_head_dim), np.float32) for i in lin}

    def run(tokens: list[int], past: int, conv: dict, rec: dict,
            count: int | None = None):
        b = PackedBatch.from_sequences([tokens], [past], pages.tolist(), [0])
        feeds = {"input_ids": b.input_ids.numpy(), "position_ids": b.position_ids.numpy(),
                 "cu_seqlens": b.cu_seqlens.numpy(), "past_seqlens": b.past_seqlens.numpy(),
                 "block_table": b.block_table.numpy(),
                 "attention_metadata": b.attention_metadata.numpy()}
        return graph.step(**feeds, conv=conv, recurrent=rec,
                          capture_count=None if count is None else np.array([count]))

    pre = run(prompt, 0, conv0, rec0)
    assert pre.updates and all(not u.any() for u in pre.updates.values())  # capture off: zeros
    start_conv = {i: a.copy() for i, a in pre.conv.items()}
    start_rec = {i: a.copy() for i, a in pre.recurrent.items()}
    out = run(chunk, len(prompt), {i: a.copy() for i, a in start_conv.items()},
              {i: a.copy() for i, a in start_rec.items()}, CAP)
    assert out.updates is not None
    for n in range(1, CAP + 1):  # every accepted prefix, against the graph on that prefix alone
        alone = run(chunk[:n], len(prompt), {i: a.copy() for i, a in start_conv.items()},
                    {i: a.copy() for i, a in start_rec.items()})
        for i in lin:
            conv = conv_replay(torch.from_numpy(start_conv[i]),
                               torch.from_numpy(out.updates[c.STATE_UPDATE_CONV % i]), [n])
            rec = gdn_replay(torch.from_numpy(start_rec[i]),
                             torch.from_numpy(out.updates[c.STATE_UPDATE_RECURRENT % i]), [n],
                             num_heads_k=cfg.linear_num_key_heads, capacity=CAP)
            if n == CAP:  # the whole chunk: the capturing call's own states, bit for bit
                assert np.array_equal(conv.numpy(), out.conv[i]), i
                assert np.array_equal(rec.numpy(), out.recurrent[i]), i
            # a shorter call feeds the ops other float16 rows (its matmuls and the WebGPU
            # attention round per call shape), so the prefix-only run agrees within float16
            np.testing.assert_allclose(conv.numpy().astype(np.float32),
                                       alone.conv[i].astype(np.float32), atol=5e-3)
            np.testing.assert_allclose(rec.numpy(), alone.recurrent[i], atol=5e-3)

    # the engine's capsule for the same tokens carries the same values (float16 graph vs the
    # float32 model: within the export's state tolerance)
    model = load(tiny_checkpoint, torch.float32, backend=backend("native"))
    cache = PagedHybridCache.allocate(cfg, num_pages=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                      num_slots=1, capsule_capacity=CAP)
    model.forward_packed(PackedBatch.from_sequences([prompt], [0], pages.tolist(), [0]), cache)
    meta = StepMetadata.build([CAP], [len(prompt)], pages.tolist(), [0], block_size=BLOCK_SIZE,
                              num_pages=NUM_BLOCKS, num_slots=1, verify=(0,))
    model.forward_packed(PackedBatch.from_metadata(meta, chunk, "cpu"), cache, None, meta)
    hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i in lin:
        caps = cache.capsules[i]
        row = out.updates[c.STATE_UPDATE_RECURRENT % i][0]
        decay = row[:CAP * hv].reshape(CAP, hv)
        key = row[CAP * hv:CAP * (hv + hk * dk)].reshape(CAP, hk, dk)
        delta = row[CAP * (hv + hk * dk):].reshape(CAP, hv, dv)
        np.testing.assert_allclose(caps.decay[0].numpy(), decay, atol=2.5e-2)
        np.testing.assert_allclose(caps.key[0].numpy(), key, atol=2.5e-2)
        np.testing.assert_allclose(caps.delta[0].numpy(), delta, atol=2.5e-2)
        np.testing.assert_allclose(caps.conv[0].numpy(),
                                   out.updates[c.STATE_UPDATE_CONV % i][0].astype(np.float32),
                                   atol=2.5e-2)


def test_onnxruntime_genai_refuses_compact_replay_on_webgpu(tmp_path: Path) -> None:
    """The real onnxruntime-genai 0.18.0 Engine reads the bindings and refuses, by name, to
    replay compact fixed states on the WebGPU EP (the only EP that runs this package's
    PagedAttention on a machine without CUDA): the exact refusal, pinned here so a genai that
    lifts it fails this test and gets run instead."""
    import onnxruntime_genai as og
    from genai_runner import register_webgpu

    from pagedhybrid.models.qwen35 import default_model_dir

    out = tmp_path / "builtin-capture"
    export_package(default_model_dir(), out, dataclasses.replace(
        TINY_OPTIONS, num_blocks=64, state_update_capacity=CAP))
    register_webgpu()
    with pytest.raises(RuntimeError, match="Compact fixed state replay currently supports only "
                       "CPU and CUDA devices"):
        og.Engine(og.Model(og.Config(str(out))))
