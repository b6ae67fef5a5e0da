"""Fixed-size slot allocation: which slots of an arena are free. Knows nothing of keys or bytes.

    slot:   0     1     2     3     4     5   ...  num_slots-1
          [used][free][used][free][used][free] ... [free]
                                          ^ fresh: never handed out from here on
    free list below it (a stack, so a just-freed, cache-warm slot is reused first): [3, 1]
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotAllocator:
    """Free slots over `0 .. num_slots-1`; O(1) allocate and free. Slots never handed out are
    a range past a mark, not listed: a list of every slot of a large SSD tier (11 million
    at 1 TiB) took 420 MiB and most of a second to build at each start."""

    def __init__(self, num_slots: int, used: Iterable[int] = ()) -> None:
        """All slots free but those in `used` (what a restart found occupied)."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._is_used = bytearray(num_slots)  # 1 where allocated: catches double frees
        self._num_used = 0
        for slot in used:
            if not 0 <= slot < num_slots or self._is_used[slot]:
                raise ValueError(f"used slot {slot} is out of range or given twice")
            self._is_used[slot] = 1
            self._num_used += 1
        # Every slot from `_fresh` on is free; the free slots below it are on `_free_list`
        # (a stack, the lowest on top: slots are handed out lowest first, then the
        # just-freed first).
        self._fresh = self._is_used.rfind(1) + 1
        self._free_list = [s for s in range(self._fresh - 1, -1, -1) if not self._is_used[s]]

    @property
    def num_free(self) -> int:
        return self.num_slots - self._num_used

    @property
    def num_used(self) -> int:
        return self._num_used

    def can_allocate(self, num: int = 1) -> bool:
        return self.num_free >= num

    def allocate(self) -> int:
        """Take a free slot; raises MemoryError when none is left (check `can_allocate`)."""
        if self._free_list:
            slot = self._free_list.pop()
        elif self._fresh < self.num_slots:
            slot = self._fresh
            self._fresh += 1
        else:
            raise MemoryError("no free slot")
        self._is_used[slot] = 1
        self._num_used += 1
        return slot

    def free(self, slot: int) -> None:
        """Return `slot`; ValueError if it is out of range or not allocated."""
        if not 0 <= slot < self.num_slots or not self._is_used[slot]:
            raise ValueError(f"free of slot {slot}, which is not allocated")
        self._is_used[slot] = 0
        self._num_used -= 1
        self._free_list.append(slot)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._is_used[slot])

    def used_slots(self) -> set[int]:
        return {slot for slot in range(self._fresh) if self._is_used[slot]}

    def check_integrity(self) -> None:
        """Assert the free list, the fresh range and the used map partition the slots."""
        free = set(self._free_list)
        assert len(free) == len(self._free_list), "a slot is on the free list twice"
        assert all(0 <= s < self._fresh for s in free), "free slot out of range"
        assert all(not self._is_used[s] for s in free), "a used slot is on the free list"
        assert not any(self._is_used[self._fresh:]), "a used slot past the fresh mark"
        assert sum(self._is_used) == self._num_used, "the used count disagrees"
        assert len(free) + self._num_used + self.num_slots - self._fresh == self.num_slots, \
            "a slot is neither used nor free"
