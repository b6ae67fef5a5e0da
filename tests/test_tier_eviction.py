"""Eviction policies, the chunk index, and capacity behaviour of a tier under each policy."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from antiphon.tiering.eviction import (
    EVICTION_POLICIES,
    LayerPriorityPolicy,
    LruPolicy,
    SessionLruPolicy,
    get_eviction_policy,
)
from antiphon.tiering.index import ChunkIndex
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.memory_tier import MemoryTier

MODEL = "m"


def key(prefix: str, chunk: int = 0, layer: int = 0) -> ChunkKey:
    return ChunkKey(MODEL, prefix.encode(), chunk, layer)


def drain(policy: LruPolicy | LayerPriorityPolicy) -> list[ChunkKey]:
    order = []
    while (victim := policy.pop_victim()) is not None:
        order.append(victim)
    return order


def test_registry_lists_valid_names() -> None:
    assert set(EVICTION_POLICIES) == {"lru", "layer_priority", "session_lru"}
    assert isinstance(get_eviction_policy("lru"), LruPolicy)
    with pytest.raises(ValueError,
                       match="valid eviction policies: layer_priority, lru, session_lru"):
        get_eviction_policy("fifo")


def test_lru_order_follows_use() -> None:
    policy = LruPolicy()
    a, b, c = key("a"), key("b"), key("c")
    for k in (a, b, c):
        policy.on_insert(k)
    policy.on_access(a)
    policy.on_remove(b)
    assert drain(policy) == [c, a]


def test_layer_priority_evicts_highest_layers_first() -> None:
    policy = LayerPriorityPolicy()
    keys = [key("s", chunk, layer) for layer in range(3) for chunk in range(2)]
    for k in keys:
        policy.on_insert(k)
    assert [(k.layer, k.chunk_index) for k in drain(policy)] == [
        (2, 1), (2, 0), (1, 1), (1, 0), (0, 1), (0, 0)]


def test_layer_priority_takes_whole_chunks_no_tier_below_holds() -> None:
    """A key no tier below holds is useless once its chunk loses a layer: ranked by layer, a
    full host tier of KV not written through took the top layer of chunk after chunk and
    kept lower layers no turn could load."""
    below = {key("saved", 0, layer) for layer in range(3)}
    policy = LayerPriorityPolicy()
    policy.is_backed = below.__contains__
    for chunk, prefix in ((0, "saved"), (0, "unsaved"), (1, "unsaved")):
        for layer in range(3):
            policy.on_insert(key(prefix, chunk, layer))
    order = [(k.prefix_hash.decode(), k.chunk_index, k.layer) for k in drain(policy)]
    # the top layers of what a read brings back first, then whole chunks, the later first
    assert order[:2] == [("saved", 0, 2), ("saved", 0, 1)]
    unsaved = [(c, layer) for p, c, layer in order if p == "unsaved"]
    assert unsaved == [(1, 0), (1, 1), (1, 2), (0, 0), (0, 1), (0, 2)]


def test_a_host_tier_full_of_kv_without_a_copy_keeps_whole_chunks(tmp_path: Path) -> None:
    from tests.test_tier_planner import LAYERS, make_planner, run_turn

    planner = make_planner(tmp_path / "ssd")  # 64 host slots, layer_priority above SSD
    try:
        for r in range(12):  # turns without a session: not written through to SSD
            run_turn(planner, f"r{r}", [1000 * (r + 1) + i for i in range(25)],
                     list(range(1, 8)), session=None)
        held = planner.host.keys()
        assert len(held) == 64 and planner.store.tiers[1].keys() == []
        layers: dict[tuple[bytes, int], set[int]] = {}
        for k in held:
            layers.setdefault((k.prefix_hash, k.chunk_index), set()).add(k.layer)
        assert all(len(found) == LAYERS for found in layers.values())  # every chunk whole
    finally:
        planner.close()


def test_a_key_the_tier_below_evicted_is_ranked_as_its_only_copy() -> None:
    below = {key(prefix, 0, layer) for prefix in "ab" for layer in range(2)}
    policy = LayerPriorityPolicy()
    policy.is_backed = below.__contains__
    for prefix in "ab":
        for layer in range(2):
            policy.on_insert(key(prefix, 0, layer))
    below -= {key("a", 0, layer) for layer in range(2)}  # the tier below evicted chunk a
    for layer in range(2):
        policy.on_unbacked(key("a", 0, layer))
    policy.on_unbacked(key("gone"))  # (a key it does not track: ignored)
    # b's top layer, held below, then by recency, a's chunk whole as a layer 0 (`priority`)
    assert drain(policy) == [key("b", 0, 1), key("a", 0, 0), key("a", 0, 1), key("b", 0, 0)]


def test_the_host_tier_keeps_whole_the_chunks_the_ssd_tier_evicted(tmp_path: Path) -> None:
    # The host tier looked at whether the SSD tier held a key only when it stored it: once the
    # SSD tier evicted a chunk, the host still took that chunk's top layers first, the only
    # copies, and kept lower layers no turn could load.
    from tests.test_tier_planner import make_planner, run_step, run_turn

    planner = make_planner(tmp_path / "ssd", ssd_tier_bytes=4 * 8192)  # 4 slots
    ssd = planner.store.tiers[1]
    try:
        run_turn(planner, "a", list(range(100, 109)), [1, 2, 3], session="sa")
        ssd.flush()
        first = set(ssd.keys())
        assert len(first) == 4  # both chunks of turn a, each of 2 layers
        run_turn(planner, "b", list(range(200, 209)), [4, 5, 6], session="sb")
        ssd.flush()
        assert not first & set(ssd.keys()) and first <= set(planner.host.keys())
        run_step(planner, [])  # (the planner hears of the SSD tier's evictions)
        host = planner.host
        assert host.evict(host.capacity_bytes - host.used_bytes + 1) == 1
        gone = set(ssd.keys()) - set(planner.host.keys())
        assert len(gone) == 1 and next(iter(gone)).layer == 1  # a top layer the SSD holds
    finally:
        planner.close()


def test_layer_priority_likelihood_then_size() -> None:
    policy = LayerPriorityPolicy()
    likely = [key("likely", 0, layer) for layer in range(2)]
    small = [key("small", 0, layer) for layer in range(2)]
    big = [key("big0", 0, layer) for layer in range(2)]
    for k in likely + small + big:
        policy.on_insert(k)
    policy.set_hint("advised", [b"likely"], 1.0)
    policy.set_hint("small-session", [b"small"], 0.2)
    policy.set_hint("big-session", [b"big0", b"big1", b"big2"], 0.2)
    order = drain(policy)
    # Unlikely sessions go first, top layers before bottom ones, the smaller session first;
    # the session with a pending advisory goes last.
    assert order == [small[1], big[1], small[0], big[0], likely[1], likely[0]]


def test_layer_priority_drops_the_smaller_sessions_first_also_without_hints() -> None:
    """Only an advisory or a checkpoint gave a session a size: the sessions no hint covers,
    most of them, ranked as size 0, and the largest session's last chunks went first, where
    Symphony drops the smaller sessions' first (found by a review)."""
    policy = LayerPriorityPolicy()
    small = [key("s0", 0, layer) for layer in range(2)]
    big = [key(f"b{c}", c, layer) for c in range(4) for layer in range(2)]
    for k in small + big:
        policy.on_insert(k)
    policy.note_sequence([b"s0"])
    policy.note_sequence([b"b0", b"b1", b"b2", b"b3"])
    policy.note_sequence([b"b0", b"b1"])  # an earlier turn of it: the longest counts
    assert [policy.pop_victim() for _ in range(2)] == [small[1], big[7]]
    # A prefix two sequences share ranks by the longer: the big session's first chunk is
    # kept like its others, though a 1-chunk session noted it too.
    policy.note_sequence([b"b0"])
    assert policy.priority(big[1])[2] == 4
    # A hint ranks a session as before.
    policy.set_hint("advised", [b"b0", b"b1", b"b2", b"b3"], 1.0)
    assert policy.pop_victim() == small[0]
    policy.check_integrity(set(big[:7]))
    # A prefix whose keys left (pinned by a turn's loads, say) keeps its size for when they
    # come back; the sizes of prefixes with no key here are kept up to a bound, the most
    # recently noted first.
    for k in big[:7]:
        policy.on_remove(k)
    policy.on_insert(big[3])  # (prefix b1's)
    assert policy.priority(big[3])[2] == 4
    for i in range(5000):
        policy.note_sequence([f"gone{i}".encode()])
    assert len(policy._sizes) <= 1 + 1 + 1024 and b"gone4999" in policy._sizes
    assert policy._sizes[b"b1"] == 4


