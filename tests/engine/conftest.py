"""Fixtures of the engine tests: one tiny Qwen3.5 checkpoint shared by our loader and HF.

The checkpoint is written once per session (every parameter randomised, untied LM head so that
greedy outputs vary) and loaded both by ``pagedhybrid.models.qwen35.load`` and by
``transformers.Qwen3_5ForCausalLM`` (fp32, torch fallback kernels), the external oracle.
HF greedy continuations are memoised per prompt so that every test can compare against them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from pagedhybrid.engine import Engine, EngineConfig
from pagedhybrid.models.qwen35 import Qwen35ForCausalLM, load
from pagedhybrid.models.qwen35.synthetic import (
    random_weights,
    tiny_byte_config,
    write_checkpoint,
)

TINY_LAYERS = ("linear_attention", "full_attention")  # one of each keeps the reference ops fast
HF_MAX_NEW = 40


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dataclasses.replace(tiny_byte_config(), num_hidden_layers=len(TINY_LAYERS),
                              layer_types=TINY_LAYERS, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-qwen35")
    write_checkpoint(path, cfg, random_weights(cfg, seed=7))
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> Qwen35ForCausalLM:
    return load(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path) -> torch.nn.Module:
    import transformers  # a real dependency of the test extra: fail loudly when missing

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model: torch.nn.Module) -> Callable[[Sequence[int], int], list[int]]:
    """HF ``generate`` (greedy, fp32, EOS off) of ``max_new`` tokens, memoised per prompt."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: Sequence[int], max_new: int) -> list[int]:
        key = tuple(prompt)
        if key not in memo or len(memo[key]) < max_new:
            n = max(max_new, HF_MAX_NEW)
            ids = torch.tensor([list(prompt)], dtype=torch.int64)
            with torch.no_grad():
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key][:max_new]

    return run


@pytest.fixture
def make_engine(tiny_model: Qwen35ForCausalLM) -> Callable[..., Engine]:
    def make(**kw: object) -> Engine:
        return Engine(tiny_model, EngineConfig(**kw))  # type: ignore[arg-type]

    return make

