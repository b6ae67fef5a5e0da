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

Beside it: `PrefixMatcher` (matching.py) finds what the tiers hold of a prompt,
`PreemptionTable` (preemption.py) keeps the checkpoints of preempted requests, and
`SessionErasure` (erasure.py) erases a deleted session's KV, and `TailRetirement`
(retirement.py) the partial chunks a later turn's saves cover.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from antiphon.tiering.advisory_book import AdvisoryBook
from antiphon.tiering.build import build_tiered_store
from antiphon.tiering.config import TieringConfig
from antiphon.tiering.connector_meta import NO_SLOT, PageCopy, TieringMetadata
from antiphon.tiering.erasure import SessionErasure
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.keys import (
    ChunkKey,
    owner_tag,
)
from antiphon.tiering.matching import PrefixMatcher
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
from antiphon.tiering.preemption import PreemptionTable
from antiphon.tiering.prefetch_queue import BACKGROUND_URGENT, URGENT, PrefetchQueue
from antiphon.tiering.retirement import TailRetirement
from antiphon.tiering.tails import TailIndex

log = logging.getLogger(__name__)

# Fetches from SSD one turn waits for before it takes what the host holds and recomputes the
# rest (a fetch can lose its host room to others after it starts).
MAX_FETCH_ATTEMPTS = 3
# How long an erasure waits for stopped prefetches to let go of their pins (one waiting behind
# a long fetch in the queue settles only once it is reached).
PREFETCH_SETTLE_TIMEOUT_S = 10.0


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
        self.page_bytes = page_bytes  # of one layer's page
        self.store = build_tiered_store(config, slot_bytes=page_bytes * self.pages_per_chunk,
                                        model_id=model_id)
        host = self.store.tiers[0]
        if not isinstance(host, HostTier):
            raise ValueError("the KV connector needs the host tier (host_tier_bytes > 0): the "
                             "worker moves KV through it")
        self.host = host
        self._block_ids_of = block_ids_of
        self._prefetcher = PrefetchQueue(self.store.tiers)
        self.lock = threading.RLock()
        self._requests: dict[str, RequestState] = {}
        self._step = 0
        self._pending_loads: list[PageCopy] = []
        self._pending_early: list[PageCopy] = []
        self._pending_load_pins: list[ChunkKey] = []
        self._final_saves: dict[str, list[PageCopy]] = {}
        self._final_keys: list[SlotCommit] = []  # as `StepInFlight.commits`
        self._final_chunks = 0  # whole chunks among `_final_saves` (counted once saved)
        self._in_flight: dict[int, StepInFlight] = {}
        # Steps built after a failed step and before its report: see `step_done`.
        self._doomed: set[int] = set()
        self._pending_checkpoints: list[PageCopy] = []
        self.preemption = PreemptionTable(self.chunk_tokens)
        self.tails = TailIndex(config.tail_index_entries)  # the tokens of tails saved
        self.counters = TieringCounters()
        self.advisories = AdvisoryBook(self._prefetcher, self.store, host, self.counters,
                                       config.advisory_ttl_s)
        self.erasure = SessionErasure(self)
        self.retirement = TailRetirement(self)
        self.matcher = PrefixMatcher(self.store, self.tails, model_id=model_id,
                                     chunk_tokens=self.chunk_tokens, num_layers=num_layers)
        # by request: chunks below its `saved_chunks` that no tier holds any more (evicted,
        # their save erased): a checkpoint copies them again
        self._lost_chunks: dict[str, set[int]] = {}
        self._evicted: collections.deque[ChunkKey] = collections.deque()  # (tiers' threads)
        for tier in self.store.tiers:
            tier.on_evict = self._note_evicted

    @property
    def arena_name(self) -> str:
        return self.host.arena.name

    # -- admission ---------------------------------------------------------------------------

    def add_request(self, view: TokenView) -> None:
        with self.lock:
            self._requests.setdefault(view.request_id, RequestState(view))

    def num_new_matched_tokens(self, view: TokenView, num_computed: int) -> int | None:
        """Tokens beyond `num_computed` (vLLM's device hit) the tiers can supply now, or None
        while a prefetch this turn needs is still moving."""
        with self.lock:
            self.advisories.expire()
            # (a checkpoint another's reservation evicted in this very schedule is cut first:
            # admitted on the chunks it listed, it matched less and the shortfall went
            # uncounted)
            self._settle_evictions()
            st = self._requests.setdefault(view.request_id, RequestState(view))
            st.view = view
            if not st.advisory_settled:  # (a turn admitted again after a preemption: the
                # session's advisory now is the next turn's, typed meanwhile)
                self.advisories.overtake(view.session or "")
            if st.prefetch is not None and not st.prefetch.is_done:
                return None
            checkpoint = self.preemption.get(view.request_id)
            if checkpoint is not None and self._is_checkpoint_landing(checkpoint):
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
            if is_first_fetch and not view.background:  # (BE work is never waited for)
                if matched is None:
                    self.counters.turns_held += 1
                else:
                    self.counters.turns_fetched_in_step += 1
            self._note_admitted(st, view, num_computed, matched)
            return matched

    def admit_without_match(self, view: TokenView) -> None:
        """The turn reads no stored KV (vLLM's `skip_reading_prefix_cache`): nothing is
        matched or fetched for it, but its session's advisory is used (its pins go)."""
        with self.lock:
            self.advisories.expire()
            st = self._requests.setdefault(view.request_id, RequestState(view))
            st.view = view
            self._use_advisory(st)

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
        match = self.matcher.match(view.token_ids, len(view.token_ids) - 1, view.salt, st)
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
            if not view.background:  # (BE work never takes an advised chat's room)
                self.advisories.make_room(len(absent), view.session)
                self._take_back_background_room(len(absent), st)
            absent = self._leading_chunks_with_room(absent)
            if absent:
                st.ssd_chunks |= {key.chunk_index for key in absent}
                for key in absent:  # (the host tier's misses: fetched from below first)
                    layers = st.fetched_layers.setdefault(key.chunk_index, set())
                    self.host.stats.misses += key.layer not in layers  # (once, if fetched again)
                    layers.add(key.layer)
                # Whole chunks in order: the turn waits for all of it, so lower layers first
                # would gain nothing, and would leave no chunk whole if other fetches took the
                # host room meanwhile.
                st.prefetch = self._prefetcher.submit(
                    absent, BACKGROUND_URGENT if view.background else URGENT, layer_first=False)
                if st.fetch_attempts > 1:
                    self.counters.fetch_retries += 1
                # The turn has come (it holds what it needs): its advisory is used now, not
                # once the fetch is done, when an advisory meanwhile is the next turn's.
                self._use_advisory(st)
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

    def _is_checkpoint_landing(self, checkpoint: Checkpoint) -> bool:
        """Whether pages `checkpoint` restores are still being copied to the host tier: its
        own copies (every layer: a chunk whose top layers alone were evicted is copied for
        those, and was recomputed), or saves of a step still running that it was handed (a
        request preempted right after a chunk ending on a chunk boundary copies nothing)."""
        if any(self.host.is_reserved(key) for key in reversed(checkpoint.copying)):
            return True
        saving = {commit.key.prefix_hash for commit in self._commits()}
        return any(key.prefix_hash in saving for key in checkpoint.chunks)

    def stored_prefix_tokens(self, view: TokenView) -> int:
        """Tokens of a waiting request the tiers hold (looked up again only when the request
        grew, e.g. preempted after more output): what a scheduling policy can count as not to be
        computed. An estimate; admission decides."""
        with self.lock:
            st = self._requests.setdefault(view.request_id, RequestState(view))
            num_tokens = len(view.token_ids)
            if st.stored_tokens is None or st.stored_tokens[0] != num_tokens:
                st.view = view
                match = self.matcher.match(view.token_ids, num_tokens - 1, view.salt, st)
                st.stored_tokens = (num_tokens, match.num_tokens)
            return st.stored_tokens[1]

    def plan_load(self, request_id: str, block_ids: Sequence[int], num_external: int,
                  num_tokens: int) -> None:
        """vLLM gave the turn its pages: copy the matched ones in during the next step."""
        with self.lock:
            st = self._requests.get(request_id)
            if st is None:
                return
            fetched = st.fetched_layers  # (`_count_admission` starts the next admission's)
            self._count_admission(st, num_external, num_tokens)
            checkpoint = self.preemption.get(request_id)
            if checkpoint is not None:  # what it restores short of it is recomputed: counted
                loaded = st.local_tokens + num_external
                self.counters.checkpoint_short_tokens += max(
                    0, min(checkpoint.held_tokens, len(st.view.token_ids) - 1) - loaded)
            # (a restore loads something: a checkpoint evictions cut to nothing is recomputed)
            if self._drop_checkpoint(request_id) and num_external:
                self.counters.restores += 1
                self.counters.pages_restored += -(-(st.local_tokens + num_external)
                                                  // self.page_tokens) - st.local_tokens \
                    // self.page_tokens
            if num_external == 0 or st.match is None:
                self._unpin(st)
                return
            start, end = st.local_tokens, st.local_tokens + num_external
            if self._saves_at_checkpoint(st):  # (what its saves would have found held: a
                # checkpoint hands it over, and policies weigh it so)
                st.saved_chunks = max(st.saved_chunks, end // self.chunk_tokens)
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
                # The worker reads these slots straight from the arena: the host tier's reads,
                # counted here (a hit: found there at admission, not fetched from below).
                self.host.stats.hits += self.num_layers - len(fetched.get(index, ()))
                self.host.stats.bytes_out += self.num_layers * len(pages) * self.page_bytes
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
        with self.lock:
            # (once a step: a stale advisory's pins held the host room background saves
            # need while no turn was admitted and no advisory came)
            self.advisories.expire()
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
            in_flight.num_saved_chunks += self._final_chunks
            self._final_keys, self._final_chunks = [], 0
            if meta.has_work:
                self._in_flight[meta.step] = in_flight
            self._step += 1
            return meta

    def step_done(self, done_steps: set[int], failed_steps: set[int]) -> None:
        """The worker finished these steps' copies: publish saves, drop load pins.

        A step built before a failed one was reported fails with it: under async scheduling
        (a GPU's) vLLM builds step N + 1 before it hears that N's loads failed, and N + 1
        computes over the pages they left unfilled; its saves, published, would serve wrong
        KV under the right keys to every later turn with that prefix."""
        with self.lock:
            landed: set[bytes] = set()  # prefix hashes of the chunks published
            for step in sorted(done_steps | failed_steps):
                in_flight = self._in_flight.pop(step, None)
                if in_flight is None:
                    continue
                if step in failed_steps:  # (not those built before it: a step reported
                    # done after the failure, a GPU's copy event later, landed whole)
                    self._doomed |= {s for s in range(step + 1, self._step)
                                     if s in self._in_flight}
                elif step in self._doomed:
                    failed_steps = failed_steps | {step}
                self._doomed.discard(step)
                self.counters.copy_steps_failed += step in failed_steps
                if step not in failed_steps:  # (a failed one's are saved again, and counted)
                    self.counters.saved_chunks += in_flight.num_saved_chunks
                for key in in_flight.pins:
                    self.host.unpin(key)
                erased: list[ChunkKey] = []
                failed: list[ChunkKey] = []
                later: dict[bytes, list[ChunkKey]] = {}  # by owner: written down in the
                # store's thread (pinned there until written)
                for key, durable, owner, num_bytes, in_background in in_flight.commits:
                    if self.erasure.drops(key):
                        self.host.abort(key, erase=True)
                        erased.append(key)
                    elif step in failed_steps:
                        self.host.abort(key)
                        failed.append(key)
                    elif durable:
                        # Pinned until it is on SSD: published unpinned, a put from the
                        # prefetch thread could evict it first, and a checkpoint's only copy
                        # of a BE tail was gone though the SSD tier had room.
                        if self.host.commit(key, num_bytes, pin=True, owner=owner):
                            if in_background:
                                later.setdefault(owner, []).append(key)
                            else:
                                try:
                                    self.store.write_through(key, owner=owner)
                                finally:
                                    self.host.unpin(key)
                    else:
                        self.host.commit(key, num_bytes, owner=owner)
                    if step not in failed_steps:
                        landed.add(key.prefix_hash)
                for owner, keys in later.items():
                    self.store.write_through_later(keys, owner=owner)  # (pins them again)
                    for key in keys:
                        self.host.unpin(key)
                # (a checkpoint holding one is cut, as if evicted)
                self.preemption.note_evicted(erased + failed)
                self._unsave(erased, save_again=False)
                self._unsave(failed, save_again=True)
                if step not in failed_steps and self._lost_chunks:
                    self._found_again({(c.key.chunk_index, c.key.prefix_hash)
                                       for c in in_flight.commits})
            if not self.has_commits_pending():
                self.erasure.settle()
            # What a checkpointed request has stored grows as its copies land: looked up
            # while they ran, the answer stood for as long as it waited.
            for request_id in self.preemption.request_ids() if landed else ():
                st = self._requests.get(request_id)
                checkpoint = self.preemption.get(request_id)
                if st is not None and checkpoint is not None and any(
                        key.prefix_hash in landed for key in checkpoint.chunks):
                    st.stored_tokens = None
            self.retirement.step_done()

    def settle_retired_prefetches(self) -> None:
        """Wait for the prefetches stopped so far (a released advisory's) to settle and let go
        of their pins; at most `PREFETCH_SETTLE_TIMEOUT_S`. Call without the lock."""
        self._prefetcher.settle_retired(PREFETCH_SETTLE_TIMEOUT_S)

    def has_commits_pending(self) -> bool:
        """Saves reserved and not yet published (lock held)."""
        return bool(self._in_flight or self._final_keys)

    def is_saving(self, prefix_hash: bytes) -> bool:
        """A save of a chunk-layer under `prefix_hash` is reserved and not yet published
        (lock held)."""
        return any(c.key.prefix_hash == prefix_hash for c in self._commits())

    def commits_pending(self) -> list[SlotCommit]:
        """The saves reserved and not yet published (lock held)."""
        return list(self._commits())

    def _commits(self) -> Iterator[SlotCommit]:
        yield from self._final_keys
        for in_flight in self._in_flight.values():
            yield from in_flight.commits

    def has_steps_in_flight(self) -> bool:
        """Steps whose copies the worker has yet to report done (their load pins and saves
        settle only once it does: the engine must step on, idle or not)."""
        with self.lock:
            return bool(self._in_flight)

    def served_from(self, request_id: str) -> tuple[int, int] | None:
        """(host, SSD) prompt tokens the request's first admission loaded from the tiers
        (those from SSD came up through the host arena); None for a request not admitted."""
        with self.lock:
            st = self._requests.get(request_id)
            return None if st is None else st.first_loads

    def request_finished(self, request_id: str, num_computed: int,
                         block_ids: Sequence[int]) -> bool:
        """The request is done; True if pages of it are being saved, full chunks not saved yet
        or its last partial one (vLLM must keep its pages until the worker reports the request
        sent)."""
        with self.lock:
            st = self._requests.pop(request_id, None)
            self._drop_checkpoint(request_id)
            if st is None:
                return False
            self._lost_chunks.pop(request_id, None)
            self._unpin(st)
            self._drop_prefetch(st)
            num_computed = known_tokens(st, num_computed)
            if self._saves_at_checkpoint(st):  # nothing reads it again
                self.retirement.request_finished(st, num_computed, None)
                return False
            full = num_computed // self.chunk_tokens
            # With async scheduling the step computing a chunk's last token was planned
            # before that token was known: a reply ending there lost the chunk (its next turn
            # recomputed it). Saved now, with the tail.
            copies: list[PageCopy] = []
            self._final_chunks += self._save_chunks(st, full, block_ids, copies,
                                                    self._final_keys)
            # (Symphony's eviction drops the smaller sessions' KV first: the store learns
            # this one's size, also without an advisory's hint)
            self.store.note_sequence(st.hashes[:st.saved_chunks])
            if num_computed == full * self.chunk_tokens or st.saved_chunks != full:
                # nothing partial, or the full chunks were not all saved
                self.retirement.request_finished(st, num_computed, None)
            else:
                tail = self.matcher.tail_key(st, num_computed)
                copy, keys = self._reserve(tail, self._tail_pages(block_ids, num_computed),
                                           for_chat=not st.view.background)
                # (a tier may hold it: a restart's)
                is_indexed = copy is not None or self.held(tail)
                if is_indexed:
                    self.matcher.index_tail(st, num_computed, tail)
                if copy is not None:
                    copies.append(copy)
                    self._final_keys.extend(self._slot_commits(
                        keys, copy, self._durable(st), self._owner(st)))
                self.retirement.request_finished(st, num_computed, tail if is_indexed else None)
            if copies:
                self._final_saves[request_id] = copies
            return bool(copies)

    def checkpoint(self, request_id: str, num_computed: int, block_ids: Sequence[int]) -> int:
        """Lazy checkpointing: the request is preempted and its pages go back to vLLM, where
        the next allocation may overwrite them in this very step. Chunks a tier already holds
        (written through as they filled) are simply handed over; the rest, its newest pages,
        are copied to host slots before this step's forward pass (`checkpoints` in the
        metadata), and the preemption table records them. Returns the computed tokens the
        tiers will hold: all of them unless the host arena has no room, in which case the
        rest is recomputed when the request runs again."""
        with self.lock:
            st = self._requests.get(request_id)
            if st is None or num_computed <= 0:
                return 0
            self._unpin(st)
            self._drop_prefetch(st)
            num_computed = known_tokens(st, num_computed)
            full = num_computed // self.chunk_tokens
            hashes = self.matcher.hashes(st, full)
            ppc = self.pages_per_chunk
            spans = [(ChunkKey(self.model_id, prefix_hash, index, 0),  # (key, pages, end token)
                      tuple(block_ids[index * ppc:(index + 1) * ppc]),
                      (index + 1) * self.chunk_tokens) for index, prefix_hash in enumerate(hashes)]
            if num_computed > full * self.chunk_tokens:
                spans.append((self.matcher.tail_key(st, num_computed),
                              self._tail_pages(block_ids, num_computed), num_computed))
            # Held while the tail's slots are reserved: a reservation evicts, and it took the
            # top layers of this very request's chunks (found held a moment before).
            guard = [layer_key for key, _, _ in spans for layer in range(self.num_layers)
                     if self.host.pin(layer_key := key.with_layer(layer))]
            held = 0
            restore: list[ChunkKey] = []
            copies: list[PageCopy] = []
            reserved: list[ChunkKey] = []
            commits: list[SlotCommit] = []  # published, and written down, when this step's
            owner = self._owner(st)  # copies are done
            for key, pages, key_end in spans:
                if not self.held(key):
                    copy, keys = self._reserve(key, pages, for_chat=not st.view.background)
                    if copy is None:
                        break  # no host room: recompute from here
                    copies.append(copy)
                    reserved.extend(keys)
                    commits.extend(self._slot_commits(keys, copy, True, owner,
                                                      in_background=True))
                if key_end % self.chunk_tokens:
                    self.matcher.index_tail(st, key_end, key)
                held = key_end
                restore.append(key)
            c = self.counters
            c.checkpoint_short_tokens += num_computed - held
            if held:
                self.preemption.record(request_id, Checkpoint(num_computed, held,
                                                              tuple(restore), tuple(reserved)))
                # Noticed from now on (`note_evicted` keeps those of recorded chunks): a chunk
                # the SSD tier's writer evicted since it was found held (its notice dropped)
                # is among the planner's own notices, and cuts the checkpoint now (its restore
                # recomputed it, uncounted).
                restored = {key.prefix_hash for key in restore}
                gone = [key for key in tuple(self._evicted)
                        if key.prefix_hash in restored and not self.held(key)]
                if gone:
                    self.preemption.note_evicted(gone)
                    self._settle_evictions()  # (counts what it cuts)
                    cut = self.preemption.get(request_id)
                    assert cut is not None
                    held, restore = cut.held_tokens, list(cut.chunks)
                    if not held:
                        self.preemption.drop(request_id)
            # (saved by this checkpoint: not copied again, and a lost one found by `_unsave`)
            st.saved_chunks = (held // self.chunk_tokens if self._saves_at_checkpoint(st)
                               else min(st.saved_chunks, held // self.chunk_tokens))
            st.stored_tokens = None  # (looked up by its length, which a preemption mid-prefill
            # leaves as it was: policies saw the tiers hold none of the checkpoint)
            self._lost_chunks.pop(request_id, None)  # (those below `held` are reserved again)
            # (copies reserved go on, to be committed, also of a checkpoint cut to nothing)
            self._pending_checkpoints.extend(copies)
            self._final_keys.extend(commits)
            if not held:  # no room even for its first chunk: no checkpoint, all recomputed
                self.host.unpin_all(guard)
                return 0
            copied = sum(len(copy.blocks) for copy in copies)
            c.checkpoints += 1
            c.pages_checkpointed += copied
            c.pages_handed_over += max(0, -(-held // self.page_tokens) - copied)
            self.erasure.keep({key.prefix_hash for key in restore})
            if not self._durable(st):  # down to the SSD tier, so a full host tier keeps it
                self._write_down([key.with_layer(layer) for key in restore
                                  for layer in range(self.num_layers)], owner)
            # The tiers keep the checkpoint until the restore: its chunks are evicted after
            # everything no checkpoint or advisory holds (a host tier full of write-through
            # evicted handed-over chunks first, and the request recomputed them).
            self.store.set_hint(_checkpoint_hint(request_id),
                                [key.prefix_hash for key in restore], 1.0)
            for key in guard:
                self.host.unpin(key)
            return held

    def checkpoint_cost_pages(self, request_id: str, num_computed: int) -> int:
        """Device pages a checkpoint of the request would copy now: all but those of the
        chunks a tier holds or is being given (what a policy weighs when it picks a request
        to preempt). Called for every running BE request each step: no tier is looked up."""
        with self.lock:
            st = self._requests.get(request_id)
            if st is None:
                return -(-num_computed // self.page_tokens)
            self._settle_evictions()
            num_held = st.saved_chunks - len(self._lost_chunks.get(request_id, ()))
            pages = -(-known_tokens(st, num_computed) // self.page_tokens)
            return max(0, pages - num_held * self.pages_per_chunk)

    def check_integrity(self) -> list[str]:
        """The preemption table against the tiers: every chunk a checkpointed request will
        restore is held by a tier (or on its way into the host arena). Returns the problems."""
        with self.lock:
            self._settle_evictions()
            return self.preemption.problems(self._requests, self.held)

    # -- advisories --------------------------------------------------------------------------

    def advise(self, session: str, token_ids: Sequence[int], expected_arrival_s: float | None,
               *, salt: bytes = b"", priority: int = 0) -> int:
        """A turn of `session`, whose context is `token_ids`, is coming: bring its stored KV
        into the host arena, highest `priority` first, then soonest expected, and keep it
        there until the turn comes or the advisory expires. Returns the context tokens the
        tiers hold."""
        with self.lock:
            if self.erasure.is_deleting(session):  # (an advisory the server sent as the
                # session was deleted: its prefetch pinned KV the erasure then kept, in RAM)
                return 0
            self.advisories.expire()
            match = self.matcher.match(token_ids, len(token_ids), salt, None, session=session)
            wanted = match.layer_keys()
            if self.advisories.renew(session, self._advised_fetch(session, wanted),
                                     expected_arrival_s, priority):
                # (the same KV, fetched or on its way: released and fetched again, a refresh
                # let go of the pins it held, and queued their return behind others)
                return match.num_tokens
            self.advisories.drop(session)  # (its pins hold no room for this one)
            # What the host holds of it is pinned first, the pins then handed to its prefetch:
            # counted as room, it was evicted by the prefetch's puts of the rest (layer 0
            # first: the session's own upper layers went), which then failed partway.
            held = [key for key in wanted if self.host.pin(key)]
            try:
                # the room of advisories of lower priority, or expected later, is this one's
                # (Symphony: the session expected soonest first; one due now got nothing
                # while one due in minutes held the host)
                self.advisories.make_room(
                    len(wanted) - len(held), session,
                    expected_after=self.advisories.due(expected_arrival_s), priority=priority)
                keys = self._leading_chunks_with_room(wanted)
                taken = set(keys)
                self.advisories.start(session, keys, expected_arrival_s, match.num_tokens,
                                      [key.prefix_hash for key in match.chunks], priority,
                                      pinned=[key for key in held if key in taken])
            except BaseException:  # (a prefetch queue closed: nothing took the pins)
                self.host.unpin_all(held)
                raise
            self.host.unpin_all([key for key in held if key not in taken])
            return match.num_tokens

    def reset_counters(self) -> None:
        """The connector's and every tier's counters from zero (occupancy is not a counter)."""
        with self.lock:
            self.counters.reset()
            for tier in self.store.tiers:
                tier.stats.reset()

    def stats(self) -> dict[str, Any]:
        with self.lock:
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
        self.retirement.close()
        self._prefetcher.close()
        self.store.close()

    # -- internals ---------------------------------------------------------------------------

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

    def _advised_fetch(self, session: str, wanted: Sequence[ChunkKey]) -> Sequence[ChunkKey]:
        """What an advisory again for `wanted` would fetch, to compare with the session's
        live one: that one's keys where they were `wanted`'s leading chunks, cut to the
        host's room, and the host has no room for the next chunk still; else `wanted`.
        (Compared with `wanted`, a context larger than the host never matched: each refresh
        dropped the prefetch, pinned the same KV again and queued it anew, counted dropped.)"""
        advisory = self.advisories.get(session)
        live = () if advisory is None or advisory.handle is None else advisory.handle.keys
        if not 0 < len(live) < len(wanted) or set(wanted[:len(live)]) != set(live):
            return wanted  # (`live` is in its fetch's order: lower layers first)
        after = wanted[len(live)].chunk_index
        next_chunk = [key for key in wanted[len(live):] if key.chunk_index == after]
        needed = sum(not self.host.contains(key) for key in next_chunk)
        return live if not self.host.can_make_room(needed * self.host.slot_bytes) else wanted

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
        if full > st.saved_chunks and not self._saves_at_checkpoint(st):
            in_flight.num_saved_chunks += self._save_chunks(
                st, full, self._block_ids_of(st.view.request_id), meta.saves,
                in_flight.commits)

    def _save_chunks(self, st: RequestState, full: int, block_ids: Sequence[int],
                     copies: list[PageCopy], commits: list[SlotCommit]) -> int:
        """Host slots for the request's chunks from `st.saved_chunks` to `full`, their page
        copies into `copies` and their commits into `commits`; returns how many chunks need
        a copy. Stops at a chunk the host has no room for, tried again later (the chunks
        after it extend no stored prefix until then). A request written through also writes
        down the layers a tier held already (another request's, in host RAM alone: a
        sessionless one's, or BE work's), in the background: its own chunks after them on the
        SSD would otherwise be out of reach once the host let those go, or after a restart."""
        if full <= st.saved_chunks:
            return 0
        hashes = self.matcher.hashes(st, full)
        durable, owner = self._durable(st), self._owner(st)
        saved = 0
        held_before: list[ChunkKey] = []
        for index in range(st.saved_chunks, full):
            first_page = index * self.pages_per_chunk
            pages = tuple(block_ids[first_page:first_page + self.pages_per_chunk])
            chunk = ChunkKey(self.model_id, hashes[index], index, 0)
            # a chunk refused again, step after step, counts as one refused
            copy, keys = self._reserve(chunk, pages, count_refusal=index != st.refused_chunk,
                                       for_chat=not st.view.background)
            if copy is not None:
                copies.append(copy)
                commits.extend(self._slot_commits(keys, copy, durable, owner))
                saved += 1
                if index == st.refused_chunk:  # a later refusal of it counts again
                    st.refused_chunk = None
            elif not self.held(chunk):  # refused, no host room
                st.saved_chunks = index
                st.refused_chunk = index
                break
            if durable and len(keys) < self.num_layers:
                reserved = set(keys)
                held_before += [layer_key for layer in range(self.num_layers)
                                if (layer_key := chunk.with_layer(layer)) not in reserved]
        else:
            st.saved_chunks = full
        if held_before:
            self._write_down(held_before, owner, commits)
        return saved

    def _reserve(self, key: ChunkKey, pages: tuple[int, ...], count_refusal: bool = True,
                 for_chat: bool = False) -> tuple[PageCopy | None, list[ChunkKey]]:
        """Host slots for the layers of `key` no tier holds; (None, []) if none are needed or
        the arena has no room (then nothing is reserved, and `saves_refused` counts it where
        `count_refusal`). Only a chat turn's (`for_chat`) takes room from advisories and
        waiting BE work: BE work never takes a chat's (an advised session's KV, reclaimed for
        a batch item's saves or checkpoint, left its turn waiting for SSD)."""
        slots: list[int] = []
        reserved: list[ChunkKey] = []
        for layer in range(self.num_layers):
            layer_key = key.with_layer(layer)
            if self.store.contains(layer_key) or self.host.is_reserved(layer_key):
                slots.append(NO_SLOT)
                continue
            slot = self.host.reserve(layer_key)
            if slot is None and for_chat:  # the arena is all pins: take advisories' and
                self.advisories.make_room(1, None)  # BE work's back, try once more
                self._take_back_background_room(1)
                slot = self.host.reserve(layer_key)
            if slot is None:
                for done in reserved:
                    self.host.abort(done)
                self.counters.saves_refused += count_refusal
                return None, []
            slots.append(slot)
            reserved.append(layer_key)
        if not reserved:
            return None, []
        return PageCopy(pages, tuple(slots)), reserved

    def _slot_commits(self, keys: Sequence[ChunkKey], copy: PageCopy, durable: bool,
                      owner: bytes, in_background: bool = False) -> Iterator[SlotCommit]:
        """The commits of the slots `copy` fills for `keys`: a partial chunk's publish only
        its pages' bytes (the rest of a slot is its last occupant's, which the SSD tier would
        otherwise keep under this session's tag past that one's erasure)."""
        num_pages = copy.first_page + len(copy.blocks)
        num_bytes = None if num_pages == self.pages_per_chunk else num_pages * self.page_bytes
        return (SlotCommit(key, durable, owner, num_bytes, in_background) for key in keys)

    def _durable(self, st: RequestState) -> bool:
        """Whether the request's KV is written through to the slowest tier as it is saved
        (`ssd_write_through`); if not, only once it is checkpointed."""
        mode = self.config.ssd_write_through
        if mode == "all":
            return True
        return not st.view.background and (mode == "rt" or st.view.session is not None)

    def _saves_at_checkpoint(self, st: RequestState) -> bool:
        """Whether the request's KV reaches the host tier only when it is checkpointed
        (`background_saves`), not as its chunks fill."""
        return st.view.background and self.config.background_saves == "checkpoint"

    def _write_down(self, keys: Iterable[ChunkKey], owner: bytes,
                    building: list[SlotCommit] | None = None) -> None:
        """Write the chunk-layers `keys` the host tier holds through to the slowest tier
        (saved by `owner`), in the background; those still to be published (another
        request's saves, reserved: in `building`, the commits of the step being built, in
        steps in flight, or a finished request's final saves), when `step_done` publishes
        them, made durable here. (Left to `write_through_later`, which writes down only what
        a tier holds, a chunk a chat turn shared with BE work saving it at that moment stayed
        in host RAM alone, and the session's later chunks on the SSD were out of reach once
        the host let it go.)"""
        keys = list(keys)
        self.store.write_through_later(keys, owner=owner)
        wanted = set(keys)
        for commits in (building or [], self._final_keys,
                        *(in_flight.commits for in_flight in self._in_flight.values())):
            commits[:] = [c._replace(durable=True) if c.key in wanted else c for c in commits]

    @staticmethod
    def _owner(st: RequestState) -> bytes:
        """The tag the tiers keep with what the request saves: its session's, if any."""
        return owner_tag(st.view.session)

    def held(self, key: ChunkKey) -> bool:
        """Every layer of the chunk is in a tier or reserved in the host arena."""
        return all(self.store.contains(k) or self.host.is_reserved(k)
                   for k in (key.with_layer(layer) for layer in range(self.num_layers)))

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
        if not self.preemption.drop(request_id):
            return False
        self.store.clear_hint(_checkpoint_hint(request_id))
        return True

    def _note_evicted(self, keys: list[ChunkKey]) -> None:
        """A tier evicted `keys` (from its thread, its lock held: only noted here)."""
        self._evicted.extend(keys)  # (first: a checkpoint recorded meanwhile finds them
        self.preemption.note_evicted(keys)  # here, or the table notes them)

    def _settle_evictions(self) -> None:
        """Cut the checkpoints whose chunks a full tier evicted (lock held): those requests
        recompute from there, as when the host arena had no room at the checkpoint. Chunks
        evicted from under running requests are lost to them (`checkpoint_cost_pages`)."""
        self.counters.checkpoint_short_tokens += self.preemption.settle_evictions(self.held)
        evicted = []
        while self._evicted:
            evicted.append(self._evicted.popleft())
        self._unsave(evicted, save_again=False)
        if evicted:  # the host tier's copies of what the SSD tier evicted are the last ones
            self.host.note_unbacked(evicted)

    def _unsave(self, keys: Iterable[ChunkKey], *, save_again: bool) -> None:
        """Chunk-layers `keys` left the tiers, or never reached them (lock held). A request
        that counted their chunk saved, and finds no tier holding it otherwise, saves it again
        (`save_again`: its copy failed, the pages are still there) or has lost it: a
        checkpoint copies it (evicted, whose write-through would only evict others)."""
        chunks = {(key.chunk_index, key.prefix_hash): key for key in keys}
        for (index, prefix_hash), key in chunks.items():
            is_held: bool | None = None  # looked up for the first request it is of, if any
            for request_id, st in self._requests.items():
                if index >= st.saved_chunks or st.hashes[index] != prefix_hash:
                    continue
                if is_held is None:
                    is_held = self.held(key)
                if is_held:
                    break
                if save_again:
                    st.saved_chunks = index
                    lost = self._lost_chunks.get(request_id)
                    if lost:
                        self._lost_chunks[request_id] = {i for i in lost if i < index}
                else:
                    self._lost_chunks.setdefault(request_id, set()).add(index)

    def _found_again(self, chunks: set[tuple[int, bytes]]) -> None:
        """`chunks` (index, prefix hash) were just published: a request that lost one (another
        request saved it again) has it again, once a tier holds its every layer."""
        for request_id, lost in self._lost_chunks.items():
            st = self._requests.get(request_id)
            if st is None:
                continue
            hashes = st.hashes
            for index in [i for i in lost if (i, hashes[i]) in chunks]:
                if self.held(ChunkKey(self.model_id, hashes[index], index, 0)):
                    lost.discard(index)

    def _take_back_background_room(self, num_slots: int,
                                   asking: RequestState | None = None) -> None:
        """Host room for `num_slots` slots for a chat turn, taken from BE requests waiting
        for device pages: their pins and fetches are let go, and asked again they match again
        (an RT request takes memory from BE work, never the reverse; BE restores waiting at
        once held the whole arena, and a chat turn recomputed its context). A request vLLM
        has given pages holds no pins here (`plan_load` handed them to its loads), so no
        step's loads lose theirs."""
        room = num_slots * self.host.slot_bytes
        for other in self._requests.values():
            if self.host.can_make_room(room):
                return
            if other is not asking and other.view.background and (
                    other.pins or other.prefetch is not None):
                self._drop_prefetch(other)
                self._unpin(other)
                other.admitted = None

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
            st.start_tokens = st.local_tokens + num_external
        c.computed_prompt_tokens += max(0, num_prompt_tokens - st.local_tokens - num_external)
        st.ssd_chunks, st.fetched_layers, st.fetch_attempts = set(), {}, 0

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
