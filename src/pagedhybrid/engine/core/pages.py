"""KV page pool for the full-attention layers, with content-hashed pages for prefix caching.

State: ``num_blocks`` pages of ``block_size`` tokens (the page tensors live in the model's cache,
``[num_blocks, block_size, Hkv, D]`` per full layer; this class only does the bookkeeping), one
reference count per page and one block table per request (``table[i]`` holds the request's
tokens ``[i*block_size, (i+1)*block_size)``). A page is in exactly one of three states:

* **free** -- reference count 0, no content worth keeping (a FIFO list);
* **owned** -- referenced by one or more block tables (``ref > 0``);
* **cached** -- reference count 0 but holding a full page of a known prefix: it keeps its
  content hash and waits in an LRU list, reusable by a later request with the same prefix, and
  is evicted (its hash dropped) only when the pool needs a page and no free one is left.

Content hashes (``page_hash``) chain from the first page of a sequence: page ``j``'s hash is the
hash of (page ``j-1``'s hash, its ``block_size`` token ids, the extra key -- e.g. the model or
adapter id). The hash is a stable, unsigned 64-bit BLAKE2b digest of a fixed byte encoding (the same
in every process and on every machine), so other processes -- a router indexing the KV events of
many replicas (``engine/core/kv_events.py``) -- can use it as the page's name. Only full pages get a
hash, so a shared page is never written (a request writes only positions at or after its computed
prefix, which lie in its private last pages). A lookup walks the chain and verifies each page's own
tokens and parent page, so a hash collision can never hand a request another prefix's page.

``grow(request_id, num_tokens)`` extends a table so it covers ``num_tokens`` tokens, all or
nothing (free pages first, then LRU evictions of cached ones); ``share`` starts a table with
cached or owned pages of a hit; ``register_full`` gives the full pages of a request their hash
once computed; ``release`` drops a table (hashed pages whose count reaches 0 become cached, the
others free). Pages are never zeroed: stale contents are unreachable because attention reads only
``past + new`` positions of a sequence's own table.

Events (``record_events=True``, for ``engine/core/kv_events.py``): the pool records, in order, each
page that enters the hash index (``PagesStored``: hashes, parent hash, tokens -- consecutive
pages of one chain in one event), each hash that leaves it (``PagesRemoved``: LRU evictions)
and, first of all, ``PagesCleared`` (a new pool holds nothing: a replica that starts or rebuilds
its pools says so). ``take_events`` hands over what was recorded since its last call, so an
outside index that applies the events in order holds exactly the pool's hash index. With
``record_events=False`` nothing is recorded (one ``None`` test per page indexed or evicted).

Invariant (``check_invariants``): free + owned + cached == capacity, the free and cached lists
hold exactly the unreferenced pages, each page's count equals the number of table entries naming
it, and the hash table indexes exactly the hashed pages.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any, NamedTuple

from pagedhybrid.errors import ContractViolation

_PERSON = b"pagedhybrid.kv1"  # BLAKE2b personalisation: this hash and version, nothing else
_NO_PARENT = b"\x00"
_BIG_ENDIAN = sys.byteorder == "big"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _key_state(extra_key: object) -> Any:
    """BLAKE2b primed with an extra key: the length (4 bytes LE) and UTF-8 of its ``repr``."""
    raw = repr(extra_key).encode("utf-8")
    return blake2b(len(raw).to_bytes(4, "little") + raw, digest_size=8, person=_PERSON)


def _page_hash(parent: int | None, tokens: Sequence[int], key: Any) -> int:
    h = key.copy()
    h.update(_NO_PARENT if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    ids = array("q", tokens)
    if _BIG_ENDIAN:
        ids.byteswap()
    h.update(ids.tobytes())
    return int.from_bytes(h.digest(), "little")


def page_hash(parent: int | None, tokens: Sequence[int], extra_key: object = None) -> int:
    """Content hash of one full page chained to its parent page's hash.

    An unsigned 64-bit int (``0 <= h < 2**64``, the ``uint64`` of vLLM's KV events), the same in
    every process and on every machine: the 8-byte BLAKE2b digest (personalisation
    ``pagedhybrid.kv1``), read little-endian, of the length (4 bytes LE) and UTF-8 bytes of
    ``repr(extra_key)``, then ``0x00`` (no parent) or ``0x01`` + the parent's hash (8 bytes LE),
    then the token ids as int64 LE. The extra key must have a stable ``repr``: None, str, int
    or tuples of those."""
    return _page_hash(parent, tokens, _key_state(extra_key))


def chain_hashes(token_ids: Sequence[int], block_size: int, extra_key: object = None,
                 known: Sequence[int] = ()) -> list[int]:
    """Hashes of every full page of ``token_ids``, extending the ``known`` prefix of them."""
    out = list(known)
    first, last = len(out), len(token_ids) // block_size
    if first >= last:
        return out
    key = _key_state(extra_key)
    parent = out[-1] if out else None
    for j in range(first, last):
        parent = _page_hash(parent, token_ids[j * block_size:(j + 1) * block_size], key)
        out.append(parent)
    return out


class PagesStored(NamedTuple):
    """Full pages entered the hash index: consecutive pages of one chain, the first one's parent
    page hash (None: the chain's first page), their tokens (``block_size`` per page)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class PagesRemoved(NamedTuple):
    """Page hashes left the hash index (their pages were evicted)."""

    block_hashes: list[int]


class PagesCleared(NamedTuple):
    """The hash index is empty (a new or rebuilt pool)."""


PageEvent = PagesStored | PagesRemoved | PagesCleared


class BlockPool:
    """Reference counts, block tables and (with ``caching``) content-hashed cached pages."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False,
                 record_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ContractViolation("BlockPool", "num_blocks", "must be an int >= 1", num_blocks)
        if not isinstance(block_size, int) or not _is_pow2(block_size) or block_size < 16:
            raise ContractViolation("BlockPool", "block_size",
                                    "must be a power of two >= 16", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        # register_full's place in each request's chain: pages walked, canonical page of the
        # last, and whether the chain went through another request's page (which may be evicted)
        self._walked: dict[str, tuple[int, int, bool]] = {}
        self._hash: list[int | None] = [None] * num_blocks
        self._content: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self.evictions = 0
        # events since the last take_events (None: not recorded); a new pool starts empty
        self._events: list[PageEvent] | None = [PagesCleared()] if record_events else None

    # -- queries -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Pages a request can take now: free ones and evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_owned(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def owners(self) -> set[str]:
        return set(self._tables)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def is_hashed(self, page: int) -> bool:
        return self._hash[page] is not None

    def has_hash(self, h: int) -> bool:
        return h in self._by_hash

    def missing_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.missing_blocks(request_id, num_tokens) <= self.num_free

    # -- prefix lookup -------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """The longest run of pages holding the first pages of ``token_ids`` (``hashes`` are
        their chain hashes), each verified by its own tokens and its parent page."""
        pages: list[int] = []
        bs = self.block_size
        for j, h in enumerate(hashes):
            page = self._by_hash.get(h)
            if page is None:
                break
            parent = pages[-1] if pages else -1
            if self._content[page] != (parent, tuple(token_ids[j * bs:(j + 1) * bs])):
                break  # a hash collision: another prefix's page
            pages.append(page)
        return pages

    # -- updates -------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._cached.popitem(last=False)  # evict the least recently used
        self._unhash(page)
        self.evictions += 1
        return page

    def take_events(self) -> list[PageEvent]:
        """The hash index's changes since the last call, in order (``record_events``; else
        always empty). The caller owns the list."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def _unhash(self, page: int) -> None:
        h = self._hash[page]
        if h is not None and self._by_hash.get(h) == page:
            del self._by_hash[h]
            events = self._events
            if events is not None:  # evictions in a row make one event
                if events and isinstance(events[-1], PagesRemoved):
                    events[-1].block_hashes.append(h)
                else:
                    events.append(PagesRemoved([h]))
        self._hash[page] = None
        self._content[page] = None
        for rid in [r for r, (_, _, foreign) in self._walked.items() if foreign]:
            del self._walked[rid]  # a walk that chained through another's page starts over

    def share(self, request_id: str, pages: Sequence[int]) -> None:
        """Start ``request_id``'s table with ``pages`` (a prefix hit), counting a reference."""
        if request_id in self._tables:
            raise ContractViolation("BlockPool", "share", "needs a request without a table",
                                    request_id)
        for page in pages:
            if self._ref[page] == 0:
                self._cached.pop(page)
            self._ref[page] += 1
        self._tables[request_id] = list(pages)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Extend the table of ``request_id`` to cover ``num_tokens`` tokens; False if short."""
        need = self.missing_blocks(request_id, num_tokens)
        if need > self.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            b = self._take()
            self._ref[b] = 1
            table.append(b)
        return True

    def register_full(self, request_id: str, hashes: Sequence[int], token_ids: Sequence[int],
                      num_computed: int) -> None:
        """Give the request's full, computed pages their content hash (prefix caching).

        Each page's recorded content is (its canonical parent page, its tokens). A page whose
        hash another page already holds stays private; the chain continues through that page
        if its content is equal (a real duplicate) and stops at a hash collision."""
        if not self.caching:
            return
        table = self._tables.get(request_id, ())
        bs = self.block_size
        # the pages walked before are as they were (the request holds them), so the walk goes on
        # from where the last one ended: O(new pages) a step, not O(context)
        start, parent, foreign = self._walked.get(request_id, (0, -1, False))
        events = self._events
        run: PagesStored | None = None  # the event the next page's store may extend
        for j in range(start, min(len(table), num_computed // bs, len(hashes))):
            page, h = table[j], hashes[j]
            content = (parent, tuple(token_ids[j * bs:(j + 1) * bs]))
            if self._hash[page] is None:
                other = self._by_hash.get(h)
                if other is None:
                    self._hash[page], self._content[page] = h, content
                    self._by_hash[h] = page
                    if events is not None:  # pages stored in a row make one event
                        if run is not None and run.block_hashes[-1] == hashes[j - 1]:
                            run.block_hashes.append(h)
                            run.token_ids.extend(content[1])
                        else:
                            run = PagesStored([h], hashes[j - 1] if j else None,
                                              list(content[1]), bs)
                            events.append(run)
                elif self._content[other] == content:
                    page, foreign = other, True  # an equal page already indexed: chain through
                else:
                    return  # a hash collision: this chain stays private (tried again next time)
            elif self._content[page] != content:
                return
            parent = page  # the canonical page of this position
            self._walked[request_id] = (j + 1, parent, foreign)

    def release(self, request_id: str) -> int:
        """Drop the table of ``request_id``; returns how many pages it no longer references
        became unreferenced (cached when hashed, else free)."""
        table = self._tables.pop(request_id, [])
        self._walked.pop(request_id, None)
        freed = 0
        for b in reversed(table):  # tail first, like vLLM, so a chain's tail is reused first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._cached[b] = None  # most recently used at the end
                else:
                    self._free.append(b)
                freed += 1
        return freed

    def check_invariants(self) -> None:
        owned = sum(1 for r in self._ref if r > 0)
        if len(self._free) + owned + len(self._cached) != self.num_blocks:
            raise AssertionError(f"BlockPool: free {len(self._free)} + owned {owned} + cached "
                                 f"{len(self._cached)} != capacity {self.num_blocks}")
        unref = list(self._free) + list(self._cached)
        if len(set(unref)) != len(unref) or any(self._ref[b] for b in unref):
            raise AssertionError("BlockPool: free/cached lists hold a duplicate or referenced "
                                 "page")
        if any(self._hash[b] is not None for b in self._free) or \
                any(self._hash[b] is None for b in self._cached):
            raise AssertionError("BlockPool: a free page keeps a hash or a cached page has none")
        counts = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t:
                counts[b] += 1
        if counts != self._ref:
            raise AssertionError("BlockPool: reference counts disagree with the block tables")
        hashed = {b: h for b, h in enumerate(self._hash) if h is not None}
        if {p: h for h, p in self._by_hash.items()} != hashed:
            raise AssertionError("BlockPool: the hash index disagrees with the hashed pages")
        for b, r in enumerate(self._ref):
            if r > 1 and self._hash[b] is None:
                raise AssertionError(f"BlockPool: page {b} is shared but not a full cached page")