def test_a_pinned_chunk_keeps_its_sessions_size() -> None:
    """A pin takes a key from the policy and the unpin gives it back: the size noted for
    its prefix went with the pin, so a session whose turn had loaded its chunks ranked as
    size 0 and lost its top layers before a 1-chunk session (found by a review)."""
    tier = MemoryTier(10 * 8, policy=LayerPriorityPolicy())
    small = [key("s0", 0, layer) for layer in range(2)]
    big = [key(f"b{c}", c, layer) for c in range(4) for layer in range(2)]
    for k in small + big:
        assert tier.put(k, b"x" * 8)
    tier.note_sequence([b"s0"])
    tier.note_sequence([b"b0", b"b1", b"b2", b"b3"])
    assert tier.pin_all(big)  # a turn of the big session loads it all
    tier.unpin_all(big)  # its loads landed
    assert tier.evict(8) == 1
    assert set(tier.keys()) == set(small + big) - {small[1]}  # the smaller session's top


def test_clearing_a_hint_makes_a_session_evictable_again() -> None:
    policy = LayerPriorityPolicy()
    kept, other = key("kept", 0, 5), key("other", 0, 0)
    policy.on_insert(kept)
    policy.on_insert(other)
    policy.set_hint("s", [b"kept"], 1.0)
    assert policy.pop_victim() == other
    policy.on_insert(other)
    policy.clear_hint("s")
    assert policy.pop_victim() == kept  # layer 5 before layer 0 once the hint is gone
    with pytest.raises(ValueError):
        policy.set_hint("s", [b"kept"], 1.5)


