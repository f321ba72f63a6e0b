"""Tokenizers for Qwen3.5 checkpoints.

* ``ByteTokenizer`` -- the built-in default model's tokenizer: token ``i < 256`` is the byte
  ``i`` of the UTF-8 text, ``256`` is BOS and ``257`` is EOS (vocabulary 258). Decoding joins the
  bytes and replaces invalid UTF-8 (a partial multi-byte character) with U+FFFD.
* ``TokenizersTokenizer`` -- a checkpoint that ships ``tokenizer.json`` is tokenised by the
  ``tokenizers`` library exactly as HF's fast tokenizer does: ``encode(text)`` adds the special
  tokens of the file's post-processor (e.g. a leading BOS), like ``tokenizer(text)`` and vLLM's
  completions; BOS/EOS ids come from ``config.json`` (``text_config`` for VL checkpoints) and
  ``generation_config.json``; ``apply_chat_template(messages)`` renders the Jinja chat template
  of ``tokenizer_config.json`` (as HF does, with ``add_generation_prompt``).

``load_tokenizer(model_dir)`` picks ``tokenizer.json`` when present, else the byte tokenizer when
the folder declares it (``pagedhybrid_tokenizer.json`` with ``{"type": "bytes"}``), else raises
``UnsupportedConfiguration``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35.errors import CheckpointError

BYTE_TOKENIZER_FILE = "pagedhybrid_tokenizer.json"
BYTE_VOCAB = 256
BYTE_BOS = 256
BYTE_EOS = 257


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """256 byte tokens + BOS (256) + EOS (257)."""

    vocab_size = BYTE_VOCAB + 2
    bos_token_id: int | None = BYTE_BOS
    eos_token_ids: tuple[int, ...] = (BYTE_EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < BYTE_VOCAB:
                out.append(i)
            elif not skip_special_tokens:
                out += {BYTE_BOS: b"<bos>", BYTE_EOS: b"<eos>"}.get(i, b"<unk>")
        return out.decode("utf-8", errors="replace")


class TokenizersTokenizer:
    """A ``tokenizer.json`` served through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(str(path), "tokenizer.json", "cannot be read by tokenizers",
                                  exc) from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``)."""
        if self.chat_template is None:
            raise UnsupportedConfiguration("this checkpoint's tokenizer_config.json has no "
                                           "chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id), eos_token=self.token(
                self.eos_token_ids[0] if self.eos_token_ids else None))

    def token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(str(path), path.name, "is not valid JSON", exc) from exc
    return data if isinstance(data, dict) else {}


def _ids(value: object) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def load_tokenizer(model_dir: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """The checkpoint's tokenizer; with ``vocab_size`` (the model's embedding rows) a tokenizer
    that can produce ids the model has no row for is rejected (``CheckpointError``)."""
    model_dir = Path(model_dir)
    tok = _load_tokenizer(model_dir)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise CheckpointError(str(model_dir), "tokenizer vocabulary",
                              f"must fit the model's {vocab_size} embedding rows",
                              tok.vocab_size)
    return tok


def _load_tokenizer(model_dir: Path) -> Tokenizer:
    if (model_dir / "tokenizer.json").is_file():
        config = _read_json(model_dir / "config.json")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        gen = _read_json(model_dir / "generation_config.json")
        bos = _ids(text.get("bos_token_id", config.get("bos_token_id")))
        eos: list[int] = []
        for source in (text.get("eos_token_id"), config.get("eos_token_id"),
                       gen.get("eos_token_id")):
            eos += [i for i in _ids(source) if i not in eos]
        template = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
        return TokenizersTokenizer(model_dir / "tokenizer.json", bos[0] if bos else None, eos,
                                   template if isinstance(template, str) else None)
    marker = _read_json(model_dir / BYTE_TOKENIZER_FILE)
    if marker.get("type") == "bytes":
        return ByteTokenizer()
    raise UnsupportedConfiguration(
        f"{model_dir}: no tokenizer.json (and no byte-tokenizer marker); pass token ids "
        "directly or add the checkpoint's tokenizer.json"
    )
