"""``KVCacheSpec``: the identity of a paged KV cache that decode / chunked prefill attends.

State layout described (per logical sequence ``b`` of the batch, on this rank):

* ``kv_seq_lens[b]`` tokens are cached; local token ``j`` lives in physical page
  ``block_table[b][j // page_size]`` at slot ``j % page_size``;
* ``global_token_positions`` holds the logical (global) position of every cached token,
  sequence after sequence (``sum(kv_seq_lens)`` entries), strictly increasing within a sequence;
* ``cache_positions[b]`` is the terminal logical position already in the cache (the last
  ``global_token_positions`` entry of ``b``), not the next position to be written; ``-1`` when
  the sequence has no cached token on this rank;
* ``block_table`` rows have ``ceil(kv_seq_lens[b] / page_size)`` active page ids followed by
  trailing ``-1`` padding, and never repeat a page;
* with prefix caching on, the first ``shared_prefix_page_count`` pages of every sequence are one
  read-only shared prefix: the same page ids, the same logical positions, fully populated, and
  the terminal (just written) token lies after it. Every other page belongs to one sequence only
  (the copy-on-write boundary); with prefix caching off no page is shared at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedhybrid.attention.fields import Checker, enum_value

_FIELDS = ("cache_positions", "kv_seq_lens", "block_table", "global_token_positions", "page_size",
           "prefix_cache_enabled", "prefix_cache_key", "shared_prefix_page_count")


@dataclass(frozen=True)
class KVCacheSpec:
    """Decode-replay cache identity; validated at construction (see the module docstring)."""

    cache_positions: tuple[int, ...]
    kv_seq_lens: tuple[int, ...]
    block_table: tuple[tuple[int, ...], ...]
    global_token_positions: tuple[int, ...]
    page_size: int
    prefix_cache_enabled: bool = False
    prefix_cache_key: str | None = None
    shared_prefix_page_count: int = 0

    def __post_init__(self) -> None:
        c = Checker("KVCacheSpec")
        page = c.positive(self.page_size, "page_size")
        lens = c.ints(self.kv_seq_lens, "kv_seq_lens", minimum=0)
        batch = len(lens)
        c.check(batch >= 1, "kv_seq_lens", "must hold one length per logical sequence", [])
        cpos = c.ints(self.cache_positions, "cache_positions", minimum=-1)
        c.check(len(cpos) == batch, "cache_positions",
                f"must hold one entry per logical sequence ({batch})", len(cpos))
        c.check(isinstance(self.block_table, (list, tuple)), "block_table",
                "must be a 2-D sequence [batch][max_pages]", type(self.block_table).__name__)
        table = tuple(c.ints(row, f"block_table[{b}]", minimum=-1)
                      for b, row in enumerate(self.block_table))
        c.check(len(table) == batch, "block_table", f"must have one row per sequence ({batch})",
                len(table))
        width = len(table[0])
        for b, row in enumerate(table):
            c.check(len(row) == width, f"block_table[{b}]",
                    f"must have the same width as row 0 ({width})", len(row))
        gpos = c.ints(self.global_token_positions, "global_token_positions", minimum=0)
        c.check(len(gpos) == sum(lens), "global_token_positions",
                f"must hold one position per cached token (sum(kv_seq_lens) = {sum(lens)})",
                len(gpos))

        per_seq: list[tuple[int, ...]] = []
        start = 0
        for b, n in enumerate(lens):
            pos = gpos[start:start + n]
            start += n
            per_seq.append(pos)
            c.strictly_increasing(pos, f"global_token_positions[sequence {b}]")
            terminal = pos[-1] if pos else -1
            c.check(cpos[b] == terminal, f"cache_positions[{b}]",
                    "must equal the terminal global token position of the sequence "
                    f"({terminal}), not the next position to write", cpos[b])
            row = table[b]
            active = -(-n // page)
            c.check(all(p >= 0 for p in row[:active]), f"block_table[{b}]",
                    f"must have ceil(kv_seq_lens[{b}] / page_size) = {active} active pages "
                    "before any -1", list(row))
            c.check(all(p == -1 for p in row[active:]), f"block_table[{b}]",
                    f"padding must be trailing -1 after the {active} active pages "
                    f"(active pages = ceil(kv_seq_len / page_size))", list(row))
            c.check(len(set(row[:active])) == active, f"block_table[{b}]",
                    "must not repeat a physical page within one sequence", list(row[:active]))

        enabled = self.prefix_cache_enabled
        c.check(isinstance(enabled, bool), "prefix_cache_enabled", "must be a bool", enabled)
        key = self.prefix_cache_key
        if enabled:
            c.check(isinstance(key, str) and key != "", "prefix_cache_key",
                    "is required (non-empty string) when prefix caching is enabled", key)
        else:
            c.check(key is None, "prefix_cache_key",
                    "must be None when prefix caching is disabled", key)
        shared = c.non_negative(self.shared_prefix_page_count, "shared_prefix_page_count")
        c.check(shared == 0 or enabled, "shared_prefix_page_count",
                "may be > 0 only when prefix caching is enabled", shared)
        _check_sharing(c, table, lens, per_seq, page, shared)

        object.__setattr__(self, "cache_positions", cpos)
        object.__setattr__(self, "kv_seq_lens", lens)
        object.__setattr__(self, "block_table", table)
        object.__setattr__(self, "global_token_positions", gpos)

    # -- derived -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.kv_seq_lens)

    def sequence_positions(self, b: int) -> tuple[int, ...]:
        """Global token positions of the cached tokens of sequence ``b``."""
        start = sum(self.kv_seq_lens[:b])
        return self.global_token_positions[start:start + self.kv_seq_lens[b]]

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f: enum_value(getattr(self, f)) for f in _FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCacheSpec:
        c = Checker("KVCacheSpec")
        c.check(isinstance(d, dict), "<dict>", "must be a JSON object", type(d).__name__)
        unknown = sorted(set(d) - set(_FIELDS))
        c.check(not unknown, "<dict>", "has unknown fields", unknown)
        return cls(**{k: _tupled(v) for k, v in d.items()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVCacheSpec:
        return cls.from_dict(json.loads(text))


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v


def _check_sharing(c: Checker, table: tuple[tuple[int, ...], ...], lens: tuple[int, ...],
                   positions: list[tuple[int, ...]], page: int, shared: int) -> None:
    """Shared-prefix and page-aliasing rules (see the module docstring)."""
    if shared:
        prefix_ids = table[0][:shared]
        prefix_pos = positions[0][:shared * page]
        for b, n in enumerate(lens):
            c.check(n > shared * page, "shared_prefix_page_count",
                    f"declared shared prefix pages must be fully populated and read-only: "
                    f"sequence {b} needs more than {shared} * page_size = {shared * page} "
                    "cached tokens (its terminal token must lie in an exclusive suffix page)", n)
            c.check(table[b][:shared] == prefix_ids, f"block_table[{b}]",
                    f"must start with the same {shared} shared prefix page ids as sequence 0 "
                    f"{list(prefix_ids)}", list(table[b][:shared]))
            c.check(positions[b][:shared * page] == prefix_pos,
                    f"global_token_positions[sequence {b}]",
                    "must repeat the logical positions of the shared prefix pages of sequence 0",
                    list(positions[b][:shared * page]))
    owner: dict[int, tuple[int, int]] = {}  # page id -> (sequence, page index) of first use
    for b, n in enumerate(lens):
        for i, p in enumerate(table[b][:-(-n // page)]):
            first = owner.setdefault(p, (b, i))
            if first[0] == b:
                continue
            in_prefix = i < shared and first[1] == i
            c.check(in_prefix, f"block_table[{b}]",
                    f"page {p} at index {i} is also used by sequence {first[0]} at index "
                    f"{first[1]}; only the {shared} declared shared prefix pages may be shared "
                    "across sequences (suffix pages are exclusive; with prefix caching off no "
                    "page is shared)", list(table[b]))
