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

from collections import deque

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
