"""Fixed state slots for the linear-attention (GatedDeltaNet) layers.

Each running request owns exactly one slot: row ``slot`` of every linear layer's conv-state pool
``[S, conv_dim, K-1]`` and fp32 recurrent-state pool ``[S, Hv, Dv, Dk]`` (the tensors live in the
model's cache; this class does the bookkeeping). The number of slots ``S`` is chosen
independently of the KV page size -- a slot is not a page.

A slot's rows hold whatever the previous owner left; the engine zeroes them whenever the request
starts from position 0 (first admission and re-admission after preemption).

Invariant (``check_invariants``): free + owned == capacity, and no slot is both free and owned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from pagedhybrid.errors import ContractViolation


class StatePool:
    """Free list of ``num_slots`` state slots and the request that owns each taken one."""

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ContractViolation("StatePool", "num_slots", "must be an int >= 1", num_slots)
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[str, int] = {}

    @property
    def capacity(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_owned(self) -> int:
        return len(self._owner)

    def slot(self, request_id: str) -> int:
        return self._owner[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._owner

    def owners(self) -> set[str]:
        return set(self._owner)

    def acquire(self, request_id: str) -> int | None:
        """Give ``request_id`` a slot (its existing one if it has one); None when none is free."""
        if request_id in self._owner:
            return self._owner[request_id]
        if not self._free:
            return None
        s = self._free.popleft()
        self._owner[request_id] = s
        return s

    def release(self, request_id: str) -> bool:
        s = self._owner.pop(request_id, None)
        if s is None:
            return False
        self._free.append(s)
        return True

    def check_invariants(self) -> None:
        owned = set(self._owner.values())
        free = set(self._free)
        if len(owned) != len(self._owner) or len(free) != len(self._free):
            raise AssertionError("StatePool: a slot is owned twice or listed free twice")
        if owned & free:
            raise AssertionError(f"StatePool: slots both free and owned: {sorted(owned & free)}")
        if len(free) + len(owned) != self.num_slots:
            raise AssertionError(f"StatePool: free {len(free)} + owned {len(owned)} "
                                 f"!= capacity {self.num_slots}")


class CheckpointPool:
    """Rows of the state-checkpoint pools: saved conv + recurrent states at prefix positions.

    A checkpoint is the state of every linear layer after the first ``P`` tokens of a sequence,
    ``P`` a multiple of the checkpoint interval; it is keyed by the content hash of the KV page
    ending at ``P`` (``pages.page_hash``), so it is usable exactly while that page chain is
    cached. Rows are **free**, **owned** (reserved by this step's scheduling: written during the
    step's forward pass, or read by a hit's restore) or **cached** (an LRU list keyed by hash).
    ``reserve`` takes a free row or evicts the least recently used cached one; ``commit`` turns
    the step's written rows into cached ones at the end of the step, ``unpin`` returns rows that
    were only read.

    Invariant (``check_invariants``): free + owned + cached == capacity.
    """

    def __init__(self, num_rows: int) -> None:
        if not isinstance(num_rows, int) or num_rows < 1:
            raise ContractViolation("CheckpointPool", "num_state_checkpoints",
                                    "must be an int >= 1", num_rows)
        self.num_rows = num_rows
        self._free: deque[int] = deque(range(num_rows))
        self._cached: OrderedDict[int, int] = OrderedDict()  # hash -> row, LRU: oldest first
        self._writing: dict[int, int] = {}  # row -> hash, reserved for this step's writes
        self._reading: dict[int, int] = {}  # row -> pins, read by this step's restores
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return self.num_rows

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_owned(self) -> int:
        return len(self._writing)

    def find(self, h: int) -> int | None:
        """The cached row holding the checkpoint of page hash ``h`` (touched as recently used)."""
        row = self._cached.get(h)
        if row is not None:
            self._cached.move_to_end(h)
        return row

    def pending(self, h: int) -> bool:
        return h in self._writing.values()

    def pin(self, row: int) -> None:
        """Keep ``row`` from eviction until ``unpin`` (a hit restores from it this step)."""
        self._reading[row] = self._reading.get(row, 0) + 1

    def reserve(self, h: int) -> int | None:
        """A row for this step to write the checkpoint of page hash ``h`` into, or None."""
        if h in self._cached or self.pending(h):
            return None
        if self._free:
            row = self._free.popleft()
        else:
            victim = next((k for k, r in self._cached.items() if r not in self._reading), None)
            if victim is None:
                return None
            row = self._cached.pop(victim)
            self.evictions += 1
        self._writing[row] = h
        return row

    def discard(self, rows: Iterable[int]) -> None:
        """This step's writes to ``rows`` are not to be kept (their request failed)."""
        for row in rows:
            if self._writing.pop(row, None) is not None:
                self._free.append(row)

    def abandon(self) -> None:
        """The step failed: none of its writes are kept, its read pins end."""
        self.discard(list(self._writing))
        self._reading.clear()

    def commit(self) -> None:
        """The step ran: its written rows become cached, its read pins end."""
        for row, h in self._writing.items():
            self._cached[h] = row
        self._writing.clear()
        self._reading.clear()

    def check_invariants(self) -> None:
        cached = list(self._cached.values())
        rows = list(self._free) + cached + list(self._writing)
        if len(rows) != self.num_rows or len(set(rows)) != self.num_rows:
            raise AssertionError(f"CheckpointPool: free {len(self._free)} + owned "
                                 f"{len(self._writing)} + cached {len(cached)} != capacity "
                                 f"{self.num_rows}")
