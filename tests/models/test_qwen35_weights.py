"""Loading HF safetensors checkpoints: layouts, dtypes, memory mapping, typed failures."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import pytest
import torch
from qwen35_tiny import build_hf_model, hf_logits, save_checkpoint, tiny_hf_config
from safetensors.torch import save_file
from transformers import Qwen3_5Config

from pagedhybrid.engine.core.memory import weight_bytes
from pagedhybrid.errors import ContractViolation
from pagedhybrid.models.qwen35 import CheckpointError, load
from pagedhybrid.models.qwen35.weights import (
    HUGE_PAGE,
    HugePageArena,
    SafetensorsFile,
    is_mapped,
    release_pages,
    smaps_field,
    thp_mode,
)

IDS = torch.tensor([[5, 17, 3, 90, 41, 8, 0, 66]])


def _state(hf) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}


def _write(path: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return path


def test_every_tensor_is_loaded_by_hf_name(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    ours = model.state_dict()
    theirs = tiny_checkpoint.hf.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_weights_are_memory_mapped_views(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    size = (tiny_checkpoint.path / "model.safetensors").stat().st_size
    for name, p in model.named_parameters():
        # a view into the one mapping of the whole file: no second copy of the weights
        assert p.untyped_storage().nbytes() == size, name


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile"))


def test_release_pages_drops_a_mapped_tensors_pages_and_nothing_else(tmp_path):
    """A replaced (packed) weight's mapped pages leave the process's resident set; reading the
    view again gives the same values (the pages come back from the file); a tensor that is not
    a view of a checkpoint mapping is untouched."""
    gen = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(4096, 512, generator=gen), "b": torch.randn(7, 5, generator=gen)}
    save_file(state, str(tmp_path / "w.safetensors"))
    f = SafetensorsFile(tmp_path / "w.safetensors")
    a, b = f.tensor("a"), f.tensor("b")
    assert float(a.sum()) == float(state["a"].sum())  # every page of `a` read in
    before = _rss_file()
    release_pages(a)
    dropped = before - _rss_file()
    assert dropped >= a.numel() * 4 - 2 * 4096 - (1 << 20), dropped  # its pages, less the ends
    assert torch.equal(a, state["a"]) and torch.equal(b, state["b"])
    own = state["b"].clone()
    release_pages(own)
    release_pages(state["a"][:, ::2])  # a strided view: not its pages alone, nothing released
    assert torch.equal(own, state["b"])


def test_smaps_field_and_thp_mode(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text("1000-3000 rw-p 00000000 00:00 0\nAnonHugePages:      4096 kB\n"
                     "VmFlags: rd wr hg\n7000-8000 r--p 00000000 00:00 0\nAnonHugePages:  0 kB\n")
    assert smaps_field(0x2000, "AnonHugePages", smaps) == "4096 kB"
    assert smaps_field(0x1000, "VmFlags", smaps) == "rd wr hg"
    assert smaps_field(0x7500, "AnonHugePages", smaps) == "0 kB"
    assert smaps_field(0x7500, "VmFlags", smaps) is None  # (no such field there)
    assert smaps_field(0x5000, "VmFlags", smaps) is None  # (no mapping there)
    assert smaps_field(0x2000, "VmFlags", tmp_path / "absent") is None
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert thp_mode(enabled) == "madvise" and thp_mode(tmp_path / "absent") == "unknown"


def test_huge_page_arena_holds_exact_copies():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(257, 33, generator=gen).to(torch.bfloat16),
             torch.randint(0, 255, (64, 3, 16), dtype=torch.uint8, generator=gen),
             torch.randn(5, generator=gen).half(), torch.randn(3, 1000, generator=gen)]
    arena = HugePageArena(sum(HugePageArena.room(t.numel() * t.element_size()) for t in parts))
    held = [arena.hold(t) for t in parts]
    for t, h in zip(parts, held, strict=True):
        assert torch.equal(t, h) and h.dtype == t.dtype and h.data_ptr() != t.data_ptr()
        assert h.data_ptr() % 64 == 0 and not is_mapped(h)
    assert held[0].data_ptr() % HUGE_PAGE == 0
    assert HugePageArena.room(1) == 64 and HugePageArena.room(128) == 128
    with pytest.raises(ContractViolation, match="'size' must hold 10 more bytes"):
        arena.hold(torch.zeros(10, dtype=torch.uint8))  # exactly sized: full
    if hasattr(mmap, "MADV_HUGEPAGE"):  # the mapping carries the advice ("hg")
        assert "hg" in (smaps_field(held[0].data_ptr(), "VmFlags") or "").split()
        huge = arena.huge_bytes()
        assert huge is not None and 0 <= huge <= HUGE_PAGE * (1 + arena.held // HUGE_PAGE)
        if thp_mode() == "never":
            assert huge == 0
    assert arena.held == sum(HugePageArena.room(t.numel() * t.element_size()) for t in parts)
    del arena
    assert torch.equal(held[3] * 2, parts[3] * 2)  # the views keep the mapping


@pytest.mark.parametrize("tied", [False, True])
def test_hold_projections_copies_them_out_of_the_mapping(tmp_path, tied):
    hf = build_hf_model(tiny_hf_config(tie_word_embeddings=tied), seed=3)
    model = load(save_checkpoint(hf, tmp_path / "m"))
    proj = model.model.layers[0].mlp.down_proj.weight
    assert is_mapped(proj) and is_mapped(model.lm_head.weight)
    before, mapped = model.forward_dense(IDS)[0], weight_bytes(model, mapped_only=True)
    assert mapped == weight_bytes(model)
    model.hold_projections()
    assert model.model.layers[0].mlp.down_proj.weight is proj and not is_mapped(proj)
    assert not is_mapped(model.lm_head.weight)
    assert is_mapped(model.model.embed_tokens.weight) != tied  # a tied head's table moved once
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.equal(model.forward_dense(IDS)[0], before)
    # the memory plan no longer counts them as still to be paged in
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "norm" in n)
    assert weight_bytes(model, mapped_only=True) < mapped - 20 * norms
    assert weight_bytes(model) == mapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(tiny_checkpoint, dtype):
    model = load(tiny_checkpoint.path, dtype=dtype)
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj_qkv.weight.dtype == dtype
    assert layer.linear_attn.A_log.dtype == torch.float32
    assert layer.linear_attn.dt_bias.dtype == torch.float32
    assert model.lm_head.weight.dtype == dtype


def test_bf16_checkpoint_loads_without_copy(tmp_path, tiny_checkpoint):
    hf16 = build_hf_model(tiny_hf_config(), seed=1).to(torch.bfloat16)
    path = save_checkpoint(hf16, tmp_path / "bf16")
    model = load(path, dtype=torch.bfloat16)
    size = (path / "model.safetensors").stat().st_size
    w = model.model.layers[2].self_attn.q_proj.weight
    assert w.dtype == torch.bfloat16 and w.untyped_storage().nbytes() == size
    ref = hf_logits(tiny_checkpoint.hf, IDS)
    assert (load(path).forward_dense(IDS)[0] - ref).abs().max() < 0.5  # bf16 weights, fp32 math


def test_sharded_checkpoint(tmp_path, tiny_checkpoint):
    path = save_checkpoint(tiny_checkpoint.hf, tmp_path / "sharded", max_shard_size="60KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
    model = load(path)
    err = (model.forward_dense(IDS)[0] - hf_logits(tiny_checkpoint.hf, IDS)).abs().max()
    assert err <= 1e-4


def test_tied_embeddings(tmp_path):
    hf = build_hf_model(tiny_hf_config(tie_word_embeddings=True), seed=3)
    path = save_checkpoint(hf, tmp_path / "tied")
    model = load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.forward_dense(IDS)[0] - hf_logits(hf, IDS)).abs().max() <= 1e-4


def test_vl_checkpoint_prefix_vision_and_mtp_skipped(tmp_path, tiny_checkpoint):
    hf = tiny_checkpoint.hf
    state = {}
    for name, t in _state(hf).items():
        state[name.replace("model.", "model.language_model.", 1)
              if name.startswith("model.") else name] = t
    state["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(12, 4)
    state["mtp.fc.weight"] = torch.randn(7, 3)
    state["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(2, 2)
    config = Qwen3_5Config(text_config=hf.config.to_dict()).to_dict()
    path = _write(tmp_path / "vl", state, config)
    model = load(path)
    assert model.config.source_model_type == "qwen3_5"
    assert (model.forward_dense(IDS)[0] - hf_logits(hf, IDS)).abs().max() <= 1e-4


def _broken(tmp_path, tiny_checkpoint, edit) -> Path:
    state = _state(tiny_checkpoint.hf)
    edit(state)
    return _write(tmp_path / "broken", state, tiny_checkpoint.hf.config.to_dict())


def test_missing_tensor_is_named(tmp_path, tiny_checkpoint):
    name = "model.layers.1.linear_attn.A_log"
    path = _broken(tmp_path, tiny_checkpoint, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match="is missing") as info:
        load(path)
    assert info.value.what == name


def test_missing_untied_lm_head_is_named(tmp_path, tiny_checkpoint):
    path = _broken(tmp_path, tiny_checkpoint, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert info.value.what == "lm_head.weight"


def test_wrong_shape_is_named(tmp_path, tiny_checkpoint):
    name = "model.layers.2.self_attn.q_proj.weight"
    path = _broken(tmp_path, tiny_checkpoint,
                   lambda s: s.__setitem__(name, torch.zeros(128, 64)))  # gate half missing
    with pytest.raises(CheckpointError, match=r"must have shape \[256, 64\]") as info:
        load(path)
    assert info.value.what == name and info.value.got == [128, 64]


def test_unknown_and_integer_tensors_are_rejected(tmp_path, tiny_checkpoint):
    path = _broken(tmp_path, tiny_checkpoint,
                   lambda s: s.__setitem__("model.layers.0.mlp.experts.0.weight",
                                           torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"not a tensor of a dense Qwen3\.5"):
        load(path)
    name = "model.norm.weight"
    path = _broken(tmp_path / "int", tiny_checkpoint,
                   lambda s: s.__setitem__(name, torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="floating-point") as info:
        load(path)
    assert info.value.what == name


def test_broken_files_are_typed(tmp_path, tiny_checkpoint):
    path = save_checkpoint(tiny_checkpoint.hf, tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="outside the file"):
        load(path)
    (path / "model.safetensors").write_bytes(b"\x04")
    with pytest.raises(CheckpointError, match="shorter than 8 bytes"):
        load(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(tiny_checkpoint.hf.config.to_dict()))
    with pytest.raises(CheckpointError, match="no safetensors"):
        load(empty)
    sharded = save_checkpoint(tiny_checkpoint.hf, tmp_path / "sharded", max_shard_size="60KB")
    sorted(sharded.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(CheckpointError, match="which is missing"):
        load(sharded)
