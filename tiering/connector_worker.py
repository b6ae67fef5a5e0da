"""The connector's worker side: copies KV pages between vLLM's tensors and host-arena slots.

It runs in vLLM's worker process, beside the model. Loads happen layer by layer under the
forward pass (`load_layer` from `wait_for_layer_load`, just before that layer's attention reads
its KV); saves happen layer by layer right after a layer's attention wrote its KV
(`save_layer` from `save_kv_layer`). Slots are plain shared memory: the arena is attached by
name on first use (the scheduler side creates it after the worker has started).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

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
        for request_id, copies in meta.final_saves.items():
            for layer in range(len(self._layer_names)):
                self._save(meta, copies, layer)
            self._finished_sending.add(request_id)
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
        try:
            for copy in copies:
                for block, source in self._page_views(meta, copy, layer):
                    self._pages[layer][block].copy_(source)
        except Exception:
            self._failed_steps.add(meta.step)
            raise

    def _save(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> None:
        try:
            for copy in copies:
                for block, target in self._page_views(meta, copy, layer):
                    target.copy_(self._pages[layer][block])
        except Exception:
            self._failed_steps.add(meta.step)
            raise

    def _page_views(self, meta: TieringMetadata, copy: PageCopy,
                    layer: int) -> list[tuple[int, torch.Tensor]]:
        """(device block, arena page) for each page of `copy` at `layer`; none when the layer
        has no slot (`NO_SLOT`: a tier holds it already). One tensor copy per page: with
        128-token CPU pages, one indexed gather and scatter per layer was no faster
        (docs/benchmarks.md, eleventh session)."""
        slot = copy.slots[layer]
        if slot == NO_SLOT:
            return []
        pages = self._arena_pages(meta.arena_name)
        per_slot = self._pages_per_slot
        if copy.first_page < 0 or copy.first_page + len(copy.blocks) > per_slot:
            raise ValueError(f"a page copy reaches page {copy.first_page + len(copy.blocks) - 1}"
                             f" of a slot that holds {per_slot}")
        assert self._arena is not None  # attached by _arena_pages
        if not 0 <= slot < self._arena.num_slots:
            raise ValueError(f"a page copy names slot {slot}")
        first = slot * per_slot + copy.first_page
        return [(block, pages[first + i]) for i, block in enumerate(copy.blocks)]

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