def test_session_lru_evicts_whole_chunks_of_the_least_recent_session() -> None:
    policy = SessionLruPolicy()
    old, recent, advised = ([key(p, chunk, layer) for chunk in range(2) for layer in range(3)]
                            for p in ("old", "recent", "advised"))
    for k in advised + old + recent:  # stored in this order, each chunk's layers together
        policy.on_insert(k)
    policy.set_hint("s", [b"advised"], 1.0)
    for k in old[:3]:  # a turn read the old session's first chunk again
        policy.on_access(k)
    # Every layer of one chunk before any of the next, least recently used first; the
    # advised session last whatever its age.
    assert drain(policy) == old[3:] + recent + old[:3] + advised


@pytest.mark.parametrize("policy_class", [LayerPriorityPolicy, SessionLruPolicy])
def test_heap_matches_naive_sort(policy_class: type[LayerPriorityPolicy]) -> None:
    """The lazy heap pops in exactly the order a full sort by `priority` gives."""
    rng = random.Random(7)
    policy = policy_class()
    tracked: set[ChunkKey] = set()
    universe = [key(f"p{p}", c, layer) for p in range(4) for c in range(3) for layer in range(4)]
    for step in range(2000):
        k = rng.choice(universe)
        op = rng.random()
        if op < 0.4:
            if k not in tracked:
                policy.on_insert(k)
                tracked.add(k)
        elif op < 0.6:
            policy.on_access(k)
        elif op < 0.7:
            policy.on_remove(k)
            tracked.discard(k)
        elif op < 0.8:
            policy.set_hint(rng.randrange(3), [f"p{rng.randrange(4)}".encode()], rng.random())
        elif op < 0.85:
            policy.clear_hint(rng.randrange(3))
        elif op < 0.9:
            policy.note_sequence([f"p{p}".encode() for p in range(rng.randrange(1, 5))])
        elif tracked:
            expected = min(tracked, key=policy.priority)
            assert policy.pop_victim() == expected
            tracked.discard(expected)
        if step % 100 == 0:
            policy.check_integrity(tracked)
    expected_order = sorted(tracked, key=policy.priority)
    assert drain(policy) == expected_order


