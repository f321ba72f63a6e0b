"""Shared helpers of the export tests (fixtures live in ``conftest.py``).

* ``tiny_config`` -- the default model's shape (6 layers, full-attention interval 3) with
  ``Dk = 16 != Dv = 8`` so that a transposed recurrent state cannot hide, untied LM head.
* ``tame_weights`` -- every parameter randomised (``random_weights``), then the layer
  projections scaled by 0.3, the embedding by 0.1 and the LM head by 0.5: activations stay O(1)
  and a float16 graph tracks the float32 model to ~1e-2 on logits, while a 20 % change of one
  attention projection moves logits by > 0.1 (a wrong graph cannot pass the 2.5e-2 tolerance).
* ``QWEN27B`` -- a Qwen3.5-27B-class ``config.json`` (64 layers, hidden 5120, 24/4 heads of 256,
  linear 16/48 heads of 128, conv 4) for ``--no-weights`` exports.
* the Engine scenario shared by the WebGPU and CUDA Engine tests: the trained built-in model
  (a random checkpoint's greedy tokens hinge on near-ties that float16 cannot resolve) and three
  sentence prompts of unequal length.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pagedhybrid.export.options import ExportOptions
from pagedhybrid.models.qwen35.config import QWEN35_27B_TEXT_CONFIG, Qwen35Config
from pagedhybrid.models.qwen35.synthetic import (
    random_weights,
    tiny_byte_config,
    write_checkpoint,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 32
TINY_OPTIONS = ExportOptions(ep="webgpu", dtype="fp16", block_size=BLOCK_SIZE,
                             num_blocks=NUM_BLOCKS, max_batch_size=8)


def tiny_config(**overrides: object) -> Qwen35Config:
    base = dataclasses.replace(tiny_byte_config(), linear_value_head_dim=8,
                               tie_word_embeddings=False)
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def tame_weights(config: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    weights = random_weights(config, seed)
    for name, t in weights.items():
        if name == "model.embed_tokens.weight":
            weights[name] = t * 0.1
        elif name == "lm_head.weight":
            weights[name] = t * 0.5
        elif name.endswith(("proj.weight", "proj_qkv.weight", "proj_z.weight",
                            "proj_a.weight", "proj_b.weight")):
            weights[name] = t * 0.3
    return weights


def write_tiny(path: Path, config: Qwen35Config | None = None, seed: int = 11) -> Path:
    config = config or tiny_config()
    write_checkpoint(path, config, tame_weights(config, seed))
    return path


QWEN27B = QWEN35_27B_TEXT_CONFIG

# -- the Engine scenario (shared by the WebGPU and CUDA Engine tests) ---------------------------
MAX_NEW = 14
PROMPTS = ("And it came to pass after these things, that the king of Egypt spake unto his "
           "servants,", "Blessed are they", "The LORD is my shepherd; I shall not")
ADMIT_AFTER = (0, 0, 3)  # the third request arrives after 3 steps, while the others decode


def engine_prompts() -> list[list[int]]:
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    return [tok.encode(p) for p in PROMPTS]
