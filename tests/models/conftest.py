"""Shared fixtures of the Qwen3.5 model tests: one randomised tiny HF model, saved once."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from qwen35_tiny import build_hf_model, save_checkpoint, tiny_hf_config
from transformers import Qwen3_5ForCausalLM


class TinyCheckpoint(NamedTuple):
    hf: Qwen3_5ForCausalLM
    path: Path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    hf = build_hf_model(tiny_hf_config(), seed=1)
    return TinyCheckpoint(hf, save_checkpoint(hf, tmp_path_factory.mktemp("tiny-qwen35")))
