"""The bookkeeping every local tier shares: a `ChunkIndex` behind a lock, and the put/get flow.

A concrete tier says how bytes are stored with five small hooks (`_charge`, `_store`, `_load`,
`_free`, `_check_storage`); index, pins, eviction, hints and stats live here once.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from antiphon.tiering.eviction import EvictionPolicy
from antiphon.tiering.index import ChunkIndex, IndexEntry
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.stats import TierStats
from antiphon.tiering.tier import BytesLike, Tier, byte_view

Location = TypeVar("Location")  # how a subclass finds a payload (slot, file, bytes)


class OwnerIndex:
    """Who saved each stored key (`keys.owner_tag`; b"": no one), by owner, for
    `Tier.owned_by`: a deleted session's erasure finds by it its KV no chain names (a full
    chunk a reply's run-on filled). Not thread-safe: the owning tier locks around it."""

    def __init__(self) -> None:
        # each owner's tag (one copy, which its keys share) and keys
        self._owned: dict[bytes, tuple[bytes, set[ChunkKey]]] = {}

    def add(self, key: ChunkKey, owner: bytes) -> bytes:
        """Note `key` as `owner`'s; returns the owner's one copy of its tag (the thousands of
        chunk-layers of a session share it), b"" for no owner."""
        if not owner:
            return b""
        tag, keys = self._owned.setdefault(owner, (owner, set()))
        keys.add(key)
        return tag

    def discard(self, key: ChunkKey, owner: bytes) -> None:
        if owner:
            keys = self._owned[owner][1]
            keys.discard(key)
            if not keys:
                del self._owned[owner]

    def keys_of(self, owner: bytes) -> list[ChunkKey]:
        return list(self._owned[owner][1]) if owner in self._owned else []

    def pairs(self) -> set[tuple[bytes, ChunkKey]]:
        """Every (owner, key) noted (for integrity checks)."""
        return {(owner, key) for owner, (_, keys) in self._owned.items() for key in keys}


class IndexedTier(Tier, Generic[Location]):
    """A tier whose index lives in this process; subclasses supply the storage."""

    def __init__(self, name: str, capacity_bytes: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.stats = TierStats()
        self._lock = threading.RLock()  # guards the index, the storage map and the stats
        self._index: ChunkIndex[Location] = ChunkIndex(capacity_bytes, policy)

    # Storage hooks, all called with the lock held.

    @abc.abstractmethod
    def _charge(self, key: ChunkKey, num_payload_bytes: int) -> int:
        """Capacity bytes charged for a payload of `num_payload_bytes` (ValueError if too big)."""

    @abc.abstractmethod
    def _store(self, key: ChunkKey, data: memoryview, owner: bytes) -> Location:
        """Copy `data` into storage for `key`, saved by `owner`; room has been made."""

    @abc.abstractmethod
    def _load(self, key: ChunkKey, entry: IndexEntry[Location]) -> bytes:
        """A copy of the stored payload."""

    @abc.abstractmethod
    def _free(self, key: ChunkKey, entry: IndexEntry[Location]) -> None:
        """Release the storage of an entry the index has just dropped."""

    @abc.abstractmethod
    def _check_storage(self) -> None:
        """Assert storage agrees with the index."""

    # The Tier interface.

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes + self._index.reserved_bytes

    @property
    def policy(self) -> EvictionPolicy:
        return self._index.policy

    def can_make_room(self, num_bytes: int) -> bool:
        """Whether `num_bytes` could be had now by evicting unpinned entries."""
        with self._lock:
            return self._index.can_make_room(num_bytes)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: ChunkKey) -> bytes | memoryview | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._index.touch(key)
            data = self._load(key, entry)
            self.stats.hits += 1
            self.stats.bytes_out += len(data)
            return data

    def peek(self, key: ChunkKey) -> bytes | memoryview | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else self._load(key, entry)

    def put(self, key: ChunkKey, data: BytesLike, *, pin: bool = False,
            owner: bytes = b"") -> bool:
        return self._put_locked(key, byte_view(data), pin, owner)[0] is not None

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._index.pin(key)

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            self._index.unpin(key)

    def pin_all(self, keys: Sequence[ChunkKey]) -> bool:
        # One lock for all of `keys` (a turn pins every layer of each chunk it loads).
        with self._lock:
            return self._index.pin_all(keys)

    def unpin_all(self, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._index.unpin(key)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.pins:
                return False
            self._index.remove(key)
            self._free(key, entry)
            return True

    def evict(self, num_bytes: int) -> int:
        with self._lock:
            before = self.stats.evictions
            self._make_room(num_bytes)
            return self.stats.evictions - before

    def location_of(self, key: ChunkKey) -> Location | None:
        """Where `key`'s payload is stored now (no stats, no recency change), or None."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.location

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._index)

    def note_unbacked(self, keys: Iterable[ChunkKey]) -> None:
        """The tier below evicted `keys`: those held here are the only copies now."""
        with self._lock:
            for key in keys:
                self._index.policy.on_unbacked(key)

    def set_hint(self, session: Hashable, prefix_hashes: Sequence[bytes],
                 likelihood: float) -> None:
        with self._lock:
            self._index.policy.set_hint(session, prefix_hashes, likelihood)

    def clear_hint(self, session: Hashable) -> None:
        with self._lock:
            self._index.policy.clear_hint(session)

    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self._index.policy.note_sequence(prefix_hashes)

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            self._check_storage()

    # Helpers for subclasses.

    def _put_locked(self, key: ChunkKey, data: memoryview, pin: bool,
                    owner: bytes = b"") -> tuple[IndexEntry[Location] | None, bool]:
        """The put flow under the lock: (entry, is_new), or (None, False) when refused.

        A present key is only used (and pinned); a new one gets room, storage and an entry.
        """
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                if pin:
                    self._index.pin(key)
                else:
                    self._index.touch(key)
                return entry, False
            if self._is_reserved(key):  # its bytes are on their way: refused, not stored twice
                self.stats.refused += 1
                return None, False
            nbytes = self._charge(key, len(data))
            if not self._make_room(nbytes):
                self.stats.refused += 1
                return None, False
            self._index.insert(key, self._store(key, data, owner), nbytes, pin=pin)
            self.stats.bytes_in += len(data)
            entry = self._index.get(key)
            return entry, True

    def _is_reserved(self, key: ChunkKey) -> bool:
        """`key` has a slot reserved for a copy in flight (tiers that reserve; under the
        lock)."""
        return False

    def _make_room(self, nbytes: int) -> bool:
        """Evict until `nbytes` are free; False, evicting nothing, when pins forbid it."""
        evicted = self._index.make_room(nbytes)
        if evicted is None:
            return False
        for key, entry in evicted:
            self._free(key, entry)
        self.stats.evictions += len(evicted)
        if evicted and self.on_evict is not None:
            self.on_evict([key for key, _ in evicted])
        return True

    def _drop_corrupt(self, key: ChunkKey, entry: IndexEntry[Location]) -> None:
        """Remove an entry whose bytes failed verification, even if pinned, and count it."""
        if self._drop(key, entry):
            self.stats.corrupt_dropped += 1

    def _drop(self, key: ChunkKey, entry: IndexEntry[Location]) -> bool:
        """Remove `entry` if it is still `key`'s, even if pinned (lock held); those listening
        to evictions hear of it as one (a tier above that ranked its copy as backed here, and
        a checkpoint that counted on it, learn it is gone). Whether it was removed."""
        if self._index.get(key) is not entry:
            return False
        self._index.remove(key)
        self._free(key, entry)
        if self.on_evict is not None:
            self.on_evict([key])
        return True
