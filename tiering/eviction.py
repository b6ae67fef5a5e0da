"""Eviction policies: which evictable chunk-layer a full tier drops next.

A policy only orders keys; it stores nothing and never sees pinned entries (a tier tells it
`on_remove` when a key is pinned and `on_insert` when it is unpinned). Policies are picked by
name with `get_eviction_policy`; each tier owns its own instance.

- `lru`: least recently stored or read first.
- `layer_priority` (Symphony, section 3.3): the least likely session first; within it the
  highest layers first (the lowest layers are needed first when a turn starts, so they stay);
  then the smaller sessions (cheaper to recompute), then later chunks before earlier ones (a
  prefix is useless without its start), then least recently used. Likelihoods are hints, for
  example 1.0 for a session with a pending advisory. Symphony orders this way only the tiers
  above one that holds a copy of everything: dropping a chunk's top layers there costs a read
  from below, not a recompute. So a key no tier below holds (`is_backed`: KV not written
  through, BE work's or a turn's without a session) is ranked as if in layer 0, and its chunk
  goes whole, after the top layers of those below hold: ranked by layer, a host tier full of
  such KV kept the lower layers of 26 chunks whose top layers it had dropped, and no chunk a
  turn could load.
- `session_lru`: the lowest tier's order, where an evicted layer is gone (`build_tiered_store`
  gives it to the lowest tier, whatever `eviction_policy` says): the least likely session first, then
  the least recently stored or read. A chunk's layers are stored and read together, so whole
  chunks go, oldest first. Under `layer_priority` a full lowest tier took the top layers of
  every chunk it held, recently used or not, and with them every session's KV (a 64-user
  `bench sessions` point recomputed 73% of its prior context).
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence, Set
from typing import ClassVar

from antiphon.tiering.keys import ChunkKey


class EvictionPolicy(abc.ABC):
    """Orders the evictable keys of one tier. Not thread-safe: the tier's lock covers it."""

    name: ClassVar[str]
    # Whether a tier below holds a copy of a key (`build_tiered_store` sets it for a tier above
    # the lowest); None: every key is held below.
    is_backed: Callable[[ChunkKey], bool] | None = None

    @abc.abstractmethod
    def on_insert(self, key: ChunkKey) -> None:
        """`key` became evictable: it was stored, or its last pin was released."""

    @abc.abstractmethod
    def on_access(self, key: ChunkKey) -> None:
        """`key` (evictable) was read or stored again."""

    @abc.abstractmethod
    def on_remove(self, key: ChunkKey) -> None:
        """`key` is no longer evictable: removed, or pinned. Unknown keys are ignored."""

    def on_unbacked(self, key: ChunkKey) -> None:
        """The tier below dropped `key` (evicted it): a policy that ranks keys by whether a
        copy lies below (`is_backed`) ranks it again. Unknown keys are ignored."""
        return None  # (the others' order does not depend on it)

    @abc.abstractmethod
    def pop_victim(self) -> ChunkKey | None:
        """The next key to evict, which the policy then forgets; None when nothing is evictable."""

    @abc.abstractmethod
    def tracked_keys(self) -> Set[ChunkKey]:
        """The keys the policy currently considers evictable."""

    def set_hint(self, session: Hashable, prefix_hashes: Sequence[bytes],
                 likelihood: float) -> None:
        """Tell the policy how likely `session` (any hashable id, not user text) is to return.

        `prefix_hashes` are the session's chunk prefix hashes in chunk order; `likelihood` is in
        [0, 1], higher keeps the session longer. A new hint for a session replaces the old one.
        Policies that ignore hints keep this default.
        """
        return None

    def clear_hint(self, session: Hashable) -> None:
        """Forget `session`'s hint (unknown sessions are ignored)."""
        return None

    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        """A sequence of these chunks (prefix hashes in chunk order) was stored: a policy
        that ranks by size ranks each of them by the longest sequence noted through it.
        Policies that ignore sizes keep this default."""
        return None

    def check_integrity(self, evictable: Set[ChunkKey]) -> None:
        """Assert the policy tracks exactly `evictable`."""
        tracked = self.tracked_keys()
        assert tracked == evictable, (
            f"{self.name}: policy tracks {len(tracked)} keys, tier has {len(evictable)} "
            f"evictable; extra {list(tracked - evictable)[:3]}, "
            f"missing {list(evictable - tracked)[:3]}")


