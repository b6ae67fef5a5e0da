"""The connector's scheduler side: which KV a turn can load, which it must save, and advisories.

It runs in vLLM's EngineCore process and owns the tier store (the host tier's index and slot
allocator, the SSD tier). Per engine step:

    admission  `num_new_matched_tokens`: the longest prefix of the prompt the tiers hold (full
               chunks, then the partial chunk a previous turn ended with). Chunks only on SSD are
               prefetched into the host arena first, and the turn waits (None) until they land.
               The host slots are pinned so they stay put until the worker has copied them.
    allocate   `plan_load`: after vLLM gave the turn pages, each matched page becomes a copy
               slot -> device block, done layer by layer under the forward pass.
    step       `build_metadata`: every chunk that this step completes gets host slots reserved
               and a copy device -> slot after each layer's attention (`save_kv_layer`).
    output     `step_done`: saved slots are published and written through to SSD; load pins
               are dropped.
    finish     `request_finished`: the partial last chunk is copied too (vLLM holds the pages
               until the worker reports it sent), so a follow-up turn recomputes almost nothing.

Advisories (`advise`) run the same match for a session's context before its turn arrives and
prefetch into the host arena, pinned until the turn uses them or they expire. Those pins are a
soft reservation: when a turn's load or a save finds the arena full of pins, the advisory
expected last gives its pins up first (`AdvisoryBook.make_room`), so advised sessions never
make a running turn recompute.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from antiphon.tiering.advisory_book import AdvisoryBook
from antiphon.tiering.build import build_tiered_store
from antiphon.tiering.config import TieringConfig
from antiphon.tiering.connector_meta import NO_SLOT, PageCopy, TieringMetadata
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.keys import (
    ChunkKey,
    chain_hashes,
    continue_prefix_hashes,
    owner_tag,
    prefix_hashes,
    prefix_seed,
    tail_hashes,
)
from antiphon.tiering.plan_state import (
    Checkpoint,
    RequestState,
    SlotCommit,
    StepInFlight,
    StoredMatch,
    TieringCounters,
    TokenView,
    known_tokens,
)
from antiphon.tiering.prefetch_queue import URGENT, PrefetchQueue
from antiphon.tiering.tails import TailIndex

log = logging.getLogger(__name__)

# Fetches from SSD one turn waits for before it takes what the host holds and recomputes the
# rest (a fetch can lose its host room to others after it starts).
MAX_FETCH_ATTEMPTS = 3


class TierPlanner:
    """Scheduler-side state of the KV connector. Thread-safe for `advise` and `stats` (called
    from EngineCore utility calls) against the scheduler's own calls."""

    def __init__(self, config: TieringConfig, *, model_id: str, num_layers: int,
                 page_bytes: int, block_ids_of: Any) -> None:
        """`block_ids_of(request_id)` returns the request's device pages (vLLM's KV manager)."""
        self.config = config
        self.model_id = model_id
        self.num_layers = num_layers
        self.chunk_tokens = config.chunk_tokens
        self.page_tokens = config.page_tokens
        self.pages_per_chunk = config.pages_per_chunk
        self.store = build_tiered_store(config, slot_bytes=page_bytes * self.pages_per_chunk,
                                        model_id=model_id)
        host = self.store.tiers[0]
        if not isinstance(host, HostTier):
            raise ValueError("the KV connector needs the host tier (host_tier_bytes > 0): the "
                             "worker moves KV through it")
        self.host = host
        self._block_ids_of = block_ids_of
        self._prefetcher = PrefetchQueue(self.store.tiers)
        self._lock = threading.RLock()
        self._requests: dict[str, RequestState] = {}
        self._step = 0
        self._pending_loads: list[PageCopy] = []
        self._pending_early: list[PageCopy] = []
        self._pending_load_pins: list[ChunkKey] = []
        self._final_saves: dict[str, list[PageCopy]] = {}
        self._final_keys: list[SlotCommit] = []  # as `StepInFlight.commits`
        self._in_flight: dict[int, StepInFlight] = {}
        self._pending_checkpoints: list[PageCopy] = []
        self._checkpoints: dict[str, Checkpoint] = {}  # the preemption table
        # Checkpointed chunks' keys a tier evicted (only when nothing without a hint was left
        # to evict), noted by the evicting thread, settled under the lock (`_settle_evictions`)
        self._checkpointed: set[bytes] = set()  # the prefix hashes of the table's chunks
        self._evicted: collections.deque[ChunkKey] = collections.deque()
        self._forgetting: dict[str, Future[tuple[int, int]]] = {}  # deleted sessions' erasures
        # Chunks being forgotten: saves of them still in flight are not published (a deleted
        # session's last turn may have copies on their way); cleared once none are.
        self._forgotten_chunks: set[bytes] = set()
        self._erasing: list[set[bytes]] = []  # the prefix hashes of each erasure running
        self._tails = TailIndex(config.tail_index_entries)  # the tokens of tails saved
        self.counters = TieringCounters()
        self.advisories = AdvisoryBook(self._prefetcher, self.store, host, self.counters,
                                       config.advisory_ttl_s)
        for tier in self.store.tiers:
            tier.on_evict = self._note_evicted

    @property
    def arena_name(self) -> str:
        return self.host.arena.name

    # -- admission ---------------------------------------------------------------------------

    def add_request(self, view: TokenView) -> None:
        with self._lock:
            self._requests.setdefault(view.request_id, RequestState(view))

    def num_new_matched_tokens(self, view: TokenView, num_computed: int) -> int | None:
        """Tokens beyond `num_computed` (vLLM's device hit) the tiers can supply now, or None
        while a prefetch this turn needs is still moving."""
        with self._lock:
            self.advisories.expire()
            st = self._requests.setdefault(view.request_id, RequestState(view))
            st.view = view
            self.advisories.overtake(view.session or "")
            if st.prefetch is not None and not st.prefetch.is_done:
                return None
            checkpoint = self._checkpoints.get(view.request_id)
            if checkpoint is not None and any(self.host.is_reserved(key)
                                              for key in reversed(checkpoint.chunks)):
                # Its newest pages are still on their way to the host tier (with async
                # scheduling the preempting step is still running): matched now, it would
                # recompute them. It waits a step.
                return None
            if st.match is not None and st.admitted == (len(view.token_ids), num_computed):
                # Asked again because vLLM had no pages for the turn last step: its pins still
                # hold the match, so the answer stands (matching and pinning a 32k-token
                # context again cost 0.1 s a step).
                return st.match.num_tokens - num_computed
            st.admitted = None
            matched = self._admit_again(st, view, num_computed)
            if matched is not None:
                self._note_admitted(st, view, num_computed, matched)
                return matched
            # `_admit` just sent an SSD fetch for this turn. Only a chat turn waits for it:
            # the step's RT streams must not wait for BE work's restore.
            assert st.prefetch is not None
            is_first_fetch = st.fetch_attempts == 1
            wait_s = 0.0 if view.background else self.config.ssd_fetch_wait_s
            if wait_s > 0 and st.prefetch.wait(wait_s):
                # Up within the wait: the turn runs in this step instead of the next (a step
                # on 2 cores is 25-50 ms; a 400-token context comes up from SSD in a few).
                # The prefetch thread takes no planner lock.
                matched = self._admit_again(st, view, num_computed)
            if is_first_fetch:
                if matched is None:
                    self.counters.turns_held += 1
                else:
                    self.counters.turns_fetched_in_step += 1
            self._note_admitted(st, view, num_computed, matched)
            return matched

    @staticmethod
    def _note_admitted(st: RequestState, view: TokenView, num_computed: int,
                       matched: int | None) -> None:
        if matched and st.match is not None:
            st.admitted = (len(view.token_ids), num_computed)

    def _admit_again(self, st: RequestState, view: TokenView, num_computed: int) -> int | None:
        """`_admit`, with the pins of an earlier admission set aside until it is done."""
        held, st.pins, st.match = st.pins, [], None
        try:
            return self._admit(st, view, num_computed)
        finally:
            for key in held:  # released only now: re-pinned keys never leave in between
                self.host.unpin(key)

    def _admit(self, st: RequestState, view: TokenView, num_computed: int) -> int | None:
        """`num_new_matched_tokens` once no prefetch is pending and old pins are set aside."""
        st.local_tokens = num_computed
        match = self._match(view.token_ids, len(view.token_ids) - 1, view.salt, st)
        first_chunk = num_computed // self.chunk_tokens
        if match.num_tokens <= num_computed:
            self._drop_prefetch(st)
            self._use_advisory(st)
            return 0
        wanted = match.layer_keys(first_chunk)
        absent = [key for key in wanted if not self.host.contains(key)]
        missing = set(absent)
        if missing and self._fetch_again(st, missing):
            # Hold what host memory has while the rest comes up from SSD: the prefetch's own
            # puts must not evict it.
            st.pins = [key for key in wanted if key not in missing and self.host.pin(key)]
            self._drop_prefetch(st)
            st.fetch_attempts += 1
            self.advisories.make_room(len(absent), view.session)
            absent = self._leading_chunks_with_room(absent)
            if absent:
                st.ssd_chunks |= {key.chunk_index for key in absent}
                # Whole chunks in order: the turn waits for all of it, so lower layers first
                # would gain nothing, and would leave no chunk whole if other fetches took the
                # host room meanwhile.
                st.prefetch = self._prefetcher.submit(absent, URGENT, layer_first=False)
                if st.fetch_attempts > 1:
                    self.counters.fetch_retries += 1
                return None
            # No host room for even the first missing chunk: what the host holds before it
            # is loaded below, the rest recomputed.
        num_tokens = self._pin_chunks(st, match, first_chunk)
        if num_tokens < match.num_tokens:
            log.debug("turn %s: host room for %d of %d matched tokens", view.request_id,
                      num_tokens, match.num_tokens)
        self._drop_prefetch(st)
        self._use_advisory(st)
        if num_tokens <= num_computed:
            self._unpin(st)
            return 0
        return num_tokens - num_computed

    def stored_prefix_tokens(self, view: TokenView) -> int:
        """Tokens of a waiting request the tiers hold (looked up again only when the request
        grew, e.g. preempted after more output): what a scheduling policy can count as not to be
        computed. An estimate; admission decides."""
        with self._lock:
            st = self._requests.setdefault(view.request_id, RequestState(view))
            num_tokens = len(view.token_ids)
            if st.stored_tokens is None or st.stored_tokens[0] != num_tokens:
                st.view = view
                st.stored_tokens = (num_tokens, self._match(view.token_ids, num_tokens - 1,
                                                            view.salt, st).num_tokens)
            return st.stored_tokens[1]

    def plan_load(self, request_id: str, block_ids: Sequence[int], num_external: int,
                  num_tokens: int) -> None:
        """vLLM gave the turn its pages: copy the matched ones in during the next step."""
        with self._lock:
            st = self._requests.get(request_id)
            if st is None:
                return
            self._count_admission(st, num_external, num_tokens)
            if self._drop_checkpoint(request_id):
                self.counters.restores += 1
                self.counters.pages_restored += -(-(st.local_tokens + num_external)
                                                  // self.page_tokens) - st.local_tokens \
                    // self.page_tokens
            if num_external == 0 or st.match is None:
                self._unpin(st)
                return
            start, end = st.local_tokens, st.local_tokens + num_external
            first_page = start // self.page_tokens
            end_page = -(-end // self.page_tokens)
            for index in range(first_page // self.pages_per_chunk,
                               -(-end_page // self.pages_per_chunk)):
                key = st.match.chunks[index]
                chunk_first = index * self.pages_per_chunk
                pages = range(max(first_page, chunk_first),
                              min(end_page, chunk_first + self.pages_per_chunk))
                slots = tuple(self._slot(key.with_layer(layer))
                              for layer in range(self.num_layers))
                whole = pages
                if pages.stop == end_page and end % self.page_tokens:
                    whole = pages[:-1]
                    self._pending_early.append(PageCopy((block_ids[pages[-1]],), slots,
                                                        pages[-1] - chunk_first))
                if whole:
                    self._pending_loads.append(PageCopy(tuple(block_ids[p] for p in whole),
                                                        slots, whole.start - chunk_first))
            self._pending_load_pins.extend(st.pins)
            st.pins = []
            st.match = None

    # -- steps -------------------------------------------------------------------------------

    def build_metadata(self, scheduled: Sequence[tuple[str, int]]) -> TieringMetadata:
        """This step's copies; `scheduled` is (request id, tokens computed once the step ran)."""
        with self._lock:
            self._settle_evictions()
            meta = TieringMetadata(self._step, self.arena_name, self._pending_loads,
                                   self._pending_early, checkpoints=self._pending_checkpoints)
            self._pending_checkpoints = []
            in_flight = StepInFlight(pins=self._pending_load_pins)
            self._pending_loads, self._pending_early, self._pending_load_pins = [], [], []
            for request_id, num_done in scheduled:
                st = self._requests.get(request_id)
                if st is not None:
                    self._plan_saves(st, num_done, meta, in_flight)
            meta.final_saves, self._final_saves = self._final_saves, {}
            in_flight.commits.extend(self._final_keys)
            self._final_keys = []
            if meta.has_work:
                self._in_flight[meta.step] = in_flight
            self._step += 1
            return meta

    def step_done(self, done_steps: set[int], failed_steps: set[int]) -> None:
        """The worker finished these steps' copies: publish saves, drop load pins."""
        with self._lock:
            for step in sorted(done_steps | failed_steps):
                in_flight = self._in_flight.pop(step, None)
                if in_flight is None:
                    continue
                self.counters.copy_steps_failed += step in failed_steps
                for key in in_flight.pins:
                    self.host.unpin(key)
                for key, durable, owner in in_flight.commits:
                    if key.prefix_hash in self._forgotten_chunks:
                        self.host.abort(key, erase=True)
                    elif step in failed_steps:
                        self.host.abort(key)
                    elif durable:
                        # Pinned until it is on SSD: published unpinned, a put from the
                        # prefetch thread could evict it first, and a checkpoint's only copy
                        # of a BE tail was gone though the SSD tier had room.
                        if self.host.commit(key, pin=True):
                            try:
                                self.store.write_through(key, owner=owner)
                            finally:
                                self.host.unpin(key)
                    else:
                        self.host.commit(key)
            if not (self._in_flight or self._final_keys):
                self._forgotten_chunks.clear()

    def has_steps_in_flight(self) -> bool:
        """Steps whose copies the worker has yet to report done (their load pins and saves
        settle only once it does: the engine must step on, idle or not)."""
        with self._lock:
            return bool(self._in_flight)

    def served_from(self, request_id: str) -> tuple[int, int] | None:
        """(host, SSD) prompt tokens the request's first admission loaded from the tiers
        (those from SSD came up through the host arena); None for a request not admitted."""
        with self._lock:
            st = self._requests.get(request_id)
            return None if st is None else st.first_loads

    def request_finished(self, request_id: str, num_computed: int,
                         block_ids: Sequence[int]) -> bool:
        """The request is done; True if its last partial chunk is being saved (vLLM must keep
        its pages until the worker reports the request sent)."""
        with self._lock:
            st = self._requests.pop(request_id, None)
            self._drop_checkpoint(request_id)
            if st is None:
                return False
            self._unpin(st)
            self._drop_prefetch(st)
            num_computed = known_tokens(st, num_computed)
            full = num_computed // self.chunk_tokens
            if num_computed == full * self.chunk_tokens or st.saved_chunks != full:
                return False  # nothing partial, or the full chunks were not all saved
            tail = self._tail_key(st, num_computed)
            copy, keys = self._reserve(tail, self._tail_pages(block_ids, num_computed))
            if copy is not None or self._held(tail):  # (a tier may hold it: a restart's)
                self._index_tail(st, num_computed, tail)
            if copy is None:
                return False
            self._final_saves[request_id] = [copy]
            durable, owner = self._durable(st), self._owner(st)
            self._final_keys.extend(SlotCommit(key, durable, owner) for key in keys)
            return True

    def checkpoint(self, request_id: str, num_computed: int, block_ids: Sequence[int]) -> int:
        """Lazy checkpointing: the request is preempted and its pages go back to vLLM, where
        the next allocation may overwrite them in this very step. Chunks a tier already holds
        (written through as they filled) are simply handed over; the rest, its newest pages,
        are copied to host slots before this step's forward pass (`checkpoints` in the
        metadata), and the preemption table records them. Returns the computed tokens the
        tiers will hold: all of them unless the host arena has no room, in which case the
        rest is recomputed when the request runs again."""
        with self._lock:
            st = self._requests.get(request_id)
            if st is None or num_computed <= 0:
                return 0
            self._unpin(st)
            self._drop_prefetch(st)
            num_computed = known_tokens(st, num_computed)
            full = num_computed // self.chunk_tokens
            hashes = self._hashes(st, full)
            ppc = self.pages_per_chunk
            spans = [(ChunkKey(self.model_id, prefix_hash, index, 0),  # (key, pages, end token)
                      tuple(block_ids[index * ppc:(index + 1) * ppc]),
                      (index + 1) * self.chunk_tokens) for index, prefix_hash in enumerate(hashes)]
            if num_computed > full * self.chunk_tokens:
                spans.append((self._tail_key(st, num_computed),
                              self._tail_pages(block_ids, num_computed), num_computed))
            # Held while the tail's slots are reserved: a reservation evicts, and it took the
            # top layers of this very request's chunks (found held a moment before).
            guard = [layer_key for key, _, _ in spans for layer in range(self.num_layers)
                     if self.host.pin(layer_key := key.with_layer(layer))]
            held = 0
            restore: list[ChunkKey] = []
            copies: list[PageCopy] = []
            reserved: list[ChunkKey] = []
            for key, pages, key_end in spans:
                if not self._held(key):
                    copy, keys = self._reserve(key, pages)
                    if copy is None:
                        break  # no host room: recompute from here
                    copies.append(copy)
                    reserved.extend(keys)
                if key_end % self.chunk_tokens:
                    self._index_tail(st, key_end, key)
                held = key_end
                restore.append(key)
            st.saved_chunks = min(st.saved_chunks, held // self.chunk_tokens)
            self._pending_checkpoints.extend(copies)
            # published, and written down, when this step's copies are done
            owner = self._owner(st)
            self._final_keys.extend(SlotCommit(key, True, owner) for key in reserved)
            copied = sum(len(copy.blocks) for copy in copies)
            c = self.counters
            c.checkpoints += 1
            c.pages_checkpointed += copied
            c.pages_handed_over += -(-held // self.page_tokens) - copied
            c.checkpoint_short_tokens += num_computed - held
            self._checkpoints[request_id] = Checkpoint(num_computed, held, tuple(restore))
            kept = {key.prefix_hash for key in restore}  # out of any erasure running
            self._checkpointed |= kept
            self._forgotten_chunks -= kept
            for wanted in self._erasing:
                wanted -= kept
            if not self._durable(st):  # down to the SSD tier, so a full host tier keeps it
                self._write_down(restore, owner)
            # The tiers keep the checkpoint until the restore: its chunks are evicted after
            # everything no checkpoint or advisory holds (a host tier full of write-through
            # evicted handed-over chunks first, and the request recomputed them).
            self.store.set_hint(_checkpoint_hint(request_id),
                                [key.prefix_hash for key in restore], 1.0)
            for key in guard:
                self.host.unpin(key)
            return held

    def checkpoint_cost_pages(self, request_id: str, num_computed: int) -> int:
        """Device pages a checkpoint of the request would copy now: those after the chunks
        already written through (what a policy weighs when it picks a request to preempt)."""
        with self._lock:
            st = self._requests.get(request_id)
            saved_pages = 0 if st is None else st.saved_chunks * self.pages_per_chunk
            return max(0, -(-num_computed // self.page_tokens) - saved_pages)

    def check_integrity(self) -> list[str]:
        """The preemption table against the tiers: every chunk a checkpointed request will
        restore is held by a tier (or on its way into the host arena). Returns the problems."""
        with self._lock:
            self._settle_evictions()
            problems = []
            for request_id, cp in self._checkpoints.items():
                if request_id not in self._requests:
                    problems.append(f"checkpoint of unknown request {request_id}")
                if cp.held_tokens > cp.num_tokens:
                    problems.append(f"{request_id}: holds {cp.held_tokens} of {cp.num_tokens}")
                problems += [f"{request_id}: chunk {key.chunk_index} of its checkpoint is in "
                             f"no tier" for key in cp.chunks if not self._held(key)]
            return problems

    # -- advisories --------------------------------------------------------------------------

    def advise(self, session: str, token_ids: Sequence[int], expected_arrival_s: float | None,
               *, salt: bytes = b"") -> int:
        """A turn of `session`, whose context is `token_ids`, is coming: bring its stored KV
        into the host arena, soonest-expected first, and keep it there until the turn comes or
        the advisory expires. Returns the context tokens the tiers hold."""
        with self._lock:
            self.advisories.expire()
            self.advisories.release(session)  # (before the match: its pins hold no room)
            match = self._match(token_ids, len(token_ids), salt, None, session=session)
            keys = self._leading_chunks_with_room(match.layer_keys())
            self.advisories.start(session, keys, expected_arrival_s, match.num_tokens,
                                  [key.prefix_hash for key in match.chunks])
            return match.num_tokens

    # -- deleted sessions ---------------------------------------------------------------------

    def forget(self, session: str, chains: Iterable[Sequence[int]], *, salt: bytes = b"",
               keep: Iterable[Sequence[int]] | None = None) -> Future[tuple[int, int]]:
        """`session` was deleted: drop its advisory, and erase from every tier each
        chunk-layer its token sequences (`chains`, under cache salt `salt`) can be stored
        under (`keys.chain_hashes`), and each one a request of it saved (its owner tag), bytes
        and all. With `keep`, the session lives on and
        `chains` are old ones it dropped: its advisory stays, and so does each chunk-layer
        `keep` (what it still runs) can be stored under. The hashing and the erasure run in a
        thread of their own: the engine's steps go on. A copy pinned by a running turn, or
        held for a checkpointed request, stays: that turn shares the prefix. The future
        resolves to (chunk-layers erased, kept) once every erasure is on disk;
        `forgotten(session)` reads it."""
        chains = list(chains)
        kept_chains = [] if keep is None else list(keep)
        deleted = keep is None
        done: Future[tuple[int, int]] = Future()
        with self._lock:
            if deleted:
                self.advisories.release(session)
                self.store.clear_hint(session)
            self._forgetting[session] = done

        def erase() -> None:
            wanted: set[bytes] = set()
            try:
                if deleted:  # a checkpoint's chunks on their way down to SSD land before
                    self.store.wait_for_write_downs()  # the owners are read
                kept = chain_hashes(kept_chains, self.chunk_tokens, self.model_id, salt=salt)
                wanted = chain_hashes(chains, self.chunk_tokens, self.model_id, salt=salt) - kept
                ends = self._chain_ends(chains, salt)
                with self._lock:
                    # and the partial chunks computed past where the session's tokens go (a
                    # reply a stop string ended or a cancel ran on in the engine), no chain's
                    # hash names, as far as this run knows them (`TailIndex`)
                    wanted |= self._run_on_tails(session, ends, wanted, deleted=deleted) - kept
                    if deleted:  # and what its requests saved, also before a restart
                        wanted |= self._owned_by(owner_tag(session))
                    self._tails.discard_hashes(wanted)
                    # Chunks a checkpointed request will restore stay, now and until the
                    # erasure is done (`checkpoint` takes its own out of every erasure).
                    wanted -= {key.prefix_hash for cp in self._checkpoints.values()
                               for key in cp.chunks}
                    self._erasing.append(wanted)
                    if self._in_flight or self._final_keys:  # dropped, not published
                        self._forgotten_chunks |= wanted
                done.set_result(self._erase(wanted))
            except BaseException as exc:
                done.set_exception(exc)
            finally:
                with self._lock:  # this erasure's own set: another may equal it
                    self._erasing = [w for w in self._erasing if w is not wanted]
        threading.Thread(target=erase, name="antiphon-forget", daemon=True).start()
        return done

    def reset_counters(self) -> None:
        """The connector's and every tier's counters from zero (occupancy is not a counter)."""
        with self._lock:
            self.counters.reset()
            for tier in self.store.tiers:
                tier.stats.reset()

    def forgotten(self, session: str) -> tuple[int, int] | None:
        """What `forget(session)` erased and kept, once it is done (None until then; (0, 0)
        for a session it was not asked to forget). Raises what the erasure raised."""
        with self._lock:
            done = self._forgetting.get(session)
            if done is None:
                return 0, 0
            if not done.done():
                return None
            del self._forgetting[session]
        return done.result()

    def _erase(self, wanted: set[bytes]) -> tuple[int, int]:
        """Remove each chunk-layer in `wanted` from every tier. `wanted` shrinks meanwhile (a
        request checkpointed now keeps its chunks): each is looked at again under the lock."""
        erased = kept = 0
        for tier in self.store.tiers:  # a scan of each index beats probing every layer of
            stored = tier.keys()  # up to 127 partial lengths per chunk (a snapshot: removes
            # go on under it). Clears on disk are queued after the lock is let go: a full
            # writer queue blocks, and the engine's steps wait for the lock.
            clears: list[int] = []
            for key in stored:
                if key.prefix_hash not in wanted:
                    continue
                with self._lock:
                    if key.prefix_hash not in wanted:
                        continue
                    removed, slot = tier.remove_later(key)
                clears += [] if slot is None else [slot]
                if removed:
                    erased += 1
                else:
                    kept += 1
            tier.clear_slots(clears)
        for tier in self.store.tiers:
            tier.barrier().result()  # its queued erasures, on disk
        with self._lock:
            self.counters.chunk_layers_forgotten += erased
        self.store.check_erasures_durable()
        return erased, kept

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self.advisories.expire()
            tiers = {}
            for tier in self.store.tiers:
                tiers[tier.name] = {"used_bytes": tier.used_bytes,
                                    "capacity_bytes": tier.capacity_bytes,
                                    **tier.stats.as_dict()}
            return {**dataclasses.asdict(self.counters), "tiers": tiers,
                    "advisories_live": len(self.advisories),
                    "requests_tracked": len(self._requests)}

    def close(self) -> None:
        self._prefetcher.close()
        self.store.close()

    # -- internals ---------------------------------------------------------------------------

    def _match(self, token_ids: Sequence[int], limit: int, salt: bytes,
               st: RequestState | None, *, session: str | None = None) -> StoredMatch:
        """The longest stored prefix of `token_ids[:limit]`: full chunks with every layer in
        some tier, then the longest stored partial chunk after them. A partial chunk found by
        its exact tokens joins the tail index (one saved before a restart: an advisory's
        context finds the reply a stop string ended, its turn the part it shares)."""
        hashes = (self._hashes(st, limit // self.chunk_tokens) if st is not None else
                  prefix_hashes(token_ids[:limit], self.chunk_tokens, self.model_id, salt=salt))
        chunks: list[ChunkKey] = []
        layers: list[list[ChunkKey]] = []
        for index, prefix_hash in enumerate(hashes[:limit // self.chunk_tokens]):
            key = ChunkKey(self.model_id, prefix_hash, index, 0)
            keys = self._stored(key)
            if keys is None:
                break
            chunks.append(key)
            layers.append(keys)
        start = len(chunks) * self.chunk_tokens
        rest = token_ids[start:min(limit, start + self.chunk_tokens - 1)]
        previous = chunks[-1].prefix_hash if chunks else prefix_seed(self.model_id, salt)
        # A partial chunk saved in this run that shares a prefix with `rest`, if any (it may
        # run past `rest`: a reply ended by a stop string, or cancelled), then one saved with
        # exactly the first `length` tokens of `rest` for a longer length (one from before a
        # restart, or evicted from the index).
        shared, tail, tail_layers = 0, None, None
        for length, key in self._tails.candidates(previous, rest):
            keys = self._stored(key)
            if keys is not None:
                shared, tail, tail_layers = length, key, keys
                break
        for length, tail_hash in reversed(list(enumerate(tail_hashes(previous, rest), 1))):
            if length <= shared:
                break
            key = ChunkKey(self.model_id, tail_hash, len(chunks), 0)
            keys = self._stored(key)
            if keys is not None:
                shared, tail, tail_layers = length, key, keys
                self._tails.add(previous, key, rest[:length],
                                st.view.session if st is not None else session)
                break
        if tail is not None and tail_layers is not None:
            self._tails.touch(tail)
            return StoredMatch([*chunks, tail], start + shared, [*layers, tail_layers])
        return StoredMatch(chunks, start, layers)

    def _chain_ends(self, chains: Iterable[Sequence[int]], salt: bytes
                    ) -> list[tuple[bytes, Sequence[int]]]:
        """(the hash of its full chunks, its tokens after them) of each of `chains`."""
        ends = []
        for tokens in chains:
            hashes = prefix_hashes(tokens, self.chunk_tokens, self.model_id, salt=salt)
            previous = hashes[-1] if hashes else prefix_seed(self.model_id, salt)
            ends.append((previous, tokens[len(hashes) * self.chunk_tokens:]))
        return ends

    def _run_on_tails(self, session: str, ends: Iterable[tuple[bytes, Sequence[int]]],
                      erased: set[bytes], *, deleted: bool) -> set[bytes]:
        """The prefix hashes of the partial chunks saved in this run that run on past one of
        the chain ends `ends` (`_chain_ends`), or continue a full chunk in `erased` (which no
        turn can then reach), or, for a `deleted` session, that a request of it saved."""
        found = {key.prefix_hash for previous, rest in ends
                 for key in self._tails.extending(previous, rest)}
        found.update(key.prefix_hash for key in self._tails.after(erased))
        if deleted:
            found.update(key.prefix_hash for key in self._tails.of_session(session))
        return found

    def _owned_by(self, owner: bytes) -> set[bytes]:
        """The prefix hashes of the chunk-layers a tier keeps as saved by `owner`, and of those
        in flight to it (lock held): the KV a deleted session's requests computed, including
        what ran on past everything its chains name (a full chunk a reply's run-on filled, a
        tail saved before a restart, whose tokens the tail index no longer has)."""
        found = {key.prefix_hash for key in self.store.owned_by(owner)}
        commits = [*self._final_keys,
                   *(c for in_flight in self._in_flight.values() for c in in_flight.commits)]
        return found | {c.key.prefix_hash for c in commits if c.owner == owner}

    def _stored(self, key: ChunkKey) -> list[ChunkKey] | None:
        """`key`'s chunk at every layer, if some tier holds each (layer 0 first: a partial
        chunk is probed at up to 127 lengths, most of them stored nowhere)."""
        if not self.store.contains(key):
            return None
        keys = [key, *(key.with_layer(layer) for layer in range(1, self.num_layers))]
        return keys if all(self.store.contains(k) for k in keys[1:]) else None

    def _hashes(self, st: RequestState, num_chunks: int) -> list[bytes]:
        """The request's first `num_chunks` full-chunk hashes, extending the cached chain."""
        have = len(st.hashes)
        if num_chunks > have:
            previous = st.hashes[-1] if st.hashes else prefix_seed(self.model_id, st.view.salt)
            tokens = st.view.token_ids[have * self.chunk_tokens:num_chunks * self.chunk_tokens]
            st.hashes.extend(continue_prefix_hashes(previous, tokens, self.chunk_tokens))
        return st.hashes[:num_chunks]

    @staticmethod
    def _fetch_again(st: RequestState, missing: set[ChunkKey]) -> bool:
        """Whether the turn fetches `missing` from SSD: it has not yet, or (a few times at
        most) some of it is not after the chunks its last fetch, done, brought up. Those were
        lost to other fetches' host room, or come before the fetched ones: vLLM dropped device
        pages its prefix cache had offered while the fetch ran. (Chunks after the fetched ones
        were cut from it for lack of host room: those are recomputed.) Checkpointed BE
        requests found their first chunks gone from the device after their fetch and
        recomputed 344 to 2,112 tokens in 11 of 16 140 s `bench mixed` runs."""
        if st.prefetch is None:
            return True
        last_fetched = max((key.chunk_index for key in st.prefetch.keys), default=-1)
        return st.fetch_attempts < MAX_FETCH_ATTEMPTS and any(
            key.chunk_index <= last_fetched for key in missing)

    def _leading_chunks_with_room(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """The chunk-layers of `keys` (in chunk order) that belong to its leading chunks the
        host can make room for, every layer of each. A context larger than the host's free
        room loads its first chunks and recomputes the rest: fetching it all, layer 0 first,
        would fill the host with low layers of every chunk and leave no chunk whole."""
        taken = needed = 0
        for index, key in enumerate(keys):
            needed += not self.host.contains(key)
            if index + 1 == len(keys) or keys[index + 1].chunk_index != key.chunk_index:
                if not self.host.can_make_room(needed * self.host.slot_bytes):
                    break
                taken = index + 1
        if taken < len(keys):
            log.debug("host room for %d of %d chunk-layers to fetch", taken, len(keys))
            self.counters.ssd_fetches_cut += 1
        return list(keys[:taken])

    def _pin_chunks(self, st: RequestState, match: StoredMatch, first_chunk: int) -> int:
        """Pin every layer of the matched chunks from `first_chunk` in the host arena; returns
        the tokens covered up to the first chunk that could not be pinned."""
        for index in range(first_chunk, len(match.chunks)):
            keys = match.layers[index]
            if not self.host.pin_all(keys):
                st.match = StoredMatch(match.chunks[:index], index * self.chunk_tokens,
                                  match.layers[:index])
                return st.match.num_tokens
            st.pins.extend(keys)
        st.match = match
        return match.num_tokens

    def _plan_saves(self, st: RequestState, num_done: int, meta: TieringMetadata,
                    in_flight: StepInFlight) -> None:
        full = known_tokens(st, num_done) // self.chunk_tokens
        if full <= st.saved_chunks:
            return
        hashes = self._hashes(st, full)
        block_ids = self._block_ids_of(st.view.request_id)
        durable, owner = self._durable(st), self._owner(st)
        for index in range(st.saved_chunks, full):
            first_page = index * self.pages_per_chunk
            pages = tuple(block_ids[first_page:first_page + self.pages_per_chunk])
            copy, keys = self._reserve(ChunkKey(self.model_id, hashes[index], index, 0), pages)
            if copy is not None:
                meta.saves.append(copy)
                in_flight.commits.extend(SlotCommit(key, durable, owner) for key in keys)
                self.counters.saved_chunks += 1
        st.saved_chunks = full

    def _reserve(self, key: ChunkKey, pages: tuple[int, ...]
                 ) -> tuple[PageCopy | None, list[ChunkKey]]:
        """Host slots for the layers of `key` no tier holds; (None, []) if none are needed or
        the arena has no room (then nothing is reserved)."""
        slots: list[int] = []
        reserved: list[ChunkKey] = []
        for layer in range(self.num_layers):
            layer_key = key.with_layer(layer)
            if self.store.contains(layer_key) or self.host.is_reserved(layer_key):
                slots.append(NO_SLOT)
                continue
            slot = self.host.reserve(layer_key)
            if slot is None:  # the arena is all pins: take advisories' back, try once more
                self.advisories.make_room(1, None)
                slot = self.host.reserve(layer_key)
            if slot is None:
                for done in reserved:
                    self.host.abort(done)
                self.counters.saves_refused += 1
                return None, []
            slots.append(slot)
            reserved.append(layer_key)
        if not reserved:
            return None, []
        return PageCopy(pages, tuple(slots)), reserved

    def _durable(self, st: RequestState) -> bool:
        """Whether the request's KV is written through to the slowest tier as it is saved
        (`ssd_write_through`); if not, only once it is checkpointed."""
        mode = self.config.ssd_write_through
        if mode == "all":
            return True
        return not st.view.background and (mode == "rt" or st.view.session is not None)

    def _write_down(self, chunks: Sequence[ChunkKey], owner: bytes) -> None:
        """Write the layers of `chunks` the host tier holds through to the slowest tier (saved
        by `owner`), in the background; those still being copied, when `step_done` publishes
        them."""
        self.store.write_through_later(
            [chunk.with_layer(layer) for chunk in chunks for layer in range(self.num_layers)],
            owner=owner)
        hashes = {chunk.prefix_hash for chunk in chunks}
        for in_flight in self._in_flight.values():
            in_flight.commits = [c._replace(durable=True) if c.key.prefix_hash in hashes else c
                                 for c in in_flight.commits]

    @staticmethod
    def _owner(st: RequestState) -> bytes:
        """The tag the tiers keep with what the request saves: its session's, if any."""
        return owner_tag(st.view.session)

    def _held(self, key: ChunkKey) -> bool:
        """Every layer of the chunk is in a tier or reserved in the host arena."""
        return all(self.store.contains(k) or self.host.is_reserved(k)
                   for k in (key.with_layer(layer) for layer in range(self.num_layers)))

    def _tail_chain(self, st: RequestState, num_tokens: int) -> tuple[bytes, Sequence[int]]:
        """(the hash of the chain it continues, its tokens) of the partial chunk that ends at
        `num_tokens` (not a chunk boundary)."""
        full = num_tokens // self.chunk_tokens
        hashes = self._hashes(st, full)
        previous = hashes[-1] if hashes else prefix_seed(self.model_id, st.view.salt)
        return previous, st.view.token_ids[full * self.chunk_tokens:num_tokens]

    def _tail_key(self, st: RequestState, num_tokens: int) -> ChunkKey:
        """The key of the partial chunk that ends at `num_tokens` (not a chunk boundary)."""
        previous, tokens = self._tail_chain(st, num_tokens)
        return ChunkKey(self.model_id, tail_hashes(previous, tokens)[-1],
                        num_tokens // self.chunk_tokens, 0)

    def _index_tail(self, st: RequestState, num_tokens: int, key: ChunkKey) -> None:
        """`key` (`_tail_key(st, num_tokens)`) is stored or on its way: keep its tokens."""
        previous, tokens = self._tail_chain(st, num_tokens)
        self._tails.add(previous, key, tokens, st.view.session)

    def _tail_pages(self, block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """The device pages of the partial chunk that ends at `num_tokens`."""
        full = num_tokens // self.chunk_tokens
        first_page = full * self.pages_per_chunk
        tail = num_tokens - full * self.chunk_tokens
        return tuple(block_ids[first_page:first_page + -(-tail // self.page_tokens)])

    def _slot(self, key: ChunkKey) -> int:
        slot = self.host.slot_of(key)
        if slot is None:
            raise AssertionError(f"pinned {key} has no host slot")
        return slot

    def _drop_checkpoint(self, request_id: str) -> bool:
        """Take the request out of the preemption table; False if it was not in it."""
        if self._checkpoints.pop(request_id, None) is None:
            return False
        self.store.clear_hint(_checkpoint_hint(request_id))
        self._checkpointed = {key.prefix_hash for cp in self._checkpoints.values()
                              for key in cp.chunks}
        return True

    def _note_evicted(self, keys: list[ChunkKey]) -> None:
        """A tier evicted `keys` (its lock held: only noted here)."""
        self._evicted.extend(key for key in keys if key.prefix_hash in self._checkpointed)

    def _settle_evictions(self) -> None:
        """Cut each checkpoint at its first chunk a full tier evicted from every tier (lock
        held): the request recomputes from there when it runs again (as when the host arena
        had no room at the checkpoint: `checkpoint_short_tokens`), and the preemption table
        says what the tiers hold."""
        while self._evicted:
            key = self._evicted.popleft()
            if self._held(key.with_layer(0)):
                continue
            for cp_id, cp in self._checkpoints.items():
                cut = next((i for i, k in enumerate(cp.chunks)
                            if k.prefix_hash == key.prefix_hash), None)
                if cut is None:
                    continue
                held = min(cp.held_tokens, cp.chunks[cut].chunk_index * self.chunk_tokens)
                self.counters.checkpoint_short_tokens += cp.held_tokens - held
                self._checkpoints[cp_id] = Checkpoint(cp.num_tokens, held, cp.chunks[:cut])

    def _unpin(self, st: RequestState) -> None:
        self.host.unpin_all(st.pins)
        st.pins = []
        st.match = None

    def _drop_prefetch(self, st: RequestState) -> None:
        if st.prefetch is not None:
            self._prefetcher.retire(st.prefetch)
            st.prefetch = None

    def _count_admission(self, st: RequestState, num_external: int, num_prompt_tokens: int) -> None:
        c = self.counters
        c.prompt_tokens += num_prompt_tokens
        c.tokens_from_device += st.local_tokens
        from_ssd = 0
        if num_external and st.match is not None:
            start, end = st.local_tokens, st.local_tokens + num_external
            for index in st.ssd_chunks:
                chunk_start = index * self.chunk_tokens
                from_ssd += max(0, min(end, chunk_start + self.chunk_tokens)
                                - max(start, chunk_start))
        c.tokens_from_ssd += from_ssd
        c.tokens_from_host += num_external - from_ssd
        if st.first_loads is None:  # a preempted request's reloads are not its prompt's
            st.first_loads = (num_external - from_ssd, from_ssd)
        c.computed_prompt_tokens += max(0, num_prompt_tokens - st.local_tokens - num_external)
        st.ssd_chunks, st.fetch_attempts = set(), 0

    def _use_advisory(self, st: RequestState) -> None:
        """The turn `st` came: its session's advisory is used. Once per request: a preempted
        turn admitted again meanwhile may find the next turn's advisory (the user typing while
        the reply streams), which is not its to use."""
        if not st.advisory_settled:
            st.advisory_settled = True
            self.advisories.use(st.view.session or "")


def _checkpoint_hint(request_id: str) -> tuple[str, str]:
    """The eviction-hint id of a request's checkpoint (not a chat session's id)."""
    return ("checkpoint", request_id)
