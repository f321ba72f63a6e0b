"""The built-in default model (written once, loaded like any checkpoint) and the tokenizers."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen3_5ForCausalLM

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35 import (
    ByteTokenizer,
    PackedBatch,
    PagedHybridCache,
    TokenizersTokenizer,
    default_model_dir,
    load,
    load_tokenizer,
)


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDHYBRID_CACHE", str(tmp_path))
    return tmp_path


def test_written_once_in_hf_format_and_loaded(cache_root):
    path = default_model_dir()
    assert path == cache_root / "default-model-v1"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in cache_root.iterdir()] == ["default-model-v1"]  # no temp left
    model = load(path)
    cfg = model.config
    assert len(cfg.full_attention_layers) >= 2 and len(cfg.linear_attention_layers) >= 4
    assert cfg.vocab_size == 258 and (cfg.bos_token_id, cfg.eos_token_id) == (256, (257,))
    # every parameter randomised: nothing left at HF's structured initial values
    for name, p in model.named_parameters():
        assert p.float().std() > 0.01, name
        assert not torch.all(p == 1.0) and not torch.all(p == 0.0), name
    # HF transformers reads the same folder and agrees
    hf = Qwen3_5ForCausalLM.from_pretrained(str(path)).float().eval()
    ids = torch.tensor([[256, 72, 105, 33, 10, 200, 3]])
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
    assert (model.forward_dense(ids)[0] - ref).abs().max() <= 1e-4
    cache = PagedHybridCache.allocate(cfg, num_pages=2, block_size=16, num_slots=1)
    packed = model.forward_packed(PackedBatch.from_sequences([ids[0].tolist()], [0], [[1]], [0]),
                                  cache)
    assert (packed - ref[0]).abs().max() <= 1e-4


def test_parallel_first_use_is_atomic_and_deterministic(cache_root, tmp_path_factory,
                                                       monkeypatch):
    with ThreadPoolExecutor(4) as pool:  # racing writers: every one gets the complete folder
        outs = list(pool.map(lambda _: default_model_dir(), range(4)))
    assert outs == [cache_root / "default-model-v1"] * 4
    assert [p.name for p in cache_root.iterdir()] == ["default-model-v1"]
    load(outs[0])
    other = tmp_path_factory.mktemp("other-cache")
    monkeypatch.setenv("PAGEDHYBRID_CACHE", str(other))
    again = default_model_dir()
    assert again.parent == other
    assert (again / "model.safetensors").read_bytes() == \
        (cache_root / "default-model-v1" / "model.safetensors").read_bytes()


def test_byte_tokenizer(cache_root):
    tok = load_tokenizer(default_model_dir())
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258
    text = "héllo, 世界!"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode([*ids, 257]) == text
    assert tok.decode([256, 104, 257], skip_special_tokens=False) == "<bos>h<eos>"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a partial character


def test_tokenizer_json_is_used_through_tokenizers(tmp_path):
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}
    hf_tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf_tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": {"bos_token_id": 1, "eos_token_id": 2}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TokenizersTokenizer)
    assert tok.encode("hello world !") == [3, 4, 5]
    assert tok.encode("hello", add_bos=True) == [1, 3]
    assert tok.decode([3, 4]) == hf_tok.decode([3, 4])
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2, 5), 6)


def test_no_tokenizer_is_a_typed_error(tmp_path):
    with pytest.raises(UnsupportedConfiguration, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
