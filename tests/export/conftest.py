"""Fixtures of the export tests: tiny checkpoints, exported packages, 27B-class configs, and the
torch engine's tokens for the Engine scenario (helpers in ``export_helpers.py``).

* ``tiny_checkpoint`` -- ``tiny_config`` with ``tame_weights``, written once per session;
* ``tiny_package`` / ``pruned_package`` -- webgpu fp16 exports of it (block size 16, 32 pages);
* ``engine_package`` / ``engine_pruned_package`` -- the same exports of the trained built-in
  model, which the Engine scenario runs (the pruned one with the default page count);
* ``qwen27b_config_dir(interval)`` -- a folder holding only a 27B-class ``config.json``;
* ``torch_tokens`` -- the pagedhybrid torch engine's greedy tokens for the Engine scenario
  (built-in model, float32).

Environment: the WebGPU plugin hides software adapters unless
``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1``; Mesa's shader cache lives in ``XDG_CACHE_HOME``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from export_helpers import (
    BLOCK_SIZE,
    MAX_NEW,
    NUM_BLOCKS,
    PROMPTS,
    QWEN27B,
    TINY_OPTIONS,
    engine_prompts,
    write_tiny,
)

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.export.package import export_package
from pagedhybrid.models.qwen35 import default_model_dir
from pagedhybrid.models.qwen35.model import load

os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny-qwen35-export"))


@pytest.fixture(scope="session")
def tiny_package(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-package")
    export_package(tiny_checkpoint, out, TINY_OPTIONS)
    return out


@pytest.fixture(scope="session")
def pruned_package(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-package-pruned")
    export_package(tiny_checkpoint, out, dataclasses.replace(TINY_OPTIONS, prune_logits=True))
    return out


@pytest.fixture(scope="session")
def engine_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine-package")
    export_package(default_model_dir(), out, TINY_OPTIONS)
    return out


@pytest.fixture(scope="session")
def engine_pruned_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pruned logits, and no ``num_blocks``: the default page count (``export/pages.py``)."""
    out = tmp_path_factory.mktemp("engine-package-pruned")
    export_package(default_model_dir(), out, dataclasses.replace(TINY_OPTIONS, prune_logits=True,
                                                                 num_blocks=None))
    return out


@pytest.fixture(scope="session")
def qwen27b_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(interval=4, **overrides)`` -> a folder holding only a 27B-class config.json."""

    def make(interval: int = 4, **overrides: object) -> Path:
        tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        path = tmp_path_factory.mktemp(f"qwen27b-i{interval}{tag}")
        data = {**QWEN27B, "full_attention_interval": interval, **overrides}
        (path / "config.json").write_text(json.dumps(data))
        return path

    return make


@pytest.fixture(scope="session")
def torch_tokens() -> list[list[int]]:
    """Greedy tokens of the scenario's requests from the pagedhybrid torch engine (float32)."""
    engine = Engine(load(default_model_dir(), torch.float32),
                    EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=8))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for k, prompt in enumerate(engine_prompts()):
        engine.add_request(str(k), prompt, params)
    done: dict[str, tuple[int, ...]] = {}
    for out in engine.stream():
        if out.finished:
            done[out.request_id] = out.token_ids
    return [list(done[str(k)]) for k in range(len(PROMPTS))]
