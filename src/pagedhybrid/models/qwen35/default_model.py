"""The built-in default model: a small trained Qwen3.5 hybrid decoder shipped in the package.

``default_model_dir()`` is the folder ``default-model/`` beside this module: an ordinary HF
checkpoint (``config.json`` ``qwen3_5_text``, bf16 ``model.safetensors``, ``tokenizer.json`` +
``tokenizer_config.json`` with a chat template, ``generation_config.json``, a ``README.md``
model card) read by the same loader as any checkpoint, plus ``heldout.txt``, the held-out text
its perplexity is quoted on. It is trained by ``scripts/train_default_model.py`` on the King
James Bible (public domain; see the model card for data, size, training time and perplexities).
"""

from __future__ import annotations

from pathlib import Path

from pagedhybrid.errors import UnsupportedConfiguration

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default-model"
HELDOUT_TEXT = "heldout.txt"


def default_model_dir() -> Path:
    """The built-in model's folder (raises when the package was installed without it)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise UnsupportedConfiguration(
            f"the built-in default model is missing from {DEFAULT_MODEL_DIR}; reinstall "
            "pagedhybrid or pass --model DIR (scripts/train_default_model.py rebuilds it)")
    return DEFAULT_MODEL_DIR


def heldout_text_path() -> Path:
    """The held-out text of the built-in model (the default text of ``pagedhybrid perplexity``)."""
    return default_model_dir() / HELDOUT_TEXT
