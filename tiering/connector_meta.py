"""What the connector's scheduler side tells its worker side each step, and what comes back.

Everything the worker does is a page copy between vLLM's KV tensors and host-arena slots: the
scheduler side has already decided which key lives in which slot (it owns the host tier's index),
so the metadata carries only numbers.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

NO_SLOT = -1  # in `PageCopy.slots`: this layer needs no copy (a tier already holds it)


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """Copy `len(blocks)` KV pages of every layer between device blocks and one chunk's slots.

    Page `i` is device block `blocks[i]` and bytes `[(first_page + i) * page_bytes, ...)` of
    slot `slots[layer]`: a chunk holds `pages_per_chunk` pages, one slot per layer (`NO_SLOT`
    for a layer that is not copied).
    """

    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    first_page: int = 0


@dataclasses.dataclass
class TieringMetadata(KVConnectorMetadata):
    """One engine step's copies."""

    step: int
    arena_name: str
    loads: list[PageCopy] = dataclasses.field(default_factory=list)  # slot -> device, per layer
    # Partly matched last pages: copied whole before the forward pass, since the step's new
    # tokens are written into the same page before attention (where layer loads happen).
    early_loads: list[PageCopy] = dataclasses.field(default_factory=list)
    saves: list[PageCopy] = dataclasses.field(default_factory=list)  # device -> slot, per layer
    # Lazy checkpoints of requests preempted this step: their pages may be handed to another
    # request and overwritten by this very forward pass, so they are copied before it.
    checkpoints: list[PageCopy] = dataclasses.field(default_factory=list)
    # Partial last chunks of finished requests, whose blocks vLLM holds until they are copied:
    # request id -> copies (done in `wait_for_save`, reported back as finished sending).
    final_saves: dict[str, list[PageCopy]] = dataclasses.field(default_factory=dict)

    @property
    def num_page_copies(self) -> int:
        """Pages copied in this step, counted once per layer copied (loads and saves)."""
        copies = [*self.loads, *self.early_loads, *self.saves, *self.checkpoints,
                  *(c for final in self.final_saves.values() for c in final)]
        return sum(len(c.blocks) * sum(1 for slot in c.slots if slot != NO_SLOT)
                   for c in copies)

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.early_loads or self.saves or self.final_saves
                    or self.checkpoints)

    @property
    def has_layer_work(self) -> bool:
        """The forward pass's per-layer hooks have something to do: layer loads or saves, or
        (for the check that its checkpoints came before the forward) checkpoints. A finished
        request's last pages are copied after the forward (`final_saves`)."""
        return bool(self.loads or self.early_loads or self.saves or self.checkpoints)


@dataclasses.dataclass
class TieringWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps whose copies the worker finished (or failed), so the scheduler side can publish
    the saved slots and drop the pins that kept loaded slots in place."""

    done_steps: set[int] = dataclasses.field(default_factory=set)
    failed_steps: set[int] = dataclasses.field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieringWorkerMetadata)
        return TieringWorkerMetadata(self.done_steps & other.done_steps,
                                     self.failed_steps | other.failed_steps)
