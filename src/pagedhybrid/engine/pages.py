"""KV page pool for the full-attention layers.

State: ``num_blocks`` pages of ``block_size`` tokens (the page tensors themselves live in the
model's cache, ``[num_blocks, block_size, Hkv, D]`` per full layer; this class only does the
bookkeeping), a FIFO free list, one reference count per page, and one block table per request
(``table[i]`` holds the request's tokens ``[i*block_size, (i+1)*block_size)``).

``grow(request_id, num_tokens)`` extends a table so it covers ``num_tokens`` tokens, all or
nothing; ``release`` drops a table and returns pages whose count reaches 0 to the free list.
Pages are never zeroed: a page's stale contents are unreachable because attention only reads
``past + new`` positions of its own table.

Invariant (``check_invariants``): free + owned == capacity, the free list holds exactly the
pages with count 0, and each page's count equals the number of table entries naming it.
"""

from __future__ import annotations

from collections import deque

from pagedhybrid.errors import ContractViolation


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class BlockPool:
    """Free list + reference counts + per-request block tables over ``num_blocks`` pages."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ContractViolation("BlockPool", "num_blocks", "must be an int >= 1", num_blocks)
        if not isinstance(block_size, int) or not _is_pow2(block_size) or block_size < 16:
            raise ContractViolation("BlockPool", "block_size",
                                    "must be a power of two >= 16", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_owned(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def owners(self) -> set[str]:
        return set(self._tables)

    def missing_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.missing_blocks(request_id, num_tokens) <= len(self._free)

    # -- updates -------------------------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Extend the table of ``request_id`` to cover ``num_tokens`` tokens; False if short."""
        need = self.missing_blocks(request_id, num_tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            b = self._free.popleft()
            self._ref[b] = 1
            table.append(b)
        return True

    def release(self, request_id: str) -> int:
        """Drop the table of ``request_id``; returns how many pages went back to the free list."""
        table = self._tables.pop(request_id, [])
        freed = 0
        for b in reversed(table):  # tail first, like vLLM, so a chain's tail is reused first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def check_invariants(self) -> None:
        owned = sum(1 for r in self._ref if r > 0)
        if len(self._free) + owned != self.num_blocks:
            raise AssertionError(f"BlockPool: free {len(self._free)} + owned {owned} "
                                 f"!= capacity {self.num_blocks}")
        if len(set(self._free)) != len(self._free) or any(self._ref[b] for b in self._free):
            raise AssertionError("BlockPool: free list holds a duplicate or referenced page")
        counts = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t:
                counts[b] += 1
        if counts != self._ref:
            raise AssertionError("BlockPool: reference counts disagree with the block tables")