def test_stale_entries_are_dropped_a_few_per_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """No call rebuilds the heap at once (at 10^6 keys that took a second): stale entries
    move out a few per operation, the heap stays within a few times the live keys, and the
    order is still exactly a full sort's."""
    from antiphon.tiering import eviction

    def no_rebuild(heap: list[object]) -> None:
        raise AssertionError("the heap was rebuilt in one call")

    monkeypatch.setattr(eviction.heapq, "heapify", no_rebuild)
    rng = random.Random(3)
    policy = LayerPriorityPolicy()
    keys = [key(f"p{p}", c, layer) for p in range(50) for c in range(4) for layer in range(4)]
    for k in keys:
        policy.on_insert(k)
    tracked = set(keys)
    for step in range(20_000):
        k = rng.choice(keys)
        if k in tracked and rng.random() < 0.1:
            policy.on_remove(k)
            tracked.discard(k)
        elif k in tracked:
            policy.on_access(k)
        else:
            policy.on_insert(k)
            tracked.add(k)
        entries = len(policy._heap) + len(policy._old)
        assert entries <= 3 * len(tracked) + 2 * 64, (step, entries, len(tracked))
    policy.check_integrity(tracked)
    expected = sorted(tracked, key=policy.priority)
    assert drain(policy) == expected


def test_index_make_room_refuses_when_pins_forbid() -> None:
    index: ChunkIndex[int] = ChunkIndex(30, LruPolicy())
    a, b, c = key("a"), key("b"), key("c")
    index.insert(a, 0, 10, pin=True)
    index.insert(b, 1, 10)
    index.insert(c, 2, 10)
    assert index.make_room(25) is None  # only 20 evictable bytes: evict nothing
    assert len(index) == 3
    evicted = index.make_room(10)
    assert evicted is not None and [k for k, _ in evicted] == [b]
    index.unpin(a)
    with pytest.raises(ValueError):
        index.unpin(a)
    index.unpin(key("absent"))  # dropped while pinned: a no-op
    index.check_integrity()


@pytest.mark.parametrize("policy_name", ["lru", "layer_priority"])
def test_tier_capacity_evicts_and_never_evicts_pinned(policy_name: str) -> None:
    tier = MemoryTier(40, policy=get_eviction_policy(policy_name))
    pinned = key("pinned", 0, 9)  # the top layer: first to go if it were not pinned
    assert tier.put(pinned, b"p" * 10, pin=True)
    for i in range(10):
        assert tier.put(key(f"k{i}", 0, i % 3), bytes([i]) * 10)
        tier.check_integrity()
        assert tier.used_bytes <= 40
        assert tier.contains(pinned)
    assert tier.stats.evictions == 7
    assert len(tier.keys()) == 4
    assert not tier.remove(pinned)  # pinned entries are not removed either
    tier.unpin(pinned)
    assert tier.remove(pinned)
    tier.check_integrity()


