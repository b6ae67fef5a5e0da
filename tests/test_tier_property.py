"""Property test: the host and SSD tiers behave exactly like the naive memory tier.

Random sequences of put/get/remove/pin/unpin/evict/hint run against all three tiers with the same
eviction policy and equal capacity (in entries); after every step each tier's
`check_integrity()` must hold and all three must agree on results and contents.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from antiphon.tiering.eviction import get_eviction_policy
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.indexed_tier import IndexedTier
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.memory_tier import MemoryTier
from antiphon.tiering.slot_file import stride_for
from antiphon.tiering.ssd_tier import SsdTier

SLOT = 32  # every payload is exactly one slot, so all tiers charge one unit per entry
NUM_ENTRIES = 5  # capacity of each tier, in entries
PREFIXES = [bytes([p]) * 8 for p in range(3)]
KEYS = [ChunkKey("m", p, c, layer) for p in PREFIXES for c in range(2) for layer in range(3)]
STRIDE = stride_for(SLOT)  # what the SSD tier charges an entry: its slot in the file

keys = st.sampled_from(KEYS)


def payload(key: ChunkKey) -> bytes:
    """Content is a function of the key, as with real KV."""
    return bytes((key.prefix_hash[0] * 17 + key.chunk_index * 5 + key.layer + i) % 256
                 for i in range(SLOT))


class TiersAgree(RuleBasedStateMachine):
    reference: MemoryTier
    host: HostTier
    ssd: SsdTier

    @initialize(policy=st.sampled_from(["lru", "layer_priority", "session_lru"]))
    def open_tiers(self, policy: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="antiphon-tier-test-"))
        self.reference = MemoryTier(NUM_ENTRIES * SLOT, policy=get_eviction_policy(policy))
        self.host = HostTier.create(f"antiphon-test-{uuid.uuid4().hex[:12]}", NUM_ENTRIES * SLOT,
                                    SLOT, policy=get_eviction_policy(policy))
        self.ssd = SsdTier(self.directory, NUM_ENTRIES * STRIDE, slot_bytes=SLOT,
                           policy=get_eviction_policy(policy), max_pending_writes=2)
        self.pins: Counter[ChunkKey] = Counter()  # pins the model holds

    @property
    def tiers(self) -> list[IndexedTier]:
        return [self.reference, self.host, self.ssd]

    @rule(key=keys, pin=st.booleans())
    def put(self, key: ChunkKey, pin: bool) -> None:
        results = {tier.put(key, payload(key), pin=pin) for tier in self.tiers}
        assert len(results) == 1
        if pin and results == {True}:
            self.pins[key] += 1

    @rule(key=keys)
    def put_out_of_band(self, key: ChunkKey) -> None:
        """The connector's save path on the host tier: reserve, write the slot, commit."""
        if self.host.contains(key):
            return
        slot = self.host.reserve(key)
        self.host.check_integrity()
        stored = {self.reference.put(key, payload(key)), self.ssd.put(key, payload(key))}
        assert stored == {slot is not None}
        if slot is not None:
            self.host.arena.write(slot, payload(key))
            assert self.host.commit(key, SLOT)

    @rule(key=keys)
    def get(self, key: ChunkKey) -> None:
        results = {tier.get(key) for tier in self.tiers}
        assert results in ({None}, {payload(key)})

    @rule(key=keys)
    def remove(self, key: ChunkKey) -> None:
        results = {tier.remove(key) for tier in self.tiers}
        assert results == {False} if self.pins[key] else len(results) == 1

    @rule(key=keys)
    def pin(self, key: ChunkKey) -> None:
        results = {tier.pin(key) for tier in self.tiers}
        assert len(results) == 1
        if results == {True}:
            self.pins[key] += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(self.pins.elements(), key=KEYS.index)
        if not pinned:
            return
        key = data.draw(st.sampled_from(pinned))
        for tier in self.tiers:
            tier.unpin(key)
        self.pins[key] -= 1

    @rule(num_entries=st.integers(0, NUM_ENTRIES))
    def evict(self, num_entries: int) -> None:
        counts = {self.reference.evict(num_entries * SLOT), self.host.evict(num_entries * SLOT),
                  self.ssd.evict(num_entries * STRIDE)}
        assert len(counts) == 1

    @rule(session=st.integers(0, 2), prefixes=st.lists(st.sampled_from(PREFIXES), max_size=2),
          likelihood=st.floats(0.0, 1.0))
    def hint(self, session: int, prefixes: list[bytes], likelihood: float) -> None:
        for tier in self.tiers:
            tier.set_hint(session, prefixes, likelihood)

    @rule()
    def flush(self) -> None:
        self.ssd.flush()

    @invariant()
    def consistent(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        contents = [set(tier.keys()) for tier in self.tiers]
        assert contents[0] == contents[1] == contents[2]
        assert set(self.pins.elements()) <= contents[0], "a pinned key was evicted"
        assert self.reference.used_bytes == len(contents[0]) * SLOT <= NUM_ENTRIES * SLOT

    def teardown(self) -> None:
        if not hasattr(self, "ssd"):
            return
        try:
            self.ssd.flush()
            self.ssd.check_integrity()  # the slot file matches the index once written
        finally:
            for tier in self.tiers:
                tier.close()
            shutil.rmtree(self.directory, ignore_errors=True)


TiersAgree.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_tiers_agree = TiersAgree.TestCase