class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()  # oldest first

    def on_insert(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> ChunkKey | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def tracked_keys(self) -> Set[ChunkKey]:
        return self._order.keys()


@dataclasses.dataclass(frozen=True)
class SessionHint:
    likelihood: float  # in [0, 1]: how likely the session is to send another turn
    num_chunks: int  # the session's length in chunks ("size" in Symphony's order)
    prefix_hashes: frozenset[bytes]


Priority = tuple[float, ...]
COMPACT_PER_OP = 16  # stale-heavy heap entries `_maybe_compact` moves per operation


class LayerPriorityPolicy(EvictionPolicy):
    """Symphony's order; a heap with lazy deletion, so each operation costs O(log n)."""

    name = "layer_priority"

    def __init__(self, default_likelihood: float = 0.0) -> None:
        self.default_likelihood = default_likelihood  # of keys no hint covers
        self._tick = 0  # logical clock for recency
        self._last_use: dict[ChunkKey, int] = {}
        self._priority: dict[ChunkKey, Priority] = {}  # current priority of each tracked key
        self._heap: list[tuple[Priority, int, ChunkKey]] = []  # may hold stale entries
        # A heap of stale-heavy entries being moved into `_heap` a few per operation
        # (`_maybe_compact`), and the keys moved so far.
        self._old: list[tuple[Priority, int, ChunkKey]] = []
        self._moved: set[ChunkKey] = set()
        self._seq = 0  # heap tie-breaker: keys themselves are not ordered
        self._keys_by_prefix: dict[bytes, set[ChunkKey]] = {}
        self._sessions: dict[Hashable, SessionHint] = {}
        self._sessions_by_prefix: dict[bytes, set[Hashable]] = {}
        # `_session_rank` per prefix: a prefix every session shares (a system prompt) has one
        # hint per session, and each of its keys' priorities would otherwise scan them all.
        self._ranks: dict[bytes, tuple[float, int]] = {}
        # The longest sequence noted through each prefix (`note_sequence`), in chunks: the
        # size of a session no hint covers. In the order last noted; kept while the prefix
        # has keys here, and otherwise (keys pinned, being saved, or gone) up to
        # `_prune_sizes`'s bound, the most recently noted first.
        self._sizes: dict[bytes, int] = {}
        self._unbacked: set[ChunkKey] = set()  # tracked keys no tier below held when last used

    def priority(self, key: ChunkKey) -> Priority:
        """Eviction rank of a tracked key, smallest evicted first:
        `(likelihood, -layer, session_chunks, -chunk_index, last_use_tick)`, with layer 0
        for a key no tier below holds."""
        likelihood, num_chunks = self._session_rank(key.prefix_hash)
        layer = 0 if key in self._unbacked else key.layer
        return (likelihood, -layer, num_chunks, -key.chunk_index, self._last_use[key])

    def on_insert(self, key: ChunkKey) -> None:
        self._keys_by_prefix.setdefault(key.prefix_hash, set()).add(key)
        # Looked at when the key is stored or unpinned, not on each read: a write-through
        # keeps it pinned until it is below, and a write-down pins it meanwhile.
        if self.is_backed is not None and not self.is_backed(key):
            self._unbacked.add(key)
        else:
            self._unbacked.discard(key)
        self._touch(key)

    def on_access(self, key: ChunkKey) -> None:
        if key in self._priority:
            self._touch(key)

    def on_remove(self, key: ChunkKey) -> None:
        if self._priority.pop(key, None) is None:
            return
        del self._last_use[key]
        self._unbacked.discard(key)
        siblings = self._keys_by_prefix[key.prefix_hash]
        siblings.discard(key)
        if not siblings:
            del self._keys_by_prefix[key.prefix_hash]
            # (its size stays: a pin removes a key too, and the key comes back with the
            # unpin; a turn's loads pin its session's chunks, which then ranked as size 0
            # until the turn ended. `_prune_sizes` forgets it once it is old.)

    def on_unbacked(self, key: ChunkKey) -> None:
        # (is_backed is looked at on insert and unpin: a key the tier below evicted since
        # kept its rank by layer, and its chunk's top layers, the only copy now, went first)
        if (key in self._priority and key not in self._unbacked
                and self.is_backed is not None and not self.is_backed(key)):
            self._unbacked.add(key)
            self._push(key)

    def pop_victim(self) -> ChunkKey | None:
        for heap in (self._heap, self._old):  # stale tops off, so each top is live
            while heap and self._priority.get(heap[0][2]) != heap[0][0]:
                heapq.heappop(heap)
        heaps = [heap for heap in (self._heap, self._old) if heap]
        if not heaps:
            return None
        _, _, key = heapq.heappop(min(heaps, key=lambda heap: heap[0][:2]))
        self.on_remove(key)
        return key

    def tracked_keys(self) -> Set[ChunkKey]:
        return self._priority.keys()

    def set_hint(self, session: Hashable, prefix_hashes: Sequence[bytes],
                 likelihood: float) -> None:
        if not 0.0 <= likelihood <= 1.0:
            raise ValueError(f"likelihood must be in [0, 1], got {likelihood}")
        self.clear_hint(session)
        hint = SessionHint(likelihood, len(prefix_hashes), frozenset(prefix_hashes))
        self._sessions[session] = hint
        for prefix in hint.prefix_hashes:
            self._sessions_by_prefix.setdefault(prefix, set()).add(session)
            self._ranks.pop(prefix, None)
        self._reprioritise(hint.prefix_hashes)

    def clear_hint(self, session: Hashable) -> None:
        hint = self._sessions.pop(session, None)
        if hint is None:
            return
        for prefix in hint.prefix_hashes:
            sessions = self._sessions_by_prefix[prefix]
            sessions.discard(session)
            if not sessions:
                del self._sessions_by_prefix[prefix]
            self._ranks.pop(prefix, None)
        self._reprioritise(hint.prefix_hashes)

    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        grown: set[bytes] = set()
        sizes = self._sizes
        for prefix in prefix_hashes:
            size = sizes.pop(prefix, 0)  # (noted again: to the end of the order)
            sizes[prefix] = max(size, len(prefix_hashes))
            if size < len(prefix_hashes):
                grown.add(prefix)
        self._prune_sizes()
        self._reprioritise(grown - self._sessions_by_prefix.keys())  # (a hint ranks those)

    def check_integrity(self, evictable: Set[ChunkKey]) -> None:
        super().check_integrity(evictable)
        assert self._last_use.keys() == self._priority.keys(), "recency and priority disagree"
        for key, priority in self._priority.items():
            assert priority == self.priority(key), f"stale priority for {key}"
        live = {key for priority, _, key in (*self._heap, *self._old)
                if self._priority.get(key) == priority}
        assert live == self._priority.keys(), "a tracked key has no live heap entry"
        indexed = {key for keys in self._keys_by_prefix.values() for key in keys}
        assert indexed == self._priority.keys(), "prefix index disagrees with tracked keys"
        assert self._unbacked <= self._priority.keys(), "an untracked key is ranked unbacked"
        for session, hint in self._sessions.items():
            for prefix in hint.prefix_hashes:
                assert session in self._sessions_by_prefix[prefix], "session index broken"
        for prefix, rank in self._ranks.items():
            assert rank == max((self._sessions[s].likelihood, self._sessions[s].num_chunks)
                               for s in self._sessions_by_prefix[prefix]), "stale rank"

    def _session_rank(self, prefix: bytes) -> tuple[float, int]:
        """(likelihood, num_chunks) of the most likely session holding `prefix`."""
        rank = self._ranks.get(prefix)
        if rank is None:
            sessions = self._sessions_by_prefix.get(prefix)
            if not sessions:
                return (self.default_likelihood, self._sizes.get(prefix, 0))
            rank = self._ranks[prefix] = max(
                (self._sessions[s].likelihood, self._sessions[s].num_chunks) for s in sessions)
        return rank

    def _max_untracked_sizes(self) -> int:
        """How many sizes of prefixes with no evictable key here are kept at most: as many as
        prefixes with keys, and 1,024 more (their keys pinned by a turn's loads, still being
        saved, or gone)."""
        return len(self._keys_by_prefix) + 1024

    def _prune_sizes(self) -> None:
        """Past the bound, forget the oldest noted of the prefixes with no evictable key here,
        down to half the bound (so a prune is rare)."""
        bound = self._max_untracked_sizes()
        if len(self._sizes) <= len(self._keys_by_prefix) + bound:
            return
        untracked = [prefix for prefix in self._sizes if prefix not in self._keys_by_prefix]
        for prefix in untracked[:max(0, len(untracked) - bound // 2)]:
            del self._sizes[prefix]

    def _touch(self, key: ChunkKey) -> None:
        self._tick += 1
        self._last_use[key] = self._tick
        self._push(key)

    def _push(self, key: ChunkKey) -> None:
        priority = self.priority(key)
        self._priority[key] = priority
        self._seq += 1
        heapq.heappush(self._heap, (priority, self._seq, key))
        self._maybe_compact()

    def _reprioritise(self, prefixes: Set[bytes]) -> None:
        for prefix in prefixes:
            for key in self._keys_by_prefix.get(prefix, ()):
                self._push(key)  # which compacts as it goes

    def _maybe_compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones, a few per operation:
        rebuilding a heap of 10^6 keys at once stopped the caller for a second. The full heap
        becomes `_old`, which `pop_victim` still reads, and its live entries move into a new
        `_heap`, `COMPACT_PER_OP` per call (taking a heap's last entry keeps it a heap)."""
        if not self._old:
            if len(self._heap) <= 2 * len(self._priority) + 64:
                return
            self._old, self._heap, self._moved = self._heap, [], set()
        for _ in range(COMPACT_PER_OP):
            if not self._old:
                self._moved = set()
                return
            entry = self._old.pop()
            key = entry[2]
            if self._priority.get(key) == entry[0] and key not in self._moved:
                self._moved.add(key)
                heapq.heappush(self._heap, entry)


class SessionLruPolicy(LayerPriorityPolicy):
    """Least likely session first, then least recently used (the hints and the heap of
    `LayerPriorityPolicy`, ranked by recency instead of layer)."""

    name = "session_lru"

    def priority(self, key: ChunkKey) -> Priority:
        """`(likelihood, last_use_tick)`, smallest evicted first."""
        return (self._session_rank(key.prefix_hash)[0], self._last_use[key])

    def note_sequence(self, prefix_hashes: Sequence[bytes]) -> None:
        return None  # (sizes do not rank here: re-ranking a session's keys at each turn's
        # end cost the SSD tier 17 ms a turn of a 32k-token context, for nothing)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LruPolicy, LayerPriorityPolicy, SessionLruPolicy)}


def eviction_policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class called `name`; raises ValueError listing the valid names."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid eviction policies: "
                         f"{', '.join(sorted(EVICTION_POLICIES))}") from None


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A new instance of the policy called `name` (one per tier)."""
    return eviction_policy_class(name)()
