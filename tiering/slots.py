"""Fixed-size slot allocation: which slots of an arena are free. Knows nothing of keys or bytes.

    slot:   0     1     2     3     4   ...  num_slots-1
          [used][free][used][free][free] ... [free]
    free list (a stack, so a just-freed, cache-warm slot is reused first): [4, 3, 1, ...]
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotAllocator:
    """A free list over slots `0 .. num_slots-1`; O(1) allocate and free."""

    def __init__(self, num_slots: int, used: Iterable[int] = ()) -> None:
        """All slots free but those in `used` (what a restart found occupied)."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._is_used = bytearray(num_slots)  # 1 where allocated: catches double frees
        for slot in used:
            if not 0 <= slot < num_slots or self._is_used[slot]:
                raise ValueError(f"used slot {slot} is out of range or given twice")
            self._is_used[slot] = 1
        # pops the lowest free slot first
        self._free_list = [s for s in range(num_slots - 1, -1, -1) if not self._is_used[s]]

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_list)

    def can_allocate(self, num: int = 1) -> bool:
        return len(self._free_list) >= num

    def allocate(self) -> int:
        """Take a free slot; raises MemoryError when none is left (check `can_allocate`)."""
        if not self._free_list:
            raise MemoryError("no free slot")
        slot = self._free_list.pop()
        self._is_used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Return `slot`; ValueError if it is out of range or not allocated."""
        if not 0 <= slot < self.num_slots or not self._is_used[slot]:
            raise ValueError(f"free of slot {slot}, which is not allocated")
        self._is_used[slot] = 0
        self._free_list.append(slot)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._is_used[slot])

    def used_slots(self) -> set[int]:
        return {slot for slot in range(self.num_slots) if self._is_used[slot]}

    def check_integrity(self) -> None:
        """Assert the free list and the used map partition the slots."""
        free = set(self._free_list)
        assert len(free) == len(self._free_list), "a slot is on the free list twice"
        assert all(0 <= s < self.num_slots for s in free), "free slot out of range"
        assert all(not self._is_used[s] for s in free), "a used slot is on the free list"
        assert len(free) + sum(self._is_used) == self.num_slots, "a slot is neither used nor free"
