"""The host tier: chunk-layers in slots of a shared-memory `HostArena`.

The index (key -> slot) and the slot allocator live in the owning process; the bytes live in
shared memory, so another process moves them given slot numbers. Two paths fill a slot:

- `put(key, data)`: this process copies the bytes in (what the manager does on promotion).
- `reserve(key)` -> slot, another process writes the slot, then `commit(key)` (or `abort`):
  the connector's save path. A reserved key is invisible (`contains` is False) until committed.

To let another process *read* a slot, `pin(key)` first, pass `slot_of(key)`, `unpin` when it is
done: an unpinned slot may be evicted and reused at any time.
"""

from __future__ import annotations

from antiphon.tiering.eviction import EvictionPolicy, LruPolicy
from antiphon.tiering.host_arena import HostArena
from antiphon.tiering.index import IndexEntry
from antiphon.tiering.indexed_tier import IndexedTier, OwnerIndex
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.slots import SlotAllocator

# (slot number in the arena, payload length <= slot_bytes; the rest of the slot is garbage).
# A plain tuple of ints, not a NamedTuple: Python's garbage collector stops tracking those,
# and the engine's heap holds one per chunk-layer in the tier.
HostSlot = tuple[int, int]


class HostTier(IndexedTier[HostSlot]):
    """Capacity is `num_slots * slot_bytes`; every entry is charged one whole slot."""

    def __init__(self, arena: HostArena, *, name: str = "host",
                 policy: EvictionPolicy | None = None) -> None:
        """Take ownership of `arena` (closed, and unlinked if created here, by `close`)."""
        super().__init__(name, arena.num_slots * arena.slot_bytes, policy or LruPolicy())
        self.arena = arena
        self._slots = SlotAllocator(arena.num_slots)  # allocation, apart from the index
        self._reserved: dict[ChunkKey, int] = {}  # key -> slot being filled out of band
        # Who saved each entry (`owned_by`): without them, a deleted session's run-on chunk
        # outlived its erasure in host RAM wherever the SSD tier did not hold it (host-only
        # tiers always; with an SSD tier, once it had evicted the record).
        self._owners = OwnerIndex()
        self._owner_of: dict[ChunkKey, bytes] = {}  # (a location here has no room for it)

    @classmethod
    def create(cls, shm_name: str, capacity_bytes: int, slot_bytes: int, *,
               name: str = "host", policy: EvictionPolicy | None = None,
               tracked: bool = True) -> HostTier:
        """A tier over a new arena of `capacity_bytes // slot_bytes` slots named `shm_name`
        (`tracked`: as `HostArena.create`)."""
        arena = HostArena.create(shm_name, capacity_bytes // slot_bytes, slot_bytes,
                                 tracked=tracked)
        arena.prefault_in_background()
        return cls(arena, name=name, policy=policy)

    @property
    def slot_bytes(self) -> int:
        """Bytes in one slot: the largest payload the tier takes (one chunk-layer)."""
        return self.arena.slot_bytes

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding committed `key`, or None. Pin the key while another process uses it."""
        location = self.location_of(key)
        return None if location is None else location[0]

    def reserve(self, key: ChunkKey) -> int | None:
        """Allocate a slot for another process to fill with `key`'s payload (evicting if needed).

        Returns the slot, or None when there is nothing to write (`key` is stored or already
        reserved) or no room (everything is pinned). Follow with `commit` or `abort`.
        """
        with self._lock:
            if key in self._index or key in self._reserved:
                return None
            if not self._make_room(self.slot_bytes):
                self.stats.refused += 1
                return None
            self._index.reserve(self.slot_bytes)
            slot = self._slots.allocate()
            self._reserved[key] = slot
            return slot

    def commit(self, key: ChunkKey, num_bytes: int | None = None, *, pin: bool = False,
               owner: bytes = b"") -> bool:
        """Publish a reserved slot as `key` holding `num_bytes` (default: the whole slot),
        saved by `owner` (`owned_by`).

        Returns False when `key` was not reserved (e.g. aborted, or the tier was closed).
        """
        num_bytes = self.slot_bytes if num_bytes is None else num_bytes
        if not 0 <= num_bytes <= self.slot_bytes:
            raise ValueError(f"num_bytes {num_bytes} outside a {self.slot_bytes}-byte slot")
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is None:
                return False
            self._index.release(self.slot_bytes)
            if key in self._index:  # stored meanwhile (a key names its bytes): keep that copy
                self._zero_behind(slot, 0)  # (and no second one to outlive its removal)
                self._slots.free(slot)
                if pin:
                    self._index.pin(key)
                return True
            self._zero_behind(slot, num_bytes)
            self._index.insert(key, (slot, num_bytes), self.slot_bytes, pin=pin)
            self._own(key, owner)
            self.stats.bytes_in += num_bytes
            return True

    def owned_by(self, owner: bytes) -> list[ChunkKey]:
        with self._lock:
            return self._owners.keys_of(owner)

    def owner_of(self, key: ChunkKey) -> bytes:
        with self._lock:
            return self._owner_of.get(key, b"")

    def abort(self, key: ChunkKey, *, erase: bool = False) -> None:
        """Give back a reserved slot unused (no-op when `key` is not reserved); `erase`
        zeroes what a copy may have written into it (a deleted session's KV)."""
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is not None:
                if erase:
                    self._zero_behind(slot, 0)
                self._index.release(self.slot_bytes)
                self._slots.free(slot)

    def is_reserved(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._is_reserved(key)

    def _is_reserved(self, key: ChunkKey) -> bool:
        return key in self._reserved

    def remove(self, key: ChunkKey) -> bool:
        """Delete `key` now (not while pinned); its slot's bytes are zeroed (the tier keeps
        no copy of a deleted session's KV), then freed."""
        with self._lock:
            location = self.location_of(key)
            removed = super().remove(key)
            if removed and location is not None:
                self._zero_behind(location[0], 0)
            return removed

    def close(self) -> None:
        with self._lock:
            self.arena.close()

    def _charge(self, key: ChunkKey, num_payload_bytes: int) -> int:
        if num_payload_bytes > self.slot_bytes:
            raise ValueError(f"{self.name}: a {num_payload_bytes}-byte payload does not fit a "
                             f"{self.slot_bytes}-byte slot")
        return self.slot_bytes

    def _store(self, key: ChunkKey, data: memoryview, owner: bytes) -> HostSlot:
        slot = self._slots.allocate()
        self.arena.write(slot, data)
        self._zero_behind(slot, len(data))
        self._own(key, owner)
        return slot, len(data)

    def _zero_behind(self, slot: int, num_bytes: int) -> None:
        """Zero `slot` past its first `num_bytes`: a short entry (a turn's tail) in the slot
        of an evicted longer one kept the rest of that one's KV in shared memory, also once
        its session was deleted."""
        if num_bytes < self.slot_bytes:
            self.arena.write(slot, bytes(self.slot_bytes - num_bytes), num_bytes)

    def _own(self, key: ChunkKey, owner: bytes) -> None:
        if owner:
            self._owner_of[key] = self._owners.add(key, owner)

    def _load(self, key: ChunkKey, entry: IndexEntry[HostSlot]) -> bytes:
        return self.arena.read(*entry.location)

    def _free(self, key: ChunkKey, entry: IndexEntry[HostSlot]) -> None:
        self._slots.free(entry.location[0])
        self._owners.discard(key, self._owner_of.pop(key, b""))

    def _check_storage(self) -> None:
        self.arena.check_integrity()
        self._slots.check_integrity()
        slots = [entry.location[0] for _, entry in self._index.items()]
        slots += self._reserved.values()
        assert len(set(slots)) == len(slots), f"{self.name}: two keys share a slot"
        assert set(slots) == self._slots.used_slots(), f"{self.name}: allocator disagrees"
        assert not self._reserved.keys() & set(self._index), "a key is reserved and stored"
        assert self._index.reserved_bytes == len(self._reserved) * self.slot_bytes, "reserved"
        for key, entry in self._index.items():
            assert entry.nbytes == self.slot_bytes, f"{key} not charged one slot"
            assert 0 <= entry.location[1] <= self.slot_bytes, f"{key} length"
        assert self._owner_of.keys() <= set(self._index), f"{self.name}: owner of a key gone"
        assert self._owners.pairs() == {(o, k) for k, o in self._owner_of.items()}, \
            f"{self.name}: owner index disagrees"
