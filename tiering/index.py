"""The chunk index of one tier: which keys it holds, where, what they cost, which are pinned.

Every tier keeps one `ChunkIndex` and stores bytes its own way; the index does the
bookkeeping they share: capacity accounting, reference-counted pins, and asking the eviction
policy for victims. It never touches stored bytes: `make_room` returns the evicted entries and
the tier frees their storage.

    capacity_bytes
    |<------------------------------------------------------------>|
    |<- used_bytes (stored entries) ->|<- reserved ->|<- free ---->|
    |<- pinned ->|<- evictable ------>|
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from antiphon.tiering.eviction import EvictionPolicy
from antiphon.tiering.keys import ChunkKey

Location = TypeVar("Location")


@dataclasses.dataclass
class IndexEntry(Generic[Location]):
    location: Location  # where the tier keeps the bytes (slot number, file, buffer)
    nbytes: int  # bytes charged against the tier's capacity
    pins: int = 0  # pin count: never evicted while > 0


class ChunkIndex(Generic[Location]):
    """Key -> entry map with a byte budget. Not thread-safe: the owning tier locks around it."""

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._entries: dict[ChunkKey, IndexEntry[Location]] = {}
        self.used_bytes = 0  # sum of nbytes over entries
        self.pinned_bytes = 0  # sum of nbytes over entries with pins > 0
        self.reserved_bytes = 0  # charged for space being filled, not yet an entry

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[ChunkKey, IndexEntry[Location]]]:
        return iter(self._entries.items())

    def get(self, key: ChunkKey) -> IndexEntry[Location] | None:
        return self._entries.get(key)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes - self.reserved_bytes

    def can_make_room(self, nbytes: int) -> bool:
        """Whether evicting every unpinned entry would free `nbytes` (nothing is changed)."""
        return self.free_bytes + (self.used_bytes - self.pinned_bytes) >= nbytes

    def make_room(self, nbytes: int) -> list[tuple[ChunkKey, IndexEntry[Location]]] | None:
        """Evict in policy order until `nbytes` are free; returns the evicted entries.

        Returns None, evicting nothing, when pinned entries make it impossible.
        """
        if not self.can_make_room(nbytes):
            return None
        evicted: list[tuple[ChunkKey, IndexEntry[Location]]] = []
        while self.free_bytes < nbytes:
            key = self.policy.pop_victim()
            assert key is not None, "policy ran dry before the index did"
            entry = self._entries.pop(key)
            self.used_bytes -= entry.nbytes
            evicted.append((key, entry))
        return evicted

    def insert(self, key: ChunkKey, location: Location, nbytes: int, *, pin: bool = False) -> None:
        """Add an entry for `key` (absent), pinned once when `pin`. Call `make_room` first."""
        assert key not in self._entries, f"{key} already indexed"
        assert nbytes <= self.free_bytes, "insert without room"
        self._entries[key] = IndexEntry(location, nbytes, 1 if pin else 0)
        self.used_bytes += nbytes
        if pin:
            self.pinned_bytes += nbytes
        else:
            self.policy.on_insert(key)

    def remove(self, key: ChunkKey) -> IndexEntry[Location] | None:
        """Drop `key`'s entry whatever its pins; returns it, or None when absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.used_bytes -= entry.nbytes
        if entry.pins:
            self.pinned_bytes -= entry.nbytes
        else:
            self.policy.on_remove(key)
        return entry

    def touch(self, key: ChunkKey) -> None:
        """Record a use of `key` for the policy."""
        entry = self._entries.get(key)
        if entry is not None and not entry.pins:
            self.policy.on_access(key)

    def pin(self, key: ChunkKey) -> bool:
        """Add one pin to `key`; False when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.pins == 0:
            self.policy.on_remove(key)
            self.pinned_bytes += entry.nbytes
        entry.pins += 1
        return True

    def pin_all(self, keys: Sequence[ChunkKey]) -> bool:
        """Pin every one of `keys`, or none (False) when one is absent."""
        entries = self._entries
        if not all(key in entries for key in keys):
            return False
        for key in keys:
            self.pin(key)
        return True

    def unpin(self, key: ChunkKey) -> None:
        """Release one pin of `key`; no-op when absent (dropped as corrupt while pinned),
        ValueError when present and not pinned."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.pins == 0:
            raise ValueError(f"unpin of an unpinned chunk {key}")
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned_bytes -= entry.nbytes
            self.policy.on_insert(key)

    def reserve(self, nbytes: int) -> None:
        """Charge `nbytes` for space being filled outside the index (call `make_room` first)."""
        assert nbytes <= self.free_bytes, "reserve without room"
        self.reserved_bytes += nbytes

    def release(self, nbytes: int) -> None:
        """Return `nbytes` charged by `reserve`."""
        assert nbytes <= self.reserved_bytes, "release of more than was reserved"
        self.reserved_bytes -= nbytes

    def check_integrity(self) -> None:
        """Assert the byte counters, pins and policy agree with the entries."""
        assert self.used_bytes == sum(e.nbytes for e in self._entries.values()), "used_bytes"
        assert self.pinned_bytes == sum(
            e.nbytes for e in self._entries.values() if e.pins), "pinned_bytes"
        assert all(e.pins >= 0 and e.nbytes >= 0 for e in self._entries.values()), "negative"
        assert self.reserved_bytes >= 0, "reserved_bytes negative"
        assert self.used_bytes + self.reserved_bytes <= self.capacity_bytes, "over capacity"
        self.policy.check_integrity({k for k, e in self._entries.items() if not e.pins})
