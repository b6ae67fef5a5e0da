"""Layer-order prefetch: bring chunk-layers up to a faster tier, layer 0 of every chunk first.

    requested: chunks 0..2, layers 0..L-1
    order:     (c0,l0) (c1,l0) (c2,l0) | (c0,l1) (c1,l1) (c2,l1) | ... | (c2,l(L-1))
               '---- layer 0 ready ----'

A turn can start once its first layers are up: `wait_layer(0)` returns while later layers are
still moving. The copying runs on the manager's prefetch thread; `PrefetchHandle` is how the
caller watches it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.tier import Tier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LayerProgress:
    """Where one layer of a prefetch stands (counts of chunk-layers)."""

    layer: int
    num_keys: int  # chunk-layers requested at this layer
    num_ready: int = 0  # in the target tier or a faster one (and pinned, if asked)
    num_failed: int = 0  # in no tier, refused for room, or cancelled

    @property
    def is_settled(self) -> bool:
        """Nothing more will happen to this layer."""
        return self.num_ready + self.num_failed == self.num_keys

    @property
    def is_ready(self) -> bool:
        return self.num_ready == self.num_keys


class PrefetchHandle:
    """Progress of one prefetch; thread-safe. `release()` drops the pins it took."""

    def __init__(self, keys: Sequence[ChunkKey], tiers: Sequence[Tier], upto_tier: int,
                 pin: bool, *, layer_first: bool = True) -> None:
        # The copy order: layer 0 of every chunk first, or (`layer_first=False`) whole chunks
        # in order, so that a fetch the target's room cuts short still leaves leading chunks
        # whole (what a turn that waits for all of it can use).
        self.keys = sorted(keys, key=(lambda k: (k.layer, k.chunk_index)) if layer_first
                           else (lambda k: (k.chunk_index, k.layer)))
        self.upto_tier = upto_tier
        self.pin = pin
        self._tiers = tiers
        self._cond = threading.Condition()
        self._progress = {layer: LayerProgress(layer, 0) for layer in
                          sorted({k.layer for k in self.keys})}
        for key in self.keys:
            self._progress[key.layer].num_keys += 1
        self._failed: list[ChunkKey] = []
        self._pinned: list[tuple[int, ChunkKey]] = []  # (tier index, key) pins held
        self._num_settled = 0
        self._next = 0  # the next key `run` copies
        self._cancelled = False
        self.created_at = time.monotonic()
        self.finished_at: float | None = None if self.keys else self.created_at  # all settled

    def progress(self) -> list[LayerProgress]:
        """A snapshot per requested layer, in layer order."""
        with self._cond:
            return [dataclasses.replace(p) for p in self._progress.values()]

    def num_ready_layers(self) -> int:
        """How many leading requested layers are fully ready."""
        with self._cond:
            count = 0
            for p in self._progress.values():
                if not p.is_ready:
                    break
                count += 1
            return count

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> bool:
        """Block until `layer` is settled (at most `timeout_s` seconds); True if it is ready.

        A layer that was not requested is trivially ready.
        """
        with self._cond:
            progress = self._progress.get(layer)
            if progress is None:
                return True
            self._cond.wait_for(lambda: progress.is_settled, timeout_s)
            return progress.is_ready

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every key is settled (at most `timeout_s` seconds); True if all ready."""
        with self._cond:
            self._cond.wait_for(lambda: self._num_settled == len(self.keys), timeout_s)
            return self._num_settled == len(self.keys) and not self._failed

    @property
    def is_done(self) -> bool:
        with self._cond:
            return self._num_settled == len(self.keys)

    def failed_keys(self) -> list[ChunkKey]:
        with self._cond:
            return list(self._failed)

    def cancel(self) -> None:
        """Stop after the key being copied; the rest count as failed."""
        with self._cond:
            self._cancelled = True

    def adopt_pins(self, tier_index: int, keys: Sequence[ChunkKey]) -> None:
        """Hold pins its caller took on `keys` in tier `tier_index`: `release` drops them
        with its own."""
        with self._cond:
            self._pinned.extend((tier_index, key) for key in keys)

    def release(self) -> None:
        """Unpin everything this prefetch pinned (call once the loader is done with it)."""
        with self._cond:
            pinned, self._pinned = self._pinned, []
        for tier_index, key in pinned:
            self._tiers[tier_index].unpin(key)

    def run(self, should_yield: Callable[[], bool] | None = None) -> bool:
        """Copy the keys up, in layer order (the prefetch thread calls this); True once every
        key is settled. Between keys, `should_yield()` true stops it early (False): a later
        `run` goes on from the next key."""
        while self._next < len(self.keys):
            with self._cond:
                cancelled = self._cancelled
            # (a cancelled one settles at once: yielding, it went back on the queue, and
            # held its pins until whatever it yielded to was done)
            if not cancelled and should_yield is not None and should_yield():
                return False
            key = self.keys[self._next]
            self._next += 1
            try:
                tier_index = None if cancelled else self._bring_up(key)
            except Exception:  # settle the key anyway: a waiter must never hang
                log.exception("prefetch of %s failed", key)
                tier_index = None
            with self._cond:
                progress = self._progress[key.layer]
                if tier_index is None:
                    progress.num_failed += 1
                    self._failed.append(key)
                else:
                    progress.num_ready += 1
                    if self.pin:
                        self._pinned.append((tier_index, key))
                self._num_settled += 1
                if self._num_settled == len(self.keys):
                    self.finished_at = time.monotonic()
                self._cond.notify_all()
        return True

    def _bring_up(self, key: ChunkKey) -> int | None:
        """Index of the tier (<= upto_tier) now holding `key`, pinned if asked; None if failed."""
        for index in range(self.upto_tier + 1):
            tier = self._tiers[index]
            if tier.pin(key) if self.pin else tier.contains(key):
                return index
        for lower in self._tiers[self.upto_tier + 1:]:
            # (kept, an erasure finds the copy too; read first: an eviction between the two
            # left the copy no one's)
            owner = lower.owner_of(key)
            data = lower.get(key)  # a hit of the lower tier: the chunk is being used
            if data is not None:
                target = self._tiers[self.upto_tier]
                return self.upto_tier if target.put(key, data, pin=self.pin,
                                                    owner=owner) else None
        return None
