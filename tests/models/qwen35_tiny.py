"""Tiny Qwen3.5 checkpoints built with HF transformers 5.24 (the oracle of the model tests).

``tiny_hf_config(**overrides)`` is the one place tiny test configs are made. ``build_hf_model``
randomises **every** parameter (HF initialises the offset norms to zero, the gated norm to one,
``dt_bias`` to one -- values that would hide a missing ``1 + w``, a raw/offset mix-up or a gate
error). ``save_checkpoint`` writes it with ``save_pretrained`` (config.json + safetensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "full_attention_interval": 3,  # layers 2 and 5 full, 4 linear
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,  # Dk != Dv so a state-layout transpose cannot hide
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,  # rotary_dim 16 -> 8 frequencies
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}


def tiny_hf_config(**overrides: Any) -> Qwen3_5TextConfig:
    kwargs = {**TINY_DEFAULTS, **overrides}
    if "layer_types" in overrides:
        kwargs.pop("full_attention_interval", None)
    return Qwen3_5TextConfig(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter; scales keep activations O(1) and decays away from 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                value = -1.0 + 0.5 * noise
            elif name.endswith("dt_bias"):
                value = 0.5 * noise
            elif name.endswith("linear_attn.norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith("norm.weight"):
                value = 0.2 * noise
            elif name.endswith("conv1d.weight"):
                value = 0.5 * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:
                value = noise / p.shape[-1] ** 0.5
            p.copy_(value.to(p.dtype))


def build_hf_model(config: Qwen3_5TextConfig, seed: int = 0) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    randomize_(model, seed)
    return model


def save_checkpoint(model: Qwen3_5ForCausalLM, path: Path, **kwargs: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), **kwargs)
    return path


def hf_logits(model: Qwen3_5ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a whole prompt batch ``[B, S]`` without a cache."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


class HFSequence:
    """One request run independently through HF with its own cache (the per-sequence oracle)."""

    def __init__(self, model: Qwen3_5ForCausalLM) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.int64)
        pos = torch.arange(self.length, self.length + len(tokens)).view(1, -1)
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True)
        self.length += len(tokens)
        return out.logits[0].float()  # [S, V]

    def keys(self, layer: int) -> torch.Tensor:
        return self.cache.layers[layer].keys[0].transpose(0, 1)  # [L, Hkv, hd]

    def values(self, layer: int) -> torch.Tensor:
        return self.cache.layers[layer].values[0].transpose(0, 1)  # [L, Hkv, hd]

    def conv_state(self, layer: int) -> torch.Tensor:
        return self.cache.get_conv_state(layer)[0, :, 1:]  # HF keeps K columns, we keep K-1

    def recurrent_state(self, layer: int) -> torch.Tensor:
        return self.cache.get_recurrent_state(layer)[0].transpose(-1, -2)  # -> [Hv, Dv, Dk]
