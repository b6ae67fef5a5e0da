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

Not retired: a tail a checkpointed request will restore, one whose save is still in flight, and
copies pinned by a load or a prefetch (they stay until evicted). After a restart the tail index
is empty and tails are found by their exact tokens alone: a prompt that stops inside a retired
tail's covering chunk (a regenerate) then recomputes up to one chunk.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from antiphon.tiering.keys import ChunkKey, prefix_seed

if TYPE_CHECKING:
    from antiphon.tiering.plan_state import RequestState
    from antiphon.tiering.planner import TierPlanner

log = logging.getLogger(__name__)


class TailRetirement:
    def __init__(self, planner: TierPlanner) -> None:
        self._planner = planner
        self._eraser = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="antiphon-retire")

    def request_finished(self, st: RequestState, num_computed: int,
                         tail: ChunkKey | None) -> None:
        """The request `st` finished with `num_computed` known tokens, its full chunks saved
        up to `st.saved_chunks` and its own partial chunk `tail` indexed (None: none). Retire
        the tails its saves cover (lock held)."""
        p = self._planner
        chunk = p.chunk_tokens
        tokens = st.view.token_ids
        full = min(num_computed // chunk, st.saved_chunks)
        hashes = p.matcher.hashes(st, full)
        seed = prefix_seed(p.model_id, st.view.salt)
        retired: list[ChunkKey] = []
        # Chunks before the one it started computing in were stored before it: a tail they
        # cover was retired when they were saved.
        for index in range(min(st.start_tokens // chunk, full), full):
            previous = hashes[index - 1] if index else seed
            key = ChunkKey(p.model_id, hashes[index], index, 0)
            covered = p.tails.covered_by(previous, tokens[index * chunk:(index + 1) * chunk])
            covered = [c for c in covered if c != key]
            if covered and p.held(key):
                retired += covered
                p.tails.add(previous, key, tokens[index * chunk:(index + 1) * chunk],
                            st.view.session)
        if tail is not None and full == num_computed // chunk:
            previous = hashes[-1] if hashes else seed
            retired += [c for c in p.tails.covered_by(previous, tokens[full * chunk:num_computed])
                        if c != tail]
        self._retire(retired)

    def settle(self) -> None:
        """Wait until the retirements queued so far are done (call without the lock)."""
        self._eraser.submit(lambda: None).result()

    def close(self) -> None:
        self._eraser.shutdown(wait=True)

    def _retire(self, keys: Sequence[ChunkKey]) -> None:
        """Out of the tail index, and out of every tier in the background (lock held)."""
        p = self._planner
        keep = p.preemption.chunk_hashes | {c.key.prefix_hash for c in p.commits_pending()}
        keys = [key for key in keys if key.prefix_hash not in keep]
        for key in keys:
            p.tails.discard(key)
        if keys:
            self._eraser.submit(self._erase, [key.with_layer(layer) for key in keys
                                              for layer in range(p.num_layers)])

    def _erase(self, layer_keys: list[ChunkKey]) -> None:
        """Remove `layer_keys` from every tier, their slots cleared (pinned copies stay)."""
        p = self._planner
        try:
            for tier in p.store.tiers:
                clears: list[int] = []
                for key in layer_keys:
                    with p.lock:  # (as an erasure: not while the key's save is published)
                        removed, slot = tier.remove_later(key)
                        p.counters.tail_layers_retired += removed
                    clears += [] if slot is None else [slot]
                tier.clear_slots(clears)  # (may wait for the writer: not under the lock)
        except Exception:  # a tier that failed keeps its copies: a cost in room, not in KV
            log.exception("retiring %d covered chunk-layers failed", len(layer_keys))
