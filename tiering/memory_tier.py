"""The naive tier: payloads in a dict under a byte budget.

The reference the real tiers are tested against, and a stand-in for any tier in tests (an
in-memory "SSD"). Capacity is charged per payload byte.
"""

from __future__ import annotations

from antiphon.tiering.eviction import EvictionPolicy, LruPolicy
from antiphon.tiering.index import IndexEntry
from antiphon.tiering.indexed_tier import IndexedTier
from antiphon.tiering.keys import ChunkKey


class MemoryTier(IndexedTier[bytes]):
    """Each entry's location is its payload, an immutable copy."""

    def __init__(self, capacity_bytes: int, *, name: str = "memory",
                 policy: EvictionPolicy | None = None) -> None:
        super().__init__(name, capacity_bytes, policy or LruPolicy())

    def _charge(self, key: ChunkKey, num_payload_bytes: int) -> int:
        return num_payload_bytes

    def _store(self, key: ChunkKey, data: memoryview, owner: bytes) -> bytes:
        return bytes(data)

    def _load(self, key: ChunkKey, entry: IndexEntry[bytes]) -> bytes:
        return entry.location

    def _free(self, key: ChunkKey, entry: IndexEntry[bytes]) -> None:
        pass  # the dict entry was the storage

    def _check_storage(self) -> None:
        for key, entry in self._index.items():
            assert entry.nbytes == len(entry.location), f"{self.name}: size of {key}"

    def close(self) -> None:
        pass
