"""What the connector's scheduler side keeps per request and per step (`TierPlanner`): plain
dataclasses of ids, keys and counts."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.prefetch import PrefetchHandle


@dataclasses.dataclass
class TokenView:
    """What the planner reads from a vLLM request (kept apart so tests need no vLLM)."""

    request_id: str
    token_ids: Sequence[int]  # prompt and output tokens so far
    session: str | None = None
    salt: bytes = b""
    background: bool = False  # a BE request: its KV reaches the SSD tier only if checkpointed


@dataclasses.dataclass
class StoredMatch:
    """The stored prefix of a token sequence: one layer-0 key per chunk (the last may be a
    partial chunk's key) and how many tokens they cover."""

    chunks: list[ChunkKey]
    num_tokens: int
    layers: list[list[ChunkKey]]  # per chunk, its key at every layer (built once per match)

    def layer_keys(self, first_chunk: int = 0) -> list[ChunkKey]:
        """Every chunk-layer from chunk `first_chunk` on, in chunk order, layer 0 first."""
        return [key for keys in self.layers[first_chunk:] for key in keys]


def known_tokens(st: RequestState, num_computed: int) -> int:
    """The computed tokens whose ids the scheduler knows. With async scheduling vLLM counts
    a step's positions computed before the tokens sampled in the step ahead of it are added
    to the request (`num_output_placeholders`): their KV is stored once their ids are known
    (keys are hashes of token ids), or recomputed after a checkpoint."""
    return min(num_computed, len(st.view.token_ids))


@dataclasses.dataclass
class RequestState:
    view: TokenView
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # full chunks hashed so far
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or being saved
    refused_chunk: int | None = None  # the chunk whose save the host tier last refused
    local_tokens: int = 0  # device prefix-cache hit at admission
    match: StoredMatch | None = None
    pins: list[ChunkKey] = dataclasses.field(default_factory=list)  # host pins for the load
    prefetch: PrefetchHandle | None = None
    fetch_attempts: int = 0  # fetches from SSD this turn waited for
    ssd_chunks: set[int] = dataclasses.field(default_factory=set)  # chunks that came from SSD
    # of those, by chunk index, the layers the fetches brought up
    fetched_layers: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    stored_tokens: tuple[int, int] | None = None  # `stored_prefix_tokens`: (of tokens, found)
    # (tokens, device hit) of the last admission that pinned `match` (stands while it is set)
    admitted: tuple[int, int] | None = None
    # (host, SSD) prompt tokens its first admission loaded from the tiers (`served_from`)
    first_loads: tuple[int, int] | None = None
    start_tokens: int = 0  # tokens its first admission found stored (device and tiers)
    # its session's advisory was settled by its first admission (a preempted request's
    # later ones leave the next turn's advisory alone)
    advisory_settled: bool = False


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A preempted request in the preemption table: what the tiers hold of its KV."""

    num_tokens: int  # computed tokens when it was preempted
    held_tokens: int  # of those, from the start, held by the tiers (the rest is recomputed)
    chunks: tuple[ChunkKey, ...]  # layer-0 keys of the chunks its restore loads
    # the chunk-layers its checkpoint copies to the host (reserved there until copied)
    copying: tuple[ChunkKey, ...] = ()


class SlotCommit(NamedTuple):
    """A reserved host slot to publish once its copy is done."""

    key: ChunkKey
    durable: bool  # written through to the slowest tier once published
    owner: bytes  # whose request saved it (`keys.owner_tag`), kept with it there
    # the bytes of the slot its copy fills (a partial chunk's pages); None: the whole slot.
    # The rest holds what the slot's last occupant left, another session's KV.
    num_bytes: int | None = None
    # written through on the store's thread, not the scheduler's (a checkpoint's: with
    # `background_saves` "checkpoint", hundreds of chunk-layers of one BE request)
    in_background: bool = False


@dataclasses.dataclass
class StepInFlight:
    """A step the worker has not finished: pins to drop, reserved slots to publish."""

    pins: list[ChunkKey] = dataclasses.field(default_factory=list)
    commits: list[SlotCommit] = dataclasses.field(default_factory=list)
    num_saved_chunks: int = 0  # chunk saves among the commits, counted once they land


@dataclasses.dataclass
class TieringCounters:
    prompt_tokens: int = 0  # prompt tokens of admitted turns
    tokens_from_device: int = 0  # of those, found in vLLM's prefix cache
    tokens_from_host: int = 0  # loaded from the host arena
    tokens_from_ssd: int = 0  # loaded from the host arena after a prefetch from SSD
    computed_prompt_tokens: int = 0  # computed by the model
    saved_chunks: int = 0  # chunks (all layers) saved from the device
    saves_refused: int = 0  # chunks not saved: no host slot, every one pinned (recomputed later)
    advisories_received: int = 0
    # advisories again for a session whose live one holds the same KV: that one kept longer
    advisories_renewed: int = 0
    chunk_layers_forgotten: int = 0  # erased from the tiers when their session was deleted
    tail_layers_retired: int = 0  # copies of partial chunk-layers a later save covered, erased
    advisories_used: int = 0  # a turn of the session arrived while the advisory was live
    advisories_expired: int = 0
    # let go unused before their expiry: replaced by a newer one of their session (one it did
    # not renew), or their session deleted (received = used + expired + dropped + live; a
    # renewal is counted renewed, not received)
    advisories_dropped: int = 0
    prefetches_timed: int = 0  # used advisories whose prefetch finished before the turn came
    prefetch_load_s_sum: float = 0.0  # over those: advisory received -> all in host
    prefetch_lead_s_sum: float = 0.0  # over those: prefetch done -> the turn arrived
    advisories_late: int = 0  # the turn arrived before its prefetch finished
    # used advisories whose prefetch ended without some of its KV (gone from the SSD tier,
    # or no host room): not timed
    prefetches_failed: int = 0
    # prefetched KV given up for a running turn's room, or a sooner advisory's
    advisories_reclaimed: int = 0
    turns_held: int = 0  # turns held to a later step for their SSD fetch
    turns_fetched_in_step: int = 0  # turns whose SSD fetch came up within ssd_fetch_wait_s
    fetch_retries: int = 0  # turns' SSD fetches sent again: others took their host room
    ssd_fetches_cut: int = 0  # fetches (turns', advisories') cut to the chunks with host room
    checkpoints: int = 0  # preempted requests whose KV went to the tiers (lazy checkpoints)
    pages_checkpointed: int = 0  # device pages copied at preemption (not yet written through)
    pages_handed_over: int = 0  # preempted pages a tier already held: given up at no cost
    # preempted tokens recomputed: the full host arena could not take them, a full tier
    # evicted them, or their restore loaded less
    checkpoint_short_tokens: int = 0
    restores: int = 0  # checkpointed requests admitted again
    pages_restored: int = 0  # pages those loaded back from the tiers
    copy_steps_failed: int = 0  # steps whose page copies the worker failed (saves dropped)

    def reset(self) -> None:
        """Every counter back to zero."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)