def test_tier_refuses_when_everything_is_pinned() -> None:
    tier = MemoryTier(20)
    assert tier.put(key("a"), b"a" * 10, pin=True)
    assert tier.put(key("b"), b"b" * 10, pin=True)
    assert not tier.put(key("c"), b"c" * 10)
    assert tier.stats.refused == 1
    assert not tier.put(key("big"), b"x" * 21)  # larger than the whole tier
    assert tier.evict(20) == 0
    tier.unpin(key("a"))
    assert tier.evict(10) == 1 and not tier.contains(key("a"))
    tier.check_integrity()


def test_layer_priority_tier_drops_top_layers_of_unlikely_session() -> None:
    tier = MemoryTier(6 * 4, policy=LayerPriorityPolicy())
    for prefix in ("advised", "idle"):
        for layer in range(3):
            tier.put(key(prefix, 0, layer), b"x" * 4)
    tier.set_hint("s1", [b"advised"], 1.0)
    tier.set_hint("s2", [b"idle"], 0.1)
    tier.set_hint("s3", [b"new"], 0.5)
    for layer in range(2):
        assert tier.put(key("new", 0, layer), b"y" * 4)
    stored = tier.keys()
    held = {(k.prefix_hash, k.layer) for k in stored}
    assert (b"idle", 2) not in held and (b"idle", 1) not in held
    assert (b"idle", 0) in held
    assert all((b"advised", layer) in held for layer in range(3))
    tier.check_integrity()


def test_full_lowest_tier_keeps_the_recent_session_whole() -> None:
    """A full tier holding the only copy: `layer_priority` would take the top layers of every
    session, leaving none loadable; `session_lru` drops the least recent session whole."""
    layers, size = 4, 4
    tier = MemoryTier(2 * layers * size, policy=SessionLruPolicy())
    for prefix in ("stale", "recent", "newest"):
        for layer in range(layers):
            assert tier.put(key(prefix, 0, layer), b"x" * size)
    stored = tier.keys()
    held = {(k.prefix_hash, k.layer) for k in stored}
    assert held == {(p, layer) for p in (b"recent", b"newest") for layer in range(layers)}
    tier.check_integrity()


SIZE_PREFIXES = [bytes([p]) * 8 for p in range(4)]
SIZE_KEYS = [ChunkKey("m", p, i, layer) for i, p in enumerate(SIZE_PREFIXES)
             for layer in range(2)]


class SizesKept(RuleBasedStateMachine):
    """In a tier under `LayerPriorityPolicy`, every evictable key ranks by the longest
    sequence noted through its prefix, whatever was stored, evicted, pinned and unpinned
    meanwhile (a review's state machine: `note(1); put(k); pin(k); unpin(k)` lost it)."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = MemoryTier(6 * 4, policy=LayerPriorityPolicy())
        self.sizes: dict[bytes, int] = {}  # the longest sequence noted through each prefix
        self.pins: collections.Counter[ChunkKey] = collections.Counter()

    @rule(key=st.sampled_from(SIZE_KEYS))
    def put(self, key: ChunkKey) -> None:
        self.tier.put(key, b"abcd")

    @rule(n=st.integers(1, 4))
    def note(self, n: int) -> None:
        self.tier.note_sequence(SIZE_PREFIXES[:n])
        for prefix in SIZE_PREFIXES[:n]:
            self.sizes[prefix] = max(self.sizes.get(prefix, 0), n)

    @rule(key=st.sampled_from(SIZE_KEYS))
    def pin(self, key: ChunkKey) -> None:
        if self.tier.pin(key):
            self.pins[key] += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(self.pins.elements(), key=SIZE_KEYS.index)
        if pinned:
            key = data.draw(st.sampled_from(pinned))
            self.tier.unpin(key)
            self.pins[key] -= 1

    @invariant()
    def ranks_by_noted_size(self) -> None:
        policy = self.tier.policy
        assert isinstance(policy, LayerPriorityPolicy)
        for key in policy.tracked_keys():
            assert policy.priority(key)[2] == self.sizes.get(key.prefix_hash, 0), key
        self.tier.check_integrity()


SizesKept.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_sizes_are_kept_through_pins_and_evictions = SizesKept.TestCase
