"""Configuration of the KV tier store."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from antiphon.configfields import check_int_fields, doc

MiB = 1 << 20
GiB = 1 << 30
SSD_WRITE_THROUGH = ("sessions", "rt", "all")  # `ssd_write_through`: narrowest first
BACKGROUND_SAVES = ("through", "checkpoint")  # `background_saves`
KV_COPY_MODES = ("auto", "pagewise", "batched")  # `kv_copy_mode`


@dataclasses.dataclass(frozen=True)
class TieringConfig:
    kv_tiering: bool = doc(
        "Keep every session's KV across turns in the host and SSD tiers (Antiphon's vLLM KV "
        "connector); off: vLLM's prefix cache alone", default=True)
    advisory_ttl_s: float = doc(
        "How long past its expected arrival an advisory keeps its prefetched KV reserved",
        default=30.0)
    host_tier_bytes: int = doc(
        "Host RAM for session KV (a shared-memory arena in /dev/shm), in bytes; the KV "
        "connector moves every load and save through it, so 0 needs --no-kv-tiering",
        default=2 * GiB)
    ssd_tier_bytes: int = doc(
        "Disk space for session KV files, in bytes; 0 turns the SSD tier off (the host tier "
        "alone, as bidirectional blocks' checkpoints need)", default=32 * GiB)
    ssd_min_free_bytes: int = doc(
        "Disk space the SSD tier leaves free while it runs, in bytes: where the disk has less "
        "room than the budget, the tier evicts rather than grow past this reserve, so the "
        "sessions database and batch files can still be written", default=GiB)
    ssd_dir: Path | None = doc(
        "Directory of the SSD tier (one file of chunk-layer slots; a restart keeps it); "
        "unset: <data-dir>/kv", default=None)
    chunk_tokens: int = doc(
        "Tokens per stored KV chunk; a multiple of page_tokens", default=128)
    tail_index_entries: int = doc(
        "Partial chunks whose tokens the engine keeps in memory (about 1 KiB each with "
        "128-token chunks), so a turn that shares only part of one (a reply a stop string "
        "ended or a user cancelled ran on in the engine) loads that part, and deleting a "
        "session erases it; a full chunk that covers a turn's partial one takes its place, "
        "which then leaves the KV tiers; 0 turns this off (tails are then matched by their "
        "exact tokens, and kept until evicted)",
        default=16384)
    # Tokens per KV page of the engine: the connector sets it to vLLM's block size (128 on the
    # CPU backend), so it is no command-line option.
    page_tokens: int = 128
    eviction_policy: str = doc(
        "Eviction order of the host tier when an SSD tier is below it: lru, layer_priority "
        "(Symphony) or session_lru. The lowest tier holds the only copy and always uses "
        "session_lru (whole chunks, least likely then least recent session first)",
        default="layer_priority")
    writer_queue_depth: int = doc(
        "Most SSD writes queued before producers wait; each holds one chunk-layer in RAM (96 "
        "KiB for the default model). The engine's scheduler thread is such a producer: at 64, "
        "a 600-token prompt's 120 chunk-layers made it wait for the writer", default=256)
    host_shm_name: str | None = doc(
        "Name of the host tier's shared-memory segment; unset: antiphon-kv-<pid>-<random>",
        default=None)
    ssd_writer_nice: int = doc(
        "CPU priority of the SSD tier's writer thread (Linux nice, 0 to 19): at 19 the "
        "write-through runs on cores the model leaves idle instead of taking them from it; on 2 "
        "cores at 0, the decode step after a 600-token prefill took 42 ms instead of 22 (25-30 "
        "at 19). A queue that stays full still holds producers back (`writer_queue_depth`)",
        default=19)
    ssd_write_through: str = doc(
        "Whose KV is written through to the SSD tier as it is saved: sessions (chat turns "
        "in a session: websocket chats, REST turns with vllm_xargs.session_id), rt (every "
        "chat turn) or all (BE work too). The rest stays in the host tier, where prefix "
        "reuse and lazy checkpoints find it; a checkpoint writes its chunks down. On 2 cores "
        "in bench mixed, writing every request through took 16% off the BE tokens/s",
        default="sessions")
    background_saves: str = doc(
        "When BE work's KV is copied to the host tier: through (as its chunks fill, so a "
        "lazy checkpoint copies only the newest pages, and another request over the same "
        "document finds its prefix in host RAM) or checkpoint (only when the request is "
        "preempted: every page no tier holds, copied before the step that may overwrite "
        "it; a checkpoint costs more, but most BE requests are never preempted)",
        default="through")
    ssd_fetch_wait_s: float = doc(
        "How long the engine waits, in the step that admits a chat turn, for the SSD fetch "
        "of the turn's context (seconds); a fetch not done by then holds the turn to a later "
        "step, as 0 always does (and as BE work always is). Holding costs the rest of a step: "
        "on 2 cores at 16-32 chat users, turns without an advisory came 35-48 ms later than "
        "advised ones", default=0.02)
    ssd_fsync: bool = doc(
        "fsync every SSD chunk file (survives power loss; slower)", default=False)
    promote_on_hit: bool = doc(
        "Copy a chunk read from a slower tier into a faster one", default=True)
    kv_copy_mode: str = doc(
        "How vLLM's worker copies KV pages to and from the host tier: auto (page by page "
        "for KV in CPU memory; for KV on a GPU, batched through a device staging buffer on a "
        "side CUDA stream from a page-locked arena, a step's loads queued lower layers first "
        "under the forward pass), pagewise or batched", default="auto")
    kv_copy_staging_pages: int = doc(
        "Device staging buffer of batched KV copies, in pages of one layer (device memory: "
        "this times one layer's page bytes); larger copies go through it in turns",
        default=256)

    def __post_init__(self) -> None:
        check_int_fields(self)
        if self.ssd_dir is not None:
            object.__setattr__(self, "ssd_dir", Path(self.ssd_dir).expanduser())
        if self.host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes must be >= 0, got {self.host_tier_bytes}")
        if self.ssd_tier_bytes < 0:
            raise ValueError(f"ssd_tier_bytes must be >= 0, got {self.ssd_tier_bytes}")
        if self.ssd_min_free_bytes < 0:
            raise ValueError(f"ssd_min_free_bytes must be >= 0, got {self.ssd_min_free_bytes}")
        if self.kv_tiering and not (self.host_tier_bytes or self.ssd_tier_bytes):
            raise ValueError("host_tier_bytes and ssd_tier_bytes are both 0: KV tiering needs "
                             "one tier (or turn kv_tiering off)")
        if not 0 <= self.ssd_writer_nice <= 19:
            raise ValueError(f"ssd_writer_nice must be within 0..19, got {self.ssd_writer_nice}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be at least 1, got {self.page_tokens}")
        if self.chunk_tokens < 1 or self.chunk_tokens % self.page_tokens:
            raise ValueError(f"chunk_tokens must be a positive multiple of page_tokens "
                             f"({self.page_tokens}), got {self.chunk_tokens}")
        if not 0 <= self.ssd_fetch_wait_s <= 10:  # also refuses NaN
            raise ValueError(f"ssd_fetch_wait_s must be within 0..10, got "
                             f"{self.ssd_fetch_wait_s}")
        if not 0 < self.advisory_ttl_s < math.inf:  # (NaN fails too)
            raise ValueError(f"advisory_ttl_s must be positive and finite, got "
                             f"{self.advisory_ttl_s}")
        if self.tail_index_entries < 0:
            raise ValueError(f"tail_index_entries must be >= 0, got {self.tail_index_entries}")
        if self.writer_queue_depth < 1:
            raise ValueError(
                f"writer_queue_depth must be at least 1, got {self.writer_queue_depth}")
        if self.host_shm_name is not None and (
                not self.host_shm_name or "/" in self.host_shm_name):
            raise ValueError(f"host_shm_name must be a non-empty name without '/', "
                             f"got {self.host_shm_name!r}")
        if self.kv_copy_mode not in KV_COPY_MODES:
            raise ValueError(f"kv_copy_mode must be one of {', '.join(KV_COPY_MODES)}, "
                             f"got {self.kv_copy_mode!r}")
        if self.kv_copy_staging_pages < 1:
            raise ValueError(f"kv_copy_staging_pages must be at least 1, got "
                             f"{self.kv_copy_staging_pages}")
        if self.ssd_write_through not in SSD_WRITE_THROUGH:
            raise ValueError(f"ssd_write_through must be one of {', '.join(SSD_WRITE_THROUGH)}, "
                             f"got {self.ssd_write_through!r}")
        if self.background_saves not in BACKGROUND_SAVES:
            raise ValueError(f"background_saves must be one of {', '.join(BACKGROUND_SAVES)}, "
                             f"got {self.background_saves!r}")
        from antiphon.tiering.eviction import eviction_policy_class

        eviction_policy_class(self.eviction_policy)  # fails with the list of valid names

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_tokens

    @property
    def is_host_tier_enabled(self) -> bool:
        return self.host_tier_bytes > 0

    @property
    def is_ssd_tier_enabled(self) -> bool:
        return self.ssd_dir is not None and self.ssd_tier_bytes > 0
