"""Synthetic checkpoints for tests and benchmarks: random weights, byte tokenizer.

``random_weights(config, seed)`` draws every parameter of a checkpoint (HF names, float32) with
scales that keep activations O(1); ``write_checkpoint(path, config, weights)`` writes an HF
folder (``config.json``, ``model.safetensors`` and the byte-tokenizer marker) that the ordinary
loader reads. ``tiny_byte_config()`` is the small byte-level shape the tests build on:
hidden 64, 6 layers with ``full_attention_interval`` 3 (layers 2 and 5 full, 4 linear),
4 query / 2 KV heads of dim 32 (partial rotary 0.25 -> rotary_dim 8, mrope_section [2, 1, 1]),
linear heads 2 key / 4 value of dim 16, conv kernel 4, vocabulary 258 (256 bytes + BOS 256 +
EOS 257), tied embeddings. (The built-in default model is a trained checkpoint instead:
``default_model.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_TOKENIZER_FILE


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


def random_weights(config: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint randomised (float32), keyed by HF name."""
    from pagedhybrid.models.qwen35.model import build

    shapes = build(config, torch.float32, "meta").expected_shapes()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        noise = torch.randn(shape, generator=gen)
        if name.endswith("A_log"):
            value = noise * 0.5  # decay rate exp(A_log) around 1
        elif name.endswith("dt_bias"):
            value = noise * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + 0.1 * noise  # raw-weight gated norm
        elif name.endswith("norm.weight"):
            value = 0.1 * noise  # offset norms: (1 + w)
        elif name.endswith("conv1d.weight"):
            value = noise / shape[-1] ** 0.5
        elif name.endswith("embed_tokens.weight"):
            value = noise
        else:
            value = noise / shape[-1] ** 0.5  # [out, in] projections
        out[name] = value.contiguous()
    return out


def write_checkpoint(path: Path, config: Qwen35Config, weights: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / BYTE_TOKENIZER_FILE).write_text(
        json.dumps({"type": "bytes", "bos_token_id": BYTE_BOS, "eos_token_id": BYTE_EOS}) + "\n")
