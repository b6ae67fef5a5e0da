"""Partial chunks a later save covers, taken out of the tiers.

Every turn that ends inside a chunk saves that partial chunk (its tail), so that the follow-up
turn, whose prompt extends it, recomputes almost nothing. Once the follow-up has run, its own
saves hold the same KV: the full chunk it filled past the tail, or its own longer tail.

    turn k      | chunk 0 | T1 |                 T1 = turn k's tail
    turn k+1    | chunk 0 | chunk 1     | T2 |    chunk 1 begins with T1's tokens

Kept, the stale tails took a whole slot per layer each (a 6-token tail as much as a full
chunk): a soak of multi-turn chats stored three chunk-layers for each one a conversation held,
and the host tier filled three times as fast. A tail is retired when the request that finishes
saved a chunk whose tokens begin with all of the tail's (`TailIndex.covered_by`): it leaves the
tail index, and its chunk-layers leave every tier in the background, their bytes cleared as a
deleted session's are. A full chunk that covers a tail joins the tail index in its place, so a
prompt that shares only part of it (a regenerate of the turn that filled it) still finds that
part in this run.

A tail retires only once the save that covers it has landed (a failed copy step keeps it), and a
tail the lowest tier holds (a session's, written through to SSD) only if that tier holds the cover
too (not a save of BE work, nor one the SSD tier refused). Known gap: an SSD write of the cover
that fails after the tier took it (a disk error) leaves that KV in host RAM alone. The covering
full chunk in the tail index is no partial chunk a session ran on into: deleting a session whose
tokens it begins with does not erase it. A copy a pin keeps (an advisory's prefetch) is erased once
let go. Not retired, and not looked at again: a tail a checkpointed request will restore, one being
saved again, and a tail saved after the chunk that covers it. After a restart the tail index is
empty and tails are found by their exact tokens alone: a prompt that stops inside a retired tail's
covering chunk (a regenerate) then recomputes up to one chunk.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from antiphon.tiering.keys import ChunkKey, prefix_seed

if TYPE_CHECKING:
    from antiphon.tiering.plan_state import RequestState
    from antiphon.tiering.planner import TierPlanner

log = logging.getLogger(__name__)


class _Cover(NamedTuple):
    """A save that covers partial chunks, waiting to land before they retire."""

    cover: ChunkKey  # its layer-0 key
    previous: bytes  # the chain it continues
    chunk_ids: Sequence[int] | None  # its tokens, where it is a full chunk (joins the index)
    session: str | None
    covered: list[ChunkKey]  # the partial chunks it covers


class TailRetirement:
    """The planner's retirements: waiting for their covering saves, then running. Called with
    the planner's lock held, but for `settle` and `close`."""

    def __init__(self, planner: TierPlanner) -> None:
        self._planner = planner
        self._waiting: list[_Cover] = []  # covering saves not yet known to have landed
        # Retired tails whose copies a pin kept (an advisory's prefetch of a conversation
        # that still ends in the tail: a user typing while the follow-up streams), by tier
        # index: erased once let go (`step_done`).
        self._deferred: dict[ChunkKey, set[int]] = {}
        self._eraser = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="antiphon-retire")

    def request_finished(self, st: RequestState, num_computed: int,
                         tail: ChunkKey | None) -> None:
        """The request `st` finished with `num_computed` known tokens, its full chunks saved
        up to `st.saved_chunks` and its own partial chunk `tail` indexed (None: none): the
        tails its saves cover retire once those saves have landed."""
        p = self._planner
        chunk = p.chunk_tokens
        tokens = st.view.token_ids
        full = min(num_computed // chunk, st.saved_chunks)
        hashes = p.matcher.hashes(st, full)
        seed = prefix_seed(p.model_id, st.view.salt)
        # Chunks before the one it started computing in were stored before it: a tail they
        # cover was retired when they were saved.
        for index in range(min(st.start_tokens // chunk, full), full):
            previous = hashes[index - 1] if index else seed
            key = ChunkKey(p.model_id, hashes[index], index, 0)
            chunk_ids = tokens[index * chunk:(index + 1) * chunk]
            covered = [c for c in p.tails.covered_by(previous, chunk_ids) if c != key]
            if covered:
                self._waiting.append(_Cover(key, previous, chunk_ids, st.view.session, covered))
        if tail is not None and full == num_computed // chunk:
            previous = hashes[-1] if hashes else seed
            covered = [c for c in p.tails.covered_by(previous, tokens[full * chunk:num_computed])
                       if c != tail]
            if covered:
                self._waiting.append(_Cover(tail, previous, None, st.view.session, covered))
        self._settle_waiting()

    def step_done(self) -> None:
        """Retire the tails whose covering saves have landed in the tiers; forget those whose
        covering save failed or was dropped (the tails stay). Erase the copies of retired
        tails that pins have let go of since."""
        if self._deferred:
            self._erase_deferred()
        if self._waiting:
            self._settle_waiting()

    def _settle_waiting(self) -> None:
        p = self._planner
        waiting, self._waiting = self._waiting, []
        for entry in waiting:
            layers = [entry.cover.with_layer(layer) for layer in range(p.num_layers)]
            if any(p.host.is_reserved(key) for key in layers):
                self._waiting.append(entry)  # its copy is still on its way
            elif all(p.store.contains(key) for key in layers):
                self._retire(entry)

    def settle(self) -> None:
        """Wait until the erasures queued so far are done (call without the lock)."""
        self._eraser.submit(lambda: None).result()

    def close(self) -> None:
        self._eraser.shutdown(wait=True)

    def _retire(self, entry: _Cover) -> None:
        """Out of the tail index, then out of every tier in the background; a full chunk
        that covers them takes their place in the index. A tail the lowest tier holds (the
        SSD tier's copy of a session's) stays unless that tier holds the cover too: a save of
        BE work, or one the SSD tier refused, stays above it."""
        p = self._planner
        cover = entry.cover
        lowest = p.store.tiers[-1]

        def in_lowest(key: ChunkKey) -> bool:
            return any(lowest.contains(key.with_layer(layer)) for layer in range(p.num_layers))

        cover_below = all(lowest.contains(cover.with_layer(layer))
                          for layer in range(p.num_layers))
        covered = [key for key in entry.covered if key in p.tails and not self._is_kept(key)
                   and (cover_below or not in_lowest(key))]
        for key in covered:
            p.tails.discard(key)
        if entry.chunk_ids is not None and covered:  # (after the discards: the chain has room)
            p.tails.add(entry.previous, cover, entry.chunk_ids, entry.session, is_full=True)
        if covered:
            self._eraser.submit(self._erase, covered)

    def _is_kept(self, tail: ChunkKey) -> bool:
        """No retirement may erase `tail` now: a checkpoint will restore it, or it is being
        saved (again)."""
        p = self._planner
        return tail.prefix_hash in p.preemption.chunk_hashes or p.is_saving(tail.prefix_hash)

    def _erase(self, tails: list[ChunkKey]) -> None:
        """Remove every layer of `tails` from every tier, their slots cleared (pinned copies
        stay). Each is looked at again under the lock: since it was retired, a checkpoint
        may have been handed it, or a request saved it again."""
        p = self._planner
        try:
            for index, tier in enumerate(p.store.tiers):
                clears: list[int] = []
                for tail in tails:
                    with p.lock:
                        clears += self._remove(tail, index)
                tier.clear_slots(clears)  # (may wait for the writer: not under the lock)
        except Exception:  # a tier that failed keeps its copies: a cost in room, not in KV
            log.exception("retiring %d covered partial chunks failed", len(tails))

    def _remove(self, tail: ChunkKey, index: int) -> list[int]:
        """Remove every layer of `tail` from tier `index` (lock held), unless it is back in
        the tail index (saved again since it retired) or kept; a layer a pin keeps is left
        to `_erase_deferred`. Returns the slots to clear."""
        p = self._planner
        tier = p.store.tiers[index]
        if tail in p.tails or self._is_kept(tail):
            self._deferred.pop(tail, None)
            return []
        clears = []
        for layer in range(p.num_layers):
            key = tail.with_layer(layer)
            removed, slot = tier.remove_later(key)
            p.counters.tail_layers_retired += removed
            clears += [] if slot is None else [slot]
            if not removed and tier.contains(key):  # pinned
                self._deferred.setdefault(tail, set()).add(index)
        return clears

    def _erase_deferred(self) -> None:
        """Try again the removals pins refused (lock held); slots are cleared in the
        background."""
        p = self._planner
        clears: dict[int, list[int]] = {}
        for tail, indexes in list(self._deferred.items()):
            del self._deferred[tail]
            for index in indexes:
                clears.setdefault(index, []).extend(self._remove(tail, index))
        for index, slots in clears.items():
            if slots:
                self._eraser.submit(p.store.tiers[index].clear_slots, slots)
