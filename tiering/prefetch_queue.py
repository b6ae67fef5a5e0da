"""One background thread that runs prefetches in order of need, not of arrival.

A chat turn waiting in the engine goes first, then a best-effort turn (a batch item restoring
its checkpoint), each also ahead of a prefetch of lower rank already running (which stops
between keys and goes on after it); advisories follow, those of higher priority first (also
ahead of one of lower priority running: Symphony moves a prioritised session's KV at once),
then in order of their expected arrival (Symphony: the session expected soonest gets the
bandwidth first). Each prefetch copies its keys lowest layer first (`PrefetchHandle`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import sys
import threading
import time
from collections.abc import Sequence

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.prefetch import PrefetchHandle
from antiphon.tiering.tier import Tier

URGENT = float("-inf")  # the `due` of a prefetch a scheduled chat turn is waiting for
# That of one a best-effort turn waits for (a batch item's restore): after every chat turn's,
# before every advisory's.
BACKGROUND_URGENT = -sys.float_info.max
# A prefetch's place in the queue: minus its priority (a turn's: -inf), then its due.
Order = tuple[float, float]


class PrefetchQueue:
    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(tiers)
        self._heap: list[tuple[Order, int, PrefetchHandle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._retiring: list[PrefetchHandle] = []  # stopped, their pins dropped once settled
        self._releasing = 0  # settled retired prefetches whose pins are being dropped now
        self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[ChunkKey], due: float, *, priority: int = 0,
               pin: bool = True, layer_first: bool = True) -> PrefetchHandle:
        """Bring `keys` into the fastest tier (pinned there if `pin`), after every prefetch of
        higher `priority` or as high and due earlier, lowest layer first unless not
        `layer_first` (see `PrefetchHandle`); `due` is a `time.monotonic()` instant, or
        `URGENT` or `BACKGROUND_URGENT` for a turn's fetch (ahead of every advisory's, whatever
        its priority)."""
        handle = PrefetchHandle(keys, self._tiers, 0, pin, layer_first=layer_first)
        order = (-math.inf if due <= BACKGROUND_URGENT else -float(priority), due)
        with self._cond:
            if self._closed:
                raise RuntimeError("prefetch queue is closed")
            heapq.heappush(self._heap, (order, next(self._seq), handle))
            self._cond.notify()
        return handle

    def retire(self, handle: PrefetchHandle, *, release_now: bool = True) -> None:
        """Stop a prefetch and drop its pins: those taken so far at once, with `release_now`
        (a turn reclaiming an advisory's room found them held, and cut its own fetch), the
        rest once it has settled (pins taken while it still runs would otherwise leak)."""
        handle.cancel()
        if release_now:
            handle.release()
        with self._cond:
            self._retiring.append(handle)
        self.reap()

    def reap(self) -> None:
        """Drop the pins of the retired prefetches that have settled."""
        settled: list[PrefetchHandle] = []
        with self._cond:
            retiring, self._retiring = self._retiring, []
            for handle in retiring:  # each looked at once: the prefetch thread settles them
                (settled if handle.is_done else self._retiring).append(handle)
            self._releasing += len(settled)
        try:
            for handle in settled:
                handle.release()
        finally:
            with self._cond:
                self._releasing -= len(settled)
                self._cond.notify_all()

    def settle_retired(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s` seconds in all) for the prefetches retired so far to
        settle, and drop their pins: a key a stopped prefetch still holds pinned would outlive
        an erasure."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            retiring = list(self._retiring)
        for handle in retiring:
            handle.wait(max(0.0, deadline - time.monotonic()))
        self.reap()
        with self._cond:  # and those another thread's `reap` is letting go of now
            self._cond.wait_for(lambda: not self._releasing,
                                max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Cancel what has not started and stop the thread."""
        with self._cond:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cond.notify()
        for _, _, handle in pending:
            handle.cancel()
            handle.run()  # settles every key as failed: no waiter hangs
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._heap or self._closed)
                if self._closed:
                    return
                order, seq, handle = heapq.heappop(self._heap)
            # A turn's fetch does not wait for an advisory's (a long context's thousands of
            # chunk-layers), nor a chat turn's for a batch item's restore, nor an advisory's
            # for one of lower priority: the one running stops between keys and goes on after.
            if not handle.run(functools.partial(self._overtaken, order)):
                with self._cond:
                    if not self._closed:
                        heapq.heappush(self._heap, (order, seq, handle))
                        continue
                handle.cancel()  # closed meanwhile: settle its keys as failed
                handle.run()
            # A retired prefetch that has now settled gives its pins back at once, not at the
            # planner's next call (an idle engine makes none).
            self.reap()

    def _overtaken(self, running: Order) -> bool:
        """A prefetch that goes before the one running (`running`: its order) is waiting:
        a turn's, an advisory's of higher priority, or one as high due sooner (an advisory
        due now waited for the whole fetch of one due in ten minutes). Orders are fixed at
        submission, so two never stop each other in turn."""
        with self._cond:  # (and every one stops once the queue closes: a long context's
            # fetch on a slow disk held the engine's shutdown until its last key)
            return self._closed or (bool(self._heap) and self._heap[0][0] < running)
