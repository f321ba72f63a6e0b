"""Tokenizers for Qwen3.5 checkpoints.

* ``ByteTokenizer`` -- the built-in default model's tokenizer: token ``i < 256`` is the byte
  ``i`` of the UTF-8 text, ``256`` is BOS and ``257`` is EOS (vocabulary 258). Decoding joins the
  bytes and replaces invalid UTF-8 (a partial multi-byte character) with U+FFFD.
* ``TokenizersTokenizer`` -- a checkpoint that ships ``tokenizer.json`` is tokenised by the
  ``tokenizers`` library exactly as HF's fast tokenizer does: ``encode(text)`` adds the special
  tokens of the file's post-processor (e.g. a leading BOS), like ``tokenizer(text)`` and vLLM's
  completions; BOS/EOS ids come from ``config.json`` (``text_config`` for VL checkpoints) and
  ``generation_config.json``; ``apply_chat_template(messages, tools=..., **kwargs)`` renders
  the checkpoint's Jinja chat template -- ``chat_template.jinja`` (transformers 5's file) or else
  the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates
  whose ``default`` is used) -- in the environment HF renders it in: ``trim_blocks`` and
  ``lstrip_blocks``, loop controls, ``tojson`` without ASCII escaping, ``raise_exception`` and
  ``strftime_now``, the special-token strings of ``tokenizer_config.json`` and any template
  keyword such as ``enable_thinking``.

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
                 eos_token_ids: Sequence[int] = (), chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
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
        self.special_tokens = dict(special_tokens or {})  # e.g. {"eos_token": "<|im_end|>"}
        self._template: tuple[str, Any] | None = None  # (source, compiled)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``), as HF's
        ``apply_chat_template(..., tokenize=False)`` renders it; encode it with
        ``add_special_tokens=False`` (the template writes its own special tokens)."""
        if self.chat_template is None:
            raise UnsupportedConfiguration("this checkpoint has no chat template "
                                           "(chat_template.jinja or tokenizer_config.json)")
        if self._template is None or self._template[0] != self.chat_template:  # compiled once
            self._template = (self.chat_template,
                              _jinja_environment().from_string(self.chat_template))
        specials = {f"{name}_token": self.token(token_id) for name, token_id in
                    (("bos", self.bos_token_id),
                     ("eos", self.eos_token_ids[0] if self.eos_token_ids else None))}
        return self._template[1].render(**specials | self.special_tokens | kwargs,
                                     messages=list(messages), tools=tools,
                                     add_generation_prompt=add_generation_prompt)

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


def _jinja_environment() -> Any:
    """The sandboxed Jinja environment chat templates are written for (HF's)."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template``
    (a string, or ``[{"name": ..., "template": ...}]`` whose ``default`` entry is used)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """``{"bos_token": "<|...|>", ...}`` as ``tokenizer_config.json`` names them (a string or
    an added-token object); absent or null entries are left out."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tokenizer_config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


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
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        return TokenizersTokenizer(model_dir / "tokenizer.json", bos[0] if bos else None, eos,
                                   _chat_template(model_dir, tokenizer_config),
                                   _special_tokens(tokenizer_config))
    marker = _read_json(model_dir / BYTE_TOKENIZER_FILE)
    if marker.get("type") == "bytes":
        return ByteTokenizer()
    raise UnsupportedConfiguration(
        f"{model_dir}: no tokenizer.json (and no byte-tokenizer marker); pass token ids "
        "directly or add the checkpoint's tokenizer.json"
    )
