"""Qwen3.5 hybrid decoder (full attention + Gated DeltaNet): HF checkpoints, dense forward with
HF parity, packed paged forward for serving.

* ``Qwen35Config`` (``config.py``) -- from an HF ``config.json`` (``qwen3_5_text`` / ``qwen3_5``).
* ``load(model_dir, dtype, parallel=None)`` (``model.py``) -- memory-mapped safetensors
  (``weights.py``) into a ``Qwen35ForCausalLM`` with ``forward_dense`` and ``forward_packed``;
  with a ``pagedhybrid.parallel.ParallelConfig`` the model is one tensor-parallel rank, built
  from parallel layers that load only their slice.
* ``PackedBatch``, ``PagedHybridCache`` (``packed.py``) -- one serving step and the cache layout.
* ``default_model_dir()`` (``default_model.py``) -- the trained built-in checkpoint;
  ``load_tokenizer`` (``tokenizer.py``); synthetic random checkpoints for tests and benchmarks
  (``synthetic.py``).
"""

from __future__ import annotations

from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.default_model import default_model_dir
from pagedhybrid.models.qwen35.errors import CheckpointError
from pagedhybrid.models.qwen35.model import DenseCache, Qwen35ForCausalLM, build, load
from pagedhybrid.models.qwen35.packed import ABI_INPUT_NAMES, PackedBatch, PagedHybridCache
from pagedhybrid.models.qwen35.tokenizer import ByteTokenizer, TokenizersTokenizer, load_tokenizer

__all__ = [
    "ABI_INPUT_NAMES",
    "ByteTokenizer",
    "CheckpointError",
    "DenseCache",
    "PackedBatch",
    "PagedHybridCache",
    "Qwen35Config",
    "Qwen35ForCausalLM",
    "TokenizersTokenizer",
    "build",
    "default_model_dir",
    "load",
    "load_tokenizer",
]
