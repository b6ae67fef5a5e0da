"""antiphon.tiering: session KV across tiers (host shared memory, SSD files).

The storage half of KV tiering; the vLLM connector calls it. Modules, one mechanism each:

- `keys`: `ChunkKey` and chained prefix hashes
- `tier`: the `Tier` interface; `indexed_tier`: the bookkeeping local tiers share
- `index`: per-tier key index with byte budget and pins; `eviction`: eviction policies
- `memory_tier`: naive dict tier (reference and test double)
- `slots`, `host_arena`, `host_tier`: slot allocator, shared-memory arena, host tier
- `slot_file`, `write_behind`, `ssd_tier`: slot file format, writer thread, SSD tier
- `manager`: `TieredStore`; `prefetch`: layer-order prefetch; `config`, `build`
"""

from antiphon.tiering.build import build_tiered_store
from antiphon.tiering.config import TieringConfig
from antiphon.tiering.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LayerPriorityPolicy,
    LruPolicy,
    get_eviction_policy,
)
from antiphon.tiering.host_arena import HostArena
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.keys import ChunkKey, chunk_keys, prefix_hashes
from antiphon.tiering.manager import TieredStore
from antiphon.tiering.memory_tier import MemoryTier
from antiphon.tiering.prefetch import LayerProgress, PrefetchHandle
from antiphon.tiering.ssd_tier import SsdTier
from antiphon.tiering.stats import TierStats
from antiphon.tiering.tier import Tier

__all__ = [
    "EVICTION_POLICIES",
    "ChunkKey",
    "EvictionPolicy",
    "HostArena",
    "HostTier",
    "LayerPriorityPolicy",
    "LayerProgress",
    "LruPolicy",
    "MemoryTier",
    "PrefetchHandle",
    "SsdTier",
    "Tier",
    "TierStats",
    "TieredStore",
    "TieringConfig",
    "build_tiered_store",
    "chunk_keys",
    "get_eviction_policy",
    "prefix_hashes",
]
