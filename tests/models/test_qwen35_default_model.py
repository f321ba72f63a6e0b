"""The built-in default model (a trained HF checkpoint shipped in the package) and the tokenizers.

HF transformers must read the same folder (``Qwen3_5ForCausalLM`` + ``PreTrainedTokenizerFast``)
and agree with our loader and tokenizer, and so must a loader that takes every top-level
``*.safetensors`` for weights (vLLM's); the model must be trained (its held-out perplexity is
far below that of a uniform guess) and greedy text must be English words, not bytes.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kvquant import KV_DTYPES, QUANTS, default_scales_path
from pagedhybrid.models.qwen35 import (
    ByteTokenizer,
    CheckpointError,
    PackedBatch,
    PagedHybridCache,
    TokenizersTokenizer,
    default_model_dir,
    load,
    load_tokenizer,
)
from pagedhybrid.models.qwen35.default_model import heldout_text_path


@pytest.fixture(scope="module")
def hf_loaded():
    hf, info = Qwen3_5ForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32,
                                                  output_loading_info=True)
    return hf.eval(), info


@pytest.fixture(scope="module")
def hf_pair(hf_loaded):
    return hf_loaded[0], PreTrainedTokenizerFast.from_pretrained(str(default_model_dir()))


def test_hf_loads_every_parameter_from_the_folder(hf_loaded):
    _, info = hf_loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info


def test_folder_loads_as_vllm_globs_it(hf_loaded):
    """vLLM's DefaultModelLoader (``_prepare_weights``) takes every ``*.safetensors`` at the top
    of a local folder (``glob.glob(os.path.join(folder, "*.safetensors"))``, not recursive) as
    weights, keeping only the files of ``model.safetensors.index.json``'s ``weight_map`` when that
    exists; a tensor no parameter takes fails the load. So every tensor those files hold must be
    a parameter of HF's model and together they must give all of them (the tied LM head aside).
    The KV scale files live in ``kv_scales/``, out of that glob, and the engine still finds them."""
    hf, _ = hf_loaded
    path = default_model_dir()
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if os.path.basename(f) in shards]
    assert files
    params = set(hf.state_dict())
    held = []  # (tensor name, file)
    for file in files:
        with safe_open(file, framework="pt") as st:
            held += [(name, os.path.basename(file)) for name in st.keys()]  # noqa: SIM118
    # the MTP head's tensors: HF ignores them (``_keys_to_ignore_on_load_unexpected``) and
    # vLLM's Qwen3_5Model.load_weights skips every ``mtp.`` name; they are exactly the head's
    head = {n for n, _ in held if n.startswith("mtp.")}
    assert head == {n for n in load(path, mtp=True).state_dict() if n.startswith("mtp.")}
    assert hf.config.mtp_num_hidden_layers == 1
    unknown = [(n, f) for n, f in held if n not in params and n not in head]
    assert not unknown, f"tensors that are no parameter of Qwen3_5ForCausalLM: {unknown}"
    names = {n for n, _ in held}
    assert len(names) == len(held), "a tensor in two files"
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert params - tied - names == set()
    for dt in KV_DTYPES.values():
        for q in QUANTS:
            scales = default_scales_path(path, dt, q)
            assert scales.is_file() and scales.parent != path, scales


def test_folder_is_an_hf_checkpoint_both_libraries_read(hf_pair):
    path = default_model_dir()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "heldout.txt"} <= names
    model = load(path)
    cfg = model.config
    assert cfg.full_attention_layers and len(cfg.linear_attention_layers) >= 2 * len(
        cfg.full_attention_layers)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.rotary_dim < cfg.head_dim and cfg.mrope_interleaved  # partial interleaved MRoPE
    hf, hf_tok = hf_pair
    tok = load_tokenizer(path, cfg.vocab_size)
    assert isinstance(tok, TokenizersTokenizer) and tok.vocab_size == cfg.vocab_size
    text = "In the beginning God created the heaven and the earth."
    ids = tok.encode(text)
    assert ids == hf_tok(text).input_ids and ids[0] == cfg.bos_token_id == hf_tok.bos_token_id
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert set(tok.eos_token_ids) == {hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids(
        "<|im_end|>")}
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(input_ids=x, use_cache=False).logits
    assert (model.forward_dense(x)[0] - ref).abs().max() <= 1e-4
    cache = PagedHybridCache.allocate(cfg, num_pages=4, block_size=16, num_slots=1)
    packed = model.forward_packed(PackedBatch.from_sequences([ids], [0], [[2, 0]], [0]), cache)
    assert (packed - ref[0]).abs().max() <= 1e-4


def test_chat_template_renders_as_hf(hf_pair):
    _, hf_tok = hf_pair
    tok = load_tokenizer(default_model_dir())
    messages = [{"role": "system", "content": "Answer in the words of the King James Bible."},
                {"role": "user", "content": "Recite Genesis 1:1."}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf_tok.apply_chat_template(messages, add_generation_prompt=gen,
                                                  tokenize=False)
    assert ours.startswith("<|bos|><|im_start|>system\n")
    ids = hf_tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ids == tok.encode(ours, add_special_tokens=False)


def test_trained_model_writes_english(hf_pair):
    """Greedy continuations are words of the training text's language, and the held-out
    per-token loss is far below a uniform guess over the vocabulary."""
    _, hf_tok = hf_pair
    model = load(default_model_dir())
    ids = hf_tok("And God said unto Moses,").input_ids
    past, out = None, []
    logits, past = model.forward_dense(torch.tensor([ids]))
    for _ in range(24):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits, past = model.forward_dense(torch.tensor([[nxt]]), past)
    text = hf_tok.decode(out, skip_special_tokens=True)
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8 and all(w.isascii() for w in words), text
    held = hf_tok(heldout_text_path().read_text()[:4000]).input_ids[:400]
    with torch.no_grad():
        lp = model.forward_dense(torch.tensor([held]))[0][0, :-1].log_softmax(-1)
    nll = -lp.gather(1, torch.tensor(held[1:])[:, None]).mean().item()
    assert nll < 0.5 * math.log(model.config.vocab_size), nll


def test_tokenizer_that_outgrows_the_embedding_is_rejected(tmp_path):
    vocab = {f"w{i}": i for i in range(10)}
    hf_tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path, 10).vocab_size == 10
    with pytest.raises(CheckpointError, match=r"tokenizer vocabulary.*9 embedding rows"):
        load_tokenizer(tmp_path, 9)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert tok.vocab_size == 258
    text = "héllo, 世界!"
    ids = tok.encode(text, add_special_tokens=True)
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
    assert tok.encode("hello world !") == [3, 4, 5]  # no post-processor: no special tokens
    assert tok.decode([3, 4]) == hf_tok.decode([3, 4])
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2, 5), 6)
    with pytest.raises(UnsupportedConfiguration, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_tokenizer_is_a_typed_error(tmp_path):
    with pytest.raises(UnsupportedConfiguration, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
