"""One background thread that runs prefetches in order of need, not of arrival.

A chat turn waiting in the engine goes first, then a best-effort turn (a batch item restoring
its checkpoint), each also ahead of a prefetch of lower rank already running (which stops
between keys and goes on after it); advisories follow in order of their expected
arrival (Symphony: the session expected soonest gets the bandwidth first). Each prefetch
copies its keys lowest layer first (`PrefetchHandle`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
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


class PrefetchQueue:
    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(tiers)
        self._heap: list[tuple[float, int, PrefetchHandle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._retiring: list[PrefetchHandle] = []  # stopped, their pins dropped once settled
        self._releasing = 0  # settled retired prefetches whose pins are being dropped now
        self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[ChunkKey], due: float, *, pin: bool = True,
               layer_first: bool = True) -> PrefetchHandle:
        """Bring `keys` into the fastest tier (pinned there if `pin`), after every prefetch due
        earlier, lowest layer first unless not `layer_first` (see `PrefetchHandle`); `due` is
        a `time.monotonic()` instant or `URGENT`."""
        handle = PrefetchHandle(keys, self._tiers, 0, pin, layer_first=layer_first)
        with self._cond:
            if self._closed:
                raise RuntimeError("prefetch queue is closed")
            heapq.heappush(self._heap, (due, next(self._seq), handle))
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
                due, seq, handle = heapq.heappop(self._heap)
            # A turn's fetch does not wait for an advisory's (a long context's thousands of
            # chunk-layers), nor a chat turn's for a batch item's restore: the one running
            # stops between keys and goes on after it.
            if not handle.run(None if due == URGENT else functools.partial(self._overtaken, due)):
                with self._cond:
                    if not self._closed:
                        heapq.heappush(self._heap, (due, seq, handle))
                        continue
                handle.cancel()  # closed meanwhile: settle its keys as failed
                handle.run()
            # A retired prefetch that has now settled gives its pins back at once, not at the
            # planner's next call (an idle engine makes none).
            self.reap()

    def _overtaken(self, due: float) -> bool:
        """A turn's fetch that goes before the prefetch running, due at `due`, is waiting."""
        with self._cond:
            return bool(self._heap) and self._heap[0][0] <= BACKGROUND_URGENT \
                and self._heap[0][0] < due
