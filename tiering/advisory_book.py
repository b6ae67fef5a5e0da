"""The advisories the connector holds: one per session, each the prefetch of the session's
stored KV into the host arena, pinned there until the session's turn uses it or it expires.

The pins are a soft reservation: a running turn short of host room takes them back
(`make_room`): those of lowest priority, then the advisory expected last, so advised sessions
never make a running turn recompute. An advisory's priority, then its
`expected_arrival`, orders competing prefetches (`PrefetchQueue`) and which takes the host room
of which (`make_room`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.manager import TieredStore
from antiphon.tiering.plan_state import TieringCounters
from antiphon.tiering.prefetch import PrefetchHandle
from antiphon.tiering.prefetch_queue import PrefetchQueue


@dataclasses.dataclass
class Advisory:
    session: str
    received_at: float  # time.monotonic()
    expires_at: float  # time.monotonic()
    handle: PrefetchHandle | None  # its prefetch, None once retired or with nothing to fetch
    num_tokens: int  # context tokens the tiers held when it arrived
    priority: int = 0  # higher goes first
    # time.monotonic() when its turn is expected: what orders it against others (`make_room`);
    # a renewal may bring it sooner, while its expiry only moves later
    due_at: float = 0.0
    reclaimed: bool = False  # its pins went to a running turn before the session spoke
    overtaken: bool = False  # the turn came before its prefetch was done (`overtake`)


class AdvisoryBook:
    """The live advisories, by session. Not thread-safe: the planner calls it under its
    lock."""

    def __init__(self, prefetcher: PrefetchQueue, store: TieredStore, host: HostTier,
                 counters: TieringCounters, ttl_s: float) -> None:
        self._prefetcher = prefetcher
        self._store = store
        self._host = host
        self._counters = counters
        self._ttl_s = ttl_s  # how long an advisory outlives its expected arrival (seconds)
        self._advisories: dict[str, Advisory] = {}

    def __len__(self) -> int:
        return len(self._advisories)

    def get(self, session: str) -> Advisory | None:
        return self._advisories.get(session)

    @staticmethod
    def due(expected_arrival_s: float | None) -> float:
        """When the turn of an advisory arriving now that expects it in `expected_arrival_s`
        seconds (None: now) is due (time.monotonic())."""
        return time.monotonic() + (expected_arrival_s or 0.0)

    def start(self, session: str, keys: Sequence[ChunkKey], expected_arrival_s: float | None,
              num_tokens: int, prefix_hashes: Sequence[bytes], priority: int = 0,
              pinned: Sequence[ChunkKey] = ()) -> None:
        """Record an advisory for `session` (its earlier one already released: its pins
        hold room the match needs), prefetching `keys` (chunk-layers) with `priority`, due at
        its expected arrival (seconds from now; None: now), and keeping its chunks
        (`prefix_hashes`) ahead of others' in the tiers until it is used or expires.
        `pinned`: those of `keys` its caller pinned in the fastest tier, pins it hands over."""
        now, due = time.monotonic(), self.due(expected_arrival_s)
        self._counters.advisories_received += 1
        handle = self._prefetcher.submit(keys, due, priority=priority) if keys else None
        if handle is not None:
            handle.adopt_pins(0, pinned)
        self._advisories[session] = Advisory(session, now, due + self._ttl_s, handle,
                                             num_tokens, priority, due_at=due)
        self._store.set_hint(session, prefix_hashes, 1.0)

    def renew(self, session: str, keys: Sequence[ChunkKey], expected_arrival_s: float | None,
              priority: int = 0) -> bool:
        """An advisory again for `session` whose live one prefetches every one of `keys`
        (nothing failed so far) with `priority` or higher: that one is kept, now due as the
        new one is where that is sooner (its place against others' in the host), expiring as
        the new one would (or later), and counted renewed. False (nothing changed) otherwise:
        one of higher priority goes ahead of others in the queue, and in the host, and so does
        one due sooner whose prefetch is still queued or moving (its place in the queue is
        its due's). Kept due later, a renewal expected now lost its room to one expected in a
        minute."""
        advisory = self._advisories.get(session)
        handle = None if advisory is None else advisory.handle
        due = self.due(expected_arrival_s)
        if (advisory is None or handle is None or advisory.overtaken or handle.failed_keys()
                or priority > advisory.priority
                or (due < advisory.due_at and not handle.is_done)
                or len(handle.keys) != len(keys) or set(handle.keys) != set(keys)):
            return False
        advisory.due_at = min(advisory.due_at, due)
        advisory.expires_at = max(advisory.expires_at, due + self._ttl_s)
        self._counters.advisories_renewed += 1
        return True

    def release(self, session: str) -> bool:
        """Drop the session's advisory, if any, and its prefetch; whether there was one."""
        advisory = self._advisories.pop(session, None)
        if advisory is not None and advisory.handle is not None:
            self._prefetcher.retire(advisory.handle)
        return advisory is not None

    def drop(self, session: str) -> None:
        """`release` the session's advisory unused (replaced by a newer one, or the session
        deleted): counted dropped (uncounted, received advisories added up to more than those
        used, expired and live)."""
        if self.release(session):
            self._counters.advisories_dropped += 1

    def overtake(self, session: str) -> None:
        """The session's turn came before its advised prefetch finished: that one stops, and
        the turn fetches the rest at once, ahead of every other advisory."""
        advisory = self._advisories.get(session)
        if advisory is not None and advisory.handle is not None \
                and not advisory.handle.is_done:
            # Its pins are kept until the turn has pinned its KV (`use`). (Retired here, they
            # went only once the prefetch thread reached it: a queued prefetch behind others'
            # kept them long past the turn, and a deletion meanwhile erased around them.)
            advisory.handle.cancel()
            advisory.overtaken = True

    def use(self, session: str) -> None:
        """A turn of `session` came: its advisory, if any, is used (counted, released)."""
        advisory = self._advisories.pop(session, None)
        if advisory is None:
            return
        c = self._counters
        c.advisories_used += 1
        # The turn came: the session has just spoken, and its KV is no longer kept ahead of
        # others' (it stayed so until the advisory's expiry before).
        self._store.clear_hint(advisory.session)
        if advisory.reclaimed:
            return  # its KV went back to the tiers below; the turn loaded what it needed
        if advisory.overtaken:
            c.advisories_late += 1  # (its prefetch was stopped when the turn came)
            if advisory.handle is not None:
                self._prefetcher.retire(advisory.handle)
            return
        handle = advisory.handle
        if handle is None:
            return  # nothing to prefetch: the tiers held nothing, or the host had no room
        if handle.finished_at is None:
            c.advisories_late += 1  # the turn overtook its prefetch
        elif handle.failed_keys():  # (timed, it made the lead times look good just when
            c.prefetches_failed += 1  # prefetching failed under pressure)
        else:
            c.prefetches_timed += 1
            c.prefetch_load_s_sum += handle.finished_at - advisory.received_at
            c.prefetch_lead_s_sum += time.monotonic() - handle.finished_at
        self._prefetcher.retire(handle)

    def make_room(self, num_slots: int, session: str | None, *,
                  expected_after: float | None = None, priority: int = 0) -> None:
        """Reclaim other sessions' advisory pins until `num_slots` host slots can be had:
        running turns take host room before sessions that have not spoken yet, and an
        advisory (`expected_after`: when its turn is due; `priority`: its own) from those of lower
        priority, and those as high expected after it. The lowest priority goes first, then
        the advisory expected last, whether or not its prefetch has settled (a retired one
        gives back what it has pinned at once)."""
        host = self._host
        if host.can_make_room(num_slots * host.slot_bytes):
            return
        held = sorted((a for a in self._advisories.values()
                       if a.handle is not None and a.session != session
                       and (expected_after is None or a.priority < priority
                            or (a.priority == priority and a.due_at > expected_after))),
                      key=lambda a: (-a.priority, a.due_at, a.received_at), reverse=True)
        for advisory in held:  # one sort per call, not one scan per advisory reclaimed
            assert advisory.handle is not None
            self._prefetcher.retire(advisory.handle)
            advisory.handle, advisory.reclaimed = None, True
            self._counters.advisories_reclaimed += 1
            if host.can_make_room(num_slots * host.slot_bytes):
                return

    def expire(self) -> None:
        """Drop the advisories past their time (stale: their session did not speak)."""
        self._prefetcher.reap()
        now = time.monotonic()
        for session in [s for s, a in self._advisories.items() if a.expires_at <= now]:
            self.release(session)
            self._store.clear_hint(session)
            self._counters.advisories_expired += 1
