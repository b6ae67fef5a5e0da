"""Build the tiered store a `TieringConfig` describes."""

from __future__ import annotations

import logging
from pathlib import Path

from antiphon.tiering.config import TieringConfig
from antiphon.tiering.eviction import EvictionPolicy, SessionLruPolicy, get_eviction_policy
from antiphon.tiering.host_arena import (
    default_arena_name,
    reclaim_named_arena,
    remove_orphaned_arenas,
)
from antiphon.tiering.host_tier import HostTier
from antiphon.tiering.manager import TieredStore
from antiphon.tiering.slot_file import FILE_NAME as SLOT_FILE_NAME
from antiphon.tiering.slot_file import stride_for
from antiphon.tiering.ssd_tier import SsdTier
from antiphon.tiering.tier import Tier

logger = logging.getLogger(__name__)


def build_tiered_store(config: TieringConfig, *, slot_bytes: int,
                       model_id: str | None = None) -> TieredStore:
    """A store with a host tier (if enabled) over an SSD tier (if enabled).

    `slot_bytes` is one chunk-layer's KV size in bytes: the per-layer page size times
    `config.pages_per_chunk`. The host arena is created here, named `config.host_shm_name`
    (default `antiphon-kv-<pid>-<random>`); this process owns it and unlinks it on `close`.
    The tier above orders evictions per `config.eviction_policy`; the lowest one, which holds
    the only copy of what it stores, by `SessionLruPolicy` (see `eviction`). `model_id` is the KV's
    model: the SSD tier does not load what another model stored (None loads everything).
    """
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    if not (config.is_host_tier_enabled or config.is_ssd_tier_enabled):
        raise ValueError("both tiers are off: set host_tier_bytes > 0, or ssd_dir and "
                         "ssd_tier_bytes > 0")
    if config.is_host_tier_enabled and config.host_tier_bytes < slot_bytes:
        # every copy goes through the host arena: without a slot, every turn recomputes
        raise ValueError(f"the host tier ({config.host_tier_bytes} bytes) holds no chunk-layer "
                         f"of this model ({slot_bytes} bytes): raise --host-tier-bytes")
    if config.is_ssd_tier_enabled and config.ssd_tier_bytes < stride_for(slot_bytes):
        # every write-through refused: no KV would outlive a restart, and no host copy
        # could be dropped as held below
        raise ValueError(f"the SSD tier ({config.ssd_tier_bytes} bytes) holds no chunk-layer "
                         f"of this model ({stride_for(slot_bytes)} bytes with its header): "
                         "raise --ssd-tier-bytes, or set it to 0 to turn the tier off")
    ssd_dir = config.ssd_dir if config.is_ssd_tier_enabled else None

    def policy(is_lowest: bool) -> EvictionPolicy:
        if is_lowest:
            return SessionLruPolicy()
        assert ssd is not None  # a tier above the lowest: the SSD tier is below it
        chosen = get_eviction_policy(config.eviction_policy)
        chosen.is_backed = ssd.contains  # what it holds, a tier above can drop by layer
        return chosen

    ssd: SsdTier | None = None
    if ssd_dir is not None:
        try:
            ssd = SsdTier(ssd_dir, config.ssd_tier_bytes, slot_bytes=slot_bytes,
                          policy=policy(is_lowest=True),
                          max_pending_writes=config.writer_queue_depth,
                          fsync=config.ssd_fsync, writer_nice=config.ssd_writer_nice,
                          min_free_disk_bytes=config.ssd_min_free_bytes, model_id=model_id)
        except OSError as exc:  # unwritable, not a folder: the host tier can still serve
            if not config.is_host_tier_enabled:
                raise
            logger.warning("the SSD tier in %s is unusable (%s): serving with the host tier "
                           "alone, which recomputes what the SSD would have kept", ssd_dir, exc)
    tiers: list[Tier] = []
    if config.is_host_tier_enabled:
        if config.host_shm_name is None:
            orphans = remove_orphaned_arenas()
            if orphans:
                logger.warning("removed %d host-tier arenas left by killed processes: %s",
                               len(orphans), ", ".join(orphans))
        try:
            if config.host_shm_name is not None and reclaim_named_arena(config.host_shm_name):
                logger.warning("removed host-tier arena %s, left by a killed server",
                               config.host_shm_name)
            tiers.append(HostTier.create(config.host_shm_name or default_arena_name(),
                                         config.host_tier_bytes, slot_bytes,
                                         policy=policy(is_lowest=ssd is None),
                                         tracked=config.host_shm_name is None))
        except BaseException:
            if ssd is not None:
                ssd.close()
            raise
    if ssd is not None:
        tiers.append(ssd)
    store = TieredStore(tiers, promote_on_hit=config.promote_on_hit)
    if ssd is None:
        store.unopened_ssd_file = unopened_ssd_file(config)
    return store


def unopened_ssd_file(config: TieringConfig) -> Path | None:
    """The SSD tier's slot file in `config.ssd_dir`, where an earlier start left one (the
    caller has no SSD tier open on it)."""
    if config.ssd_dir is None:
        return None
    path = config.ssd_dir / SLOT_FILE_NAME
    return path if path.is_file() else None
