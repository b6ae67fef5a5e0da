"""The tier interface: one level of the KV hierarchy (host RAM, SSD, a remote store, a test double).

A tier stores opaque chunk-layer payloads by `ChunkKey`, within a byte budget. The manager
(`TieredStore`) holds tiers in an ordered list, fastest first, and uses only this interface.
Every method is thread-safe. Pinned entries are never evicted (pins are counted: each `pin`
needs one `unpin`); re-putting a key that is present is a no-op that counts as a use, since a
key names its content.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from types import TracebackType

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.stats import TierStats

BytesLike = bytes | bytearray | memoryview
"""A payload. numpy arrays pass as `memoryview(array)`; they must be C-contiguous."""


def byte_view(data: BytesLike) -> memoryview:
    """`data` as a flat unsigned-byte memoryview (no copy); ValueError if not contiguous."""
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    return view.cast("B")


def done_future(value: bool) -> Future[bool]:
    """A future that is already resolved to `value`."""
    future: Future[bool] = Future()
    future.set_result(value)
    return future


class Tier(abc.ABC):
    """One storage level. Subclasses implement the abstract methods; the batched and async forms
    default to loops over the single forms."""

    name: str  # label for stats and errors; the manager never branches on it
    stats: TierStats
    # Told the keys each eviction drops (and each entry dropped for failing its check), with
    # the tier's lock held (so it must only note them); None: nobody listens.
    on_evict: Callable[[list[ChunkKey]], None] | None = None

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """The byte budget (what `used_bytes` may reach)."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes charged now: stored entries plus space reserved for entries being filled."""

    @abc.abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether `get(key)` would find the key now (no stats, no recency change)."""

    @abc.abstractmethod
    def get(self, key: ChunkKey) -> bytes | memoryview | None:
        """The payload of `key`, or None (a miss). Counts a hit or miss; a hit is a use."""

    @abc.abstractmethod
    def peek(self, key: ChunkKey) -> bytes | memoryview | None:
        """Like `get` but not a use: no stats, no recency change (for copies between tiers)."""

    @abc.abstractmethod
    def put(self, key: ChunkKey, data: BytesLike, *, pin: bool = False,
            owner: bytes = b"") -> bool:
        """Store `data` under `key`, evicting per the policy if needed, pinned once if `pin`.

        Returns False, changing nothing, when there is no room even after evicting every unpinned
        entry. `data` is copied: the caller may reuse its buffer at once. `owner` tags who saved
        it (`keys.owner_tag`), for `owned_by`; a key already stored keeps its first owner.
        """

    @abc.abstractmethod
    def pin(self, key: ChunkKey) -> bool:
        """Add a pin to `key` so it cannot be evicted or removed; False when absent."""

    @abc.abstractmethod
    def unpin(self, key: ChunkKey) -> None:
        """Release one pin; ValueError if `key` is not pinned, no-op if it is absent (a pinned
        entry disappears only when its bytes fail verification)."""

    @abc.abstractmethod
    def pin_all(self, keys: Sequence[ChunkKey]) -> bool:
        """Pin every one of `keys`, or none of them (False) when one is absent."""

    @abc.abstractmethod
    def unpin_all(self, keys: Iterable[ChunkKey]) -> None:
        """`unpin` each of `keys`."""

    @abc.abstractmethod
    def remove(self, key: ChunkKey) -> bool:
        """Delete `key` now; False when absent or pinned (a pinned entry may be in use)."""

    def remove_later(self, key: ChunkKey) -> tuple[bool, int | None]:
        """`remove`, for a caller holding a lock of its own: (whether it was removed, a slot
        whose clearing is left to `clear_slots`, which may block; None: nothing left)."""
        return self.remove(key), None

    def clear_slots(self, slots: Iterable[int]) -> None:
        """Finish the clearing `remove_later` left (none in a tier that clears at once)."""
        del slots  # nothing to clear

    @property
    def uncleared_slots(self) -> int:
        """Removed entries whose bytes a failed clear left where a restart would find them
        (retried by each `clear_slots`); 0 in a tier that keeps nothing across restarts."""
        return 0

    @abc.abstractmethod
    def evict(self, num_bytes: int) -> int:
        """Evict unpinned entries in policy order until `num_bytes` bytes are free.

        Returns how many entries were evicted; evicts none when pins make it impossible.
        """

    @abc.abstractmethod
    def keys(self) -> list[ChunkKey]:
        """A snapshot of the stored keys."""

    def owned_by(self, owner: bytes) -> list[ChunkKey]:
        """The stored keys `put` with `owner`, kept across a restart by a tier that persists
        (none in a tier that does not keep owners)."""
        del owner  # kept by no one here
        return []

    def owner_of(self, key: ChunkKey) -> bytes:
        """Who saved `key` here (`put`'s `owner`; b"" when no one, or when it is not held):
        a copy of `key` made into a faster tier keeps it, so an erasure finds it there too."""
        del key  # kept by no one here
        return b""

    @abc.abstractmethod
    def set_hint(self, session: Hashable, prefix_hashes: Sequence[bytes],
                 likelihood: float) -> None:
        """Pass a session likelihood hint to the eviction policy (see `EvictionPolicy`)."""

    @abc.abstractmethod
    def clear_hint(self, session: Hashable) -> None:
        """Forget a session's hint."""

    @abc.abstractmethod
    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        """A sequence of these chunks (prefix hashes in chunk order) was stored: tell the
        eviction policy its length (see `EvictionPolicy.note_sequence`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish pending writes and release resources; the tier is unusable afterwards."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert the index, allocator and stored bytes agree (AssertionError otherwise)."""

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | memoryview | None]:
        """`get` for each key, in order."""
        return [self.get(key) for key in keys]

    def put_many(self, items: Iterable[tuple[ChunkKey, BytesLike]]) -> list[bool]:
        """`put` for each (key, data), in order; one result each."""
        return [self.put(key, data) for key, data in items]

    def put_async(self, key: ChunkKey, data: BytesLike) -> Future[bool]:
        """Like `put`, but the future resolves once the data is durable in this tier.

        The index changes at once (a following `get` finds the key); only the write may lag.
        """
        return done_future(self.put(key, data))

    def barrier(self, *, sync: bool = False) -> Future[bool]:
        """A future that resolves once every write and erasure queued before it is done
        (at once where nothing is queued); with `sync`, on the device, not only handed to the
        operating system (an erasure's clears must hold across a power loss)."""
        return done_future(True)

    def flush(self) -> None:
        """Block until every accepted write is durable (no-op for synchronous tiers)."""
        return None

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, used={self.used_bytes}, "
                f"capacity={self.capacity_bytes})")
