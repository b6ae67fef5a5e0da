"""The connector's worker side: copies KV pages between vLLM's tensors and host-arena slots.

It runs in vLLM's worker process, beside the model. Loads happen layer by layer under the
forward pass (`load_layer` from `wait_for_layer_load`, just before that layer's attention reads
its KV); saves happen layer by layer right after a layer's attention wrote its KV
(`save_layer` from `save_kv_layer`). Slots are plain shared memory: the arena is attached by
name on first use (the scheduler side creates it after the worker has started).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from antiphon.tiering.connector_meta import (
    NO_SLOT,
    PageCopy,
    TieringMetadata,
    TieringWorkerMetadata,
)
from antiphon.tiering.host_arena import HostArena

log = logging.getLogger(__name__)


class KvPageCopier:
    """Page copies for one worker; `layer_names` fixes the layer order the keys use."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        self._layer_index = {name: index for index, name in enumerate(layer_names)}
        self._layer_names = list(layer_names)
        self._pages: list[torch.Tensor] = []  # per layer: [num_blocks, page_bytes] uint8 view
        self._arena: HostArena | None = None
        # The arena as [num_slots * pages_per_slot, page_bytes] uint8 (see `_arena_pages`).
        self._slots: torch.Tensor | None = None
        self._pages_per_slot = 0
        self._index_meta: TieringMetadata | None = None  # the step `_indexes` belong to
        # By id() of a copy list of that step, with the list (so a reused id cannot match).
        self._indexes: dict[int, tuple[Sequence[PageCopy], _PageIndex]] = {}
        self._done_steps: set[int] = set()
        self._failed_steps: set[int] = set()
        self._finished_sending: set[str] = set()

    @property
    def page_bytes(self) -> int:
        return int(self._pages[0].shape[1])

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors: the first dimension must be the page (block)."""
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV tensors missing for layers {missing[:3]}")
        pages = []
        for name in self._layer_names:
            cache = kv_caches[name]
            if not cache.is_contiguous():
                raise ValueError(f"KV tensor of {name} is not contiguous; tiering needs whole "
                                 f"pages as contiguous bytes")
            pages.append(cache.view(torch.uint8).view(cache.shape[0], -1))
        self._pages = pages

    def load_early(self, meta: TieringMetadata) -> None:
        """Before the forward pass: save preempted requests' checkpoints, then copy partly
        matched pages in (which may land on pages a checkpoint just copied out), every layer."""
        for layer in range(len(self._layer_names)):
            if meta.checkpoints:
                self._save(meta, meta.checkpoints, layer)
            self._load(meta, meta.early_loads, layer)

    def load_layer(self, meta: TieringMetadata, layer_name: str) -> None:
        """Copy this step's loads of `layer_name` from slots into device pages."""
        self._load(meta, meta.loads, self._layer_index[layer_name])

    def save_layer(self, meta: TieringMetadata, layer_name: str) -> None:
        """Copy this step's saves of `layer_name` from device pages into slots."""
        if not meta.saves:
            return
        self._save(meta, meta.saves, self._layer_index[layer_name])

    def finish_step(self, meta: TieringMetadata) -> None:
        """End of the step: copy finished requests' last pages (vLLM holds their blocks until
        we report them sent) and record the step as done."""
        if meta.final_saves:
            copies = [copy for copies in meta.final_saves.values() for copy in copies]
            for layer in range(len(self._layer_names)):
                self._save(meta, copies, layer)
            self._finished_sending.update(meta.final_saves)
        if meta.has_work and meta.step not in self._failed_steps:
            self._done_steps.add(meta.step)

    def take_finished_sending(self) -> set[str]:
        finished, self._finished_sending = self._finished_sending, set()
        return finished

    def take_worker_meta(self) -> TieringWorkerMetadata | None:
        if not (self._done_steps or self._failed_steps):
            return None
        meta = TieringWorkerMetadata(self._done_steps, self._failed_steps)
        self._done_steps, self._failed_steps = set(), set()
        return meta

    def close(self) -> None:
        self._slots = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _load(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> None:
        if not copies:
            return
        try:
            index = self._index(meta, copies)
            self._pages[layer].index_copy_(
                0, index.blocks[layer], self._arena_pages(meta.arena_name).index_select(
                    0, index.arena_pages[layer]))
        except Exception:
            self._failed_steps.add(meta.step)
            raise

    def _save(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> None:
        if not copies:
            return
        try:
            index = self._index(meta, copies)
            self._arena_pages(meta.arena_name).index_copy_(
                0, index.arena_pages[layer],
                self._pages[layer].index_select(0, index.blocks[layer]))
        except Exception:
            self._failed_steps.add(meta.step)
            raise

    def _index(self, meta: TieringMetadata, copies: Sequence[PageCopy]) -> _PageIndex:
        """`copies` as index tensors, built once per step and list (every layer reuses them)."""
        if self._index_meta is not meta:
            self._index_meta, self._indexes = meta, {}
        known = self._indexes.get(id(copies))
        if known is not None and known[0] is copies:
            return known[1]
        self._arena_pages(meta.arena_name)  # attaches, so the slot geometry is known
        index = _PageIndex.of(copies, len(self._layer_names), self._pages_per_slot)
        self._indexes[id(copies)] = (copies, index)
        return index

    def _arena_pages(self, arena_name: str) -> torch.Tensor:
        """The arena as `[num_slots * pages_per_slot, page_bytes]`: slot s, page p is row
        `s * pages_per_slot + p`."""
        if self._slots is None or self._arena is None or self._arena.name != arena_name:
            self.close()
            arena = HostArena.attach(arena_name)
            if arena.slot_bytes % self.page_bytes:
                arena.close()
                raise ValueError(f"host slots of {arena.slot_bytes} bytes do not hold whole "
                                 f"{self.page_bytes}-byte KV pages")
            self._arena = arena
            self._pages_per_slot = arena.slot_bytes // self.page_bytes
            self._slots = torch.frombuffer(arena.slots_view(), dtype=torch.uint8).view(
                arena.num_slots * self._pages_per_slot, self.page_bytes)
            log.info("attached host KV arena %s: %d slots of %d bytes", arena_name,
                     arena.num_slots, arena.slot_bytes)
        return self._slots


@dataclasses.dataclass(frozen=True)
class _PageIndex:
    """A step's list of page copies as index tensors: per layer, one gather and one scatter
    instead of a tensor copy per page. A copy's slot for a layer may be `NO_SLOT` (a tier
    already holds that layer): that layer's pages of the copy are left out."""

    blocks: tuple[torch.Tensor, ...]  # per layer: [pages] device blocks
    arena_pages: tuple[torch.Tensor, ...]  # per layer: [pages] rows of the arena's page view

    @classmethod
    def of(cls, copies: Sequence[PageCopy], num_layers: int, pages_per_slot: int) -> _PageIndex:
        """ValueError when a copy names the wrong number of slots or pages outside its slot."""
        lengths = np.array([len(c.blocks) for c in copies], dtype=np.int64)
        slots = np.array([c.slots for c in copies], dtype=np.int64).reshape(len(copies), -1)
        if slots.shape[1] != num_layers:
            raise ValueError(f"a page copy names {slots.shape[1]} slots for {num_layers} layers")
        pages = np.concatenate([np.arange(c.first_page, c.first_page + len(c.blocks))
                                for c in copies])
        if pages.size and (pages.min() < 0 or pages.max() >= pages_per_slot):
            raise ValueError(f"a page copy reaches page {int(pages.max())} of a slot that "
                             f"holds {pages_per_slot}")
        if (slots < NO_SLOT).any():
            raise ValueError(f"a page copy names slot {int(slots.min())}")
        blocks = np.fromiter((b for c in copies for b in c.blocks), dtype=np.int64,
                             count=int(lengths.sum()))
        page_slots = np.repeat(slots, lengths, axis=0).T  # [layers, pages]
        rows = page_slots * pages_per_slot + pages
        all_blocks = torch.from_numpy(blocks)
        per_layer_blocks, per_layer_rows = [], []
        for layer in range(num_layers):
            wanted = page_slots[layer] != NO_SLOT
            if wanted.all():
                per_layer_blocks.append(all_blocks)
                per_layer_rows.append(torch.from_numpy(np.ascontiguousarray(rows[layer])))
            else:
                per_layer_blocks.append(torch.from_numpy(blocks[wanted]))
                per_layer_rows.append(torch.from_numpy(rows[layer][wanted]))
        return cls(tuple(per_layer_blocks), tuple(per_layer_rows))
