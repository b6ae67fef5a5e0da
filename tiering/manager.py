"""The tiered store: session KV over an ordered list of tiers, fastest first.

    put(key)      ──> fastest tier that accepts it (of all but the slowest)
                  └─> always the slowest tier too (write-through: any faster copy can go)
    get(key)      tier 0? ─miss─> tier 1? ─miss─> ... ─hit at i─> copy up to a faster tier
    lookup_prefix how many leading chunks have every layer in some tier
    prefetch      bring keys up to tier `upto_tier` in layer order, in the background

The store never branches on a tier's name or type: it uses only the `Tier` interface.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.prefetch import PrefetchHandle
from antiphon.tiering.stats import TierStats
from antiphon.tiering.tier import BytesLike, Tier

log = logging.getLogger(__name__)


class ErasureIncomplete(RuntimeError):
    """An erasure's removals may not all be off the disk: run it again later."""


def unopened_file_error(path: Path) -> ErasureIncomplete:
    return ErasureIncomplete(
        f"the SSD tier's slot file {path}, left by an earlier start, is not open (the SSD tier "
        "is off or its directory unusable): erasures wait for a start that opens it (delete "
        "the file if the SSD tier stays off)")


class TieredStore:
    """Write-through, promote-on-hit storage of chunk-layers. Thread-safe."""

    def __init__(self, tiers: Sequence[Tier], *, promote_on_hit: bool = True) -> None:
        """`tiers` fastest first; the last is the persistent one. The store closes them."""
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.promote_on_hit = promote_on_hit
        # A slot file of KV left by an earlier start, in the SSD tier's directory, that no
        # tier has open (the tier is off, or its directory unusable): erasures cannot reach it
        self.unopened_ssd_file: Path | None = None
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self._write_down = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-write-down")

    def check_erasures_durable(self) -> None:
        """Raise `ErasureIncomplete` where removals may not have reached the disk: a slot file
        of an earlier start that no tier has open, or removed slots whose clear failed (each
        tier's `clear_slots` tries those again). The caller keeps its erasure to run again."""
        if self.unopened_ssd_file is not None:
            raise unopened_file_error(self.unopened_ssd_file)
        uncleared = {tier.name: n for tier in self.tiers if (n := tier.uncleared_slots)}
        if uncleared:
            raise ErasureIncomplete(f"removed slots whose clear on disk failed: {uncleared}")

    def put(self, key: ChunkKey, data: BytesLike, *, owner: bytes = b"") -> bool:
        """Store `data` in the fastest tier that accepts it and in the slowest tier, saved by
        `owner` (`Tier.put`).

        The slowest tier's write may finish later (see `flush`). Returns whether any tier took it.
        """
        stored = False
        for tier in self.tiers[:-1]:
            if tier.put(key, data, owner=owner):
                stored = True
                break
        return self.tiers[-1].put(key, data, owner=owner) or stored

    def put_many(self, items: Iterable[tuple[ChunkKey, BytesLike]]) -> list[bool]:
        """`put` for each (key, data), in order."""
        return [self.put(key, data) for key, data in items]

    def write_through(self, key: ChunkKey, from_tier: int = 0, *, owner: bytes = b"") -> bool:
        """Copy `key`, stored out of band in `tiers[from_tier]` (e.g. a committed host slot),
        down to the slowest tier, saved by `owner`, unless that tier holds it already. Returns
        whether the slowest tier holds it."""
        if self.tiers[-1].contains(key):
            return True
        if from_tier == len(self.tiers) - 1:
            return False
        data = self.tiers[from_tier].peek(key)
        return data is not None and self.tiers[-1].put(key, data, owner=owner)

    def owned_by(self, owner: bytes) -> set[ChunkKey]:
        """The keys any tier keeps as saved by `owner` (`Tier.owned_by`)."""
        return {key for tier in self.tiers for key in tier.owned_by(owner)}

    def write_through_later(self, keys: Sequence[ChunkKey], from_tier: int = 0, *,
                            owner: bytes = b"") -> int:
        """`write_through` the `keys` that `tiers[from_tier]` holds and the slowest tier does
        not, on a background thread; each stays pinned there until it is written. For the
        engine's scheduler thread: a BE checkpoint's 240 chunk-layers, copied there, delayed
        the step that preempted for an RT turn. Returns how many were queued."""
        if from_tier == len(self.tiers) - 1:
            return 0
        source, lowest = self.tiers[from_tier], self.tiers[-1]
        pinned = [key for key in keys if not lowest.contains(key) and source.pin(key)]
        if pinned:
            self._write_down.submit(self._write_pinned, pinned, from_tier, owner)
        return len(pinned)

    def wait_for_write_downs(self) -> None:
        """Block until the `write_through_later` calls made so far have run."""
        self._write_down.submit(lambda: None).result()

    def _write_pinned(self, keys: Sequence[ChunkKey], from_tier: int, owner: bytes) -> None:
        """Write each of `keys` through, unpinning each once written; a write that raises
        unpins the rest too (they stayed pinned for good, and the error went unseen in the
        executor's future)."""
        tier = self.tiers[from_tier]
        for index, key in enumerate(keys):
            try:
                self.write_through(key, from_tier, owner=owner)
            except BaseException as exc:
                for rest in keys[index:]:
                    tier.unpin(rest)
                if not isinstance(exc, Exception):
                    raise
                log.exception("writing %d chunks down from %s failed; %d left in it unwritten",
                              len(keys), tier.name, len(keys) - index - 1)
                return
            tier.unpin(key)

    def get(self, key: ChunkKey) -> bytes | memoryview | None:
        """The payload from the fastest tier holding `key`, or None.

        A hit below tier 0 copies the payload into the fastest faster tier that takes it
        (which may evict there, per that tier's policy), when `promote_on_hit`.
        """
        for index, tier in enumerate(self.tiers):
            # (whose it is, read first: an eviction between the two left the copy no one's)
            promote = self.promote_on_hit and index > 0
            owner = tier.owner_of(key) if promote else b""
            data = tier.get(key)
            if data is not None:
                if promote:
                    self._promote(key, data, index, owner)
                return data
        return None

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | memoryview | None]:
        return [self.get(key) for key in keys]

    def contains(self, key: ChunkKey) -> bool:
        return self.tier_of(key) is not None

    def tier_of(self, key: ChunkKey) -> int | None:
        """Index of the fastest tier holding `key`, or None."""
        for index, tier in enumerate(self.tiers):
            if tier.contains(key):
                return index
        return None

    def lookup_prefix(self, keys_by_chunk: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks have all their layers in some tier.

        `keys_by_chunk[c]` lists chunk c's keys, one per layer (`keys.chunk_keys` builds it).
        Counting stops at the first chunk with a missing layer: a later chunk is no use
        without the ones before it. Times `chunk_tokens`, this is the externally matched
        token count. Nothing is pinned: pin (or `prefetch(pin=True)`) before relying on it.
        """
        count = 0
        for layer_keys in keys_by_chunk:
            if not all(self.contains(key) for key in layer_keys):
                break
            count += 1
        return count

    def prefetch(self, keys: Sequence[ChunkKey], upto_tier: int = 0, *,
                 pin: bool = False) -> PrefetchHandle:
        """Bring `keys` into `tiers[upto_tier]` (or leave them in a faster one) in layer order,
        on the background prefetch thread; returns at once.

        With `pin`, each key is pinned where it lands; `handle.release()` unpins. Prefetches
        run one at a time in the order requested.
        """
        if not 0 <= upto_tier < len(self.tiers):
            raise ValueError(f"upto_tier {upto_tier} outside 0..{len(self.tiers) - 1}")
        handle = PrefetchHandle(keys, self.tiers, upto_tier, pin)
        self._prefetcher.submit(handle.run)
        return handle

    def remove(self, key: ChunkKey) -> bool:
        """Delete `key` from every tier that allows it (pinned copies stay); True if any went."""
        removed = [tier.remove(key) for tier in self.tiers]
        return any(removed)

    def set_hint(self, session: Hashable, prefix_hashes: Sequence[bytes],
                 likelihood: float) -> None:
        """Tell every tier's eviction policy how likely `session` is to return (0..1), e.g.
        1.0 on an advisory; `prefix_hashes` are its chunk hashes. Replaces the old hint."""
        for tier in self.tiers:
            tier.set_hint(session, prefix_hashes, likelihood)

    def clear_hint(self, session: Hashable) -> None:
        for tier in self.tiers:
            tier.clear_hint(session)

    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        """A turn stored a sequence of these chunks (prefix hashes in chunk order): every
        tier's eviction policy learns its length (the size Symphony's order drops the
        smallest of first, also of sessions no hint covers)."""
        for tier in self.tiers:
            tier.note_sequence(prefix_hashes)

    def stats(self) -> dict[str, TierStats]:
        """A snapshot of each tier's counters, by tier name, fastest first."""
        return {tier.name: tier.stats.snapshot() for tier in self.tiers}

    def flush(self) -> None:
        """Block until queued prefetches and write-downs have run and every tier's writes
        are durable."""
        self._prefetcher.submit(lambda: None).result()
        self._write_down.submit(lambda: None).result()
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Finish prefetches and writes, then close every tier."""
        self._prefetcher.shutdown(wait=True)
        self._write_down.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _promote(self, key: ChunkKey, data: bytes | memoryview, hit_index: int,
                 owner: bytes) -> None:
        for tier in self.tiers[:hit_index]:
            if tier.put(key, data, owner=owner):
                return
