"""Erasure of a deleted session's KV from every tier, bytes and all.

A session's KV is stored under hashes of token prefixes, never its id, so `forget` is handed
the token sequences the session ran (its chains) and erases every chunk-layer they can be
stored under (`keys.chain_hashes`), the partial chunks its replies ran on past them (the tail
index), and, for a deleted session, everything its requests saved (their owner tag, also
before a restart). It runs in a thread of its own while the engine steps on, under the
planner's lock for each decision:

    running    saves of chunks being erased that are still in flight are not published
               (`drops`), until no step is in flight
    kept       a chunk a checkpointed request will restore stays (`keep`), and so does a copy
               a running turn has pinned: that turn shares the prefix
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from antiphon.tiering.keys import ChunkKey, chain_hashes, owner_tag, prefix_hashes, prefix_seed

if TYPE_CHECKING:
    from antiphon.tiering.planner import TierPlanner


class SessionErasure:
    """The planner's erasures, running and done. Calls other than `forget` and `forgotten`
    come with the planner's lock held."""

    def __init__(self, planner: TierPlanner) -> None:
        self._planner = planner
        self._forgetting: dict[str, Future[tuple[int, int]]] = {}  # by session
        # Saves of chunks being erased, reserved before the erasure began: not published (a
        # deleted session's last turn may have copies on their way); cleared once none are.
        self._dropped: set[ChunkKey] = set()
        self._running: list[set[bytes]] = []  # the prefix hashes of each erasure running
        # sessions deleted whose erasure runs: how many of their erasures run (a delete
        # asked again runs its own)
        self._deleting: collections.Counter[str] = collections.Counter()

    def forget(self, session: str, chains: Iterable[Sequence[int]], *, salt: bytes = b"",
               keep: Iterable[Sequence[int]] | None = None) -> Future[tuple[int, int]]:
        """`session` was deleted: drop its advisory, and erase from every tier each
        chunk-layer its token sequences (`chains`, under cache salt `salt`) can be stored
        under, and each one a request of it saved, bytes and all. With `keep`, the session
        lives on and `chains` are old ones it dropped: its advisory stays, and so does each
        chunk-layer `keep` (what it still runs) can be stored under. The future resolves to
        (chunk-layers erased, kept) once every erasure is on disk; `forgotten(session)` reads
        it."""
        p = self._planner
        chains = list(chains)
        kept_chains = [] if keep is None else list(keep)
        deleted = keep is None
        done: Future[tuple[int, int]] = Future()
        with p.lock:
            if deleted:
                p.advisories.drop(session)
                p.store.clear_hint(session)
                self._deleting[session] += 1
            self._forgetting[session] = done

        def erase() -> None:
            wanted: set[bytes] = set()
            try:
                if deleted:  # a checkpoint's chunks on their way down to SSD land before
                    p.store.wait_for_write_downs()  # the owners are read
                    # and its advisory's prefetch, stopped, lets go of what it pinned: kept
                    # for it, the chunks it had brought up would stay in host RAM
                    p.settle_retired_prefetches()
                kept = chain_hashes(kept_chains, p.chunk_tokens, p.model_id, salt=salt)
                wanted = chain_hashes(chains, p.chunk_tokens, p.model_id, salt=salt) - kept
                ends = self._chain_ends(chains, salt)
                with p.lock:
                    # and the partial chunks computed past where the session's tokens go (a
                    # reply a stop string ended or a cancel ran on in the engine), no chain's
                    # hash names, as far as this run knows them (`TailIndex`)
                    wanted |= self._run_on_tails(session, ends, wanted, deleted=deleted) - kept
                    if deleted:  # and what its requests saved, also before a restart
                        wanted |= self._owned_by(owner_tag(session))
                    p.tails.discard_hashes(wanted)
                    # Chunks a checkpointed request will restore stay, now and until the
                    # erasure is done (`TierPlanner.checkpoint` calls `keep`).
                    wanted -= p.preemption.chunk_hashes
                    self._running.append(wanted)
                    # saves of them reserved now are dropped, not published; not those
                    # reserved later, other sessions' sharing the prefix (taken by hash, they
                    # were dropped for as long as a step with copies was in flight)
                    self._dropped |= {c.key for c in p.commits_pending()
                                      if c.key.prefix_hash in wanted}
                # and a checkpoint's chunks a step published since the wait above, on their
                # way down to SSD (pinned in the host tier, not on SSD yet): both copies
                # would have been missed. Published from now on, they are dropped.
                p.store.wait_for_write_downs()
                done.set_result(self._erase(wanted))
            except BaseException as exc:
                done.set_exception(exc)
            finally:
                with p.lock:  # this erasure's own set: another may equal it
                    self._running = [w for w in self._running if w is not wanted]
                    if deleted:  # (a window's erasure of the same session leaves it alone)
                        self._deleting[session] -= 1
                        if not self._deleting[session]:
                            del self._deleting[session]
        threading.Thread(target=erase, name="antiphon-forget", daemon=True).start()
        return done

    def is_deleting(self, session: str) -> bool:
        """Whether `session` was deleted and its erasure still runs (lock held)."""
        return session in self._deleting

    def forgotten(self, session: str) -> tuple[int, int] | None:
        """What `forget(session)` erased and kept, once it is done (None until then; (0, 0)
        for a session it was not asked to forget). Raises what the erasure raised."""
        with self._planner.lock:
            done = self._forgetting.get(session)
            if done is None:
                return 0, 0
            if not done.done():
                return None
            del self._forgetting[session]
        return done.result()

    def keep(self, prefix_hashes: set[bytes]) -> None:
        """A request was checkpointed onto these chunks: out of every erasure running."""
        self._dropped = {key for key in self._dropped if key.prefix_hash not in prefix_hashes}
        for wanted in self._running:
            wanted -= prefix_hashes

    def drops(self, key: ChunkKey) -> bool:
        """Whether this save, now done, must not be published (reserved before an erasure
        of its chunk took stock); asked once per save."""
        if key in self._dropped:
            self._dropped.discard(key)
            return True
        return False

    def settle(self) -> None:
        """No save is in flight any more: none is left to drop."""
        self._dropped.clear()

    def _erase(self, wanted: set[bytes]) -> tuple[int, int]:
        """Remove each chunk-layer in `wanted` from every tier. `wanted` shrinks meanwhile (a
        request checkpointed now keeps its chunks): each is looked at again under the lock."""
        p = self._planner
        erased = kept = 0
        for tier in p.store.tiers:  # a scan of each index beats probing every layer of
            stored = tier.keys()  # up to 127 partial lengths per chunk (a snapshot: removes
            # go on under it). Clears on disk are queued after the lock is let go: a full
            # writer queue blocks, and the engine's steps wait for the lock.
            clears: list[int] = []
            for key in stored:
                if key.prefix_hash not in wanted:
                    continue
                with p.lock:
                    if key.prefix_hash not in wanted:
                        continue
                    removed, slot = tier.remove_later(key)
                clears += [] if slot is None else [slot]
                if removed:
                    erased += 1
                else:
                    kept += 1
            tier.clear_slots(clears)
        for tier in p.store.tiers:
            # its queued erasures, on disk (on the device: a power loss must not bring the
            # records back, whether or not every write is synced, `ssd_fsync`)
            tier.barrier(sync=True).result()
        with p.lock:
            p.counters.chunk_layers_forgotten += erased
        p.store.check_erasures_durable()
        return erased, kept

    def _chain_ends(self, chains: Iterable[Sequence[int]], salt: bytes
                    ) -> list[tuple[bytes, Sequence[int]]]:
        """(the hash of its full chunks, its tokens after them) of each of `chains`."""
        p = self._planner
        ends = []
        for tokens in chains:
            hashes = prefix_hashes(tokens, p.chunk_tokens, p.model_id, salt=salt)
            previous = hashes[-1] if hashes else prefix_seed(p.model_id, salt)
            ends.append((previous, tokens[len(hashes) * p.chunk_tokens:]))
        return ends

    def _run_on_tails(self, session: str, ends: Iterable[tuple[bytes, Sequence[int]]],
                      erased: set[bytes], *, deleted: bool) -> set[bytes]:
        """The prefix hashes of the partial chunks saved in this run that run on past one of
        the chain ends `ends` (`_chain_ends`), or continue a full chunk in `erased` (which no
        turn can then reach), or, for a `deleted` session, that a request of it saved."""
        tails = self._planner.tails
        found = {key.prefix_hash for previous, rest in ends
                 for key in tails.extending(previous, rest)}
        found.update(key.prefix_hash for key in tails.after(erased))
        if deleted:
            found.update(key.prefix_hash for key in tails.of_session(session))
        return found

    def _owned_by(self, owner: bytes) -> set[bytes]:
        """The prefix hashes of the chunk-layers a tier keeps as saved by `owner`, and of those
        in flight to it (lock held): the KV a deleted session's requests computed, including
        what ran on past everything its chains name (a full chunk a reply's run-on filled, a
        tail saved before a restart, whose tokens the tail index no longer has)."""
        p = self._planner
        found = {key.prefix_hash for key in p.store.owned_by(owner)}
        return found | {c.key.prefix_hash for c in p.commits_pending() if c.owner == owner}
