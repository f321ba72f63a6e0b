"""Incremental detokenisation: the text of a growing token sequence at O(new tokens) per step.

``IncrementalDetokenizer.add(ids)`` decodes only a short window: the tokens since the last
emitted boundary (``prefix``) through the newest. The text between ``prefix`` and ``read``
(already emitted) is decoded again only to find where the new text starts, so a token whose
bytes complete a multi-byte character emitted nothing earlier and the whole character now.
While the window's decode ends in U+FFFD (an incomplete UTF-8 character) nothing new is
emitted; ``finish()`` flushes whatever is left, so the final ``text`` equals
``tokenizer.decode(all ids)`` for byte-level tokenizers (the built-in BPE, the byte tokenizer).
The engine keeps one per request and reports ``text``; the server reads it (no second
detokeniser).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # window start: tokens before it are settled
        self.read = 0  # tokens whose text is in ``text``

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens)) if ids else ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they completed (may be empty)."""
        self.ids.extend(int(t) for t in new_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) <= len(before) or window.endswith(REPLACEMENT):
            return ""
        delta = window[len(before):]
        self.text += delta
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def finish(self) -> str:
        """The sequence is complete: emit the rest, incomplete characters included."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        delta = self._decode(self.ids[self.prefix:])[len(before):]
        self.text += delta
        self.prefix = self.read = len(self.ids)
        return delta
