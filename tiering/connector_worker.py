"""The connector's worker side: copies KV pages between vLLM's tensors and host-arena slots.

It runs in vLLM's worker process, beside the model. Per step, in the order vLLM calls it:

- `checkpoint` (from `handle_preemptions`, before the forward pass): lazy checkpoints of the
  requests preempted this step, whose pages this very forward pass may overwrite;
- `load_early` (from `start_load_kv`): partly matched last pages, copied whole before any layer
  writes the step's new tokens into them;
- `load_layer` (from `wait_for_layer_load`, just before a layer's attention reads its KV) and
  `save_layer` (from `save_kv_layer`, right after a layer's attention wrote it);
- `finish_step` (from `wait_for_save`): finished requests' last pages; the step is reported
  done (`take_worker_meta`) once all its copies have landed.

Slots are plain shared memory: the arena is attached by name on first use (the scheduler side
creates it after the worker has started). How the bytes move depends on where vLLM's KV lives:

- **CPU tensors** (`PagewiseMover`): one `memcpy` per page on the calling thread, synchronous.
  PyTorch's CPU gather of byte rows runs far below `memcpy` speed, so batching loses here
  (docs/benchmarks.md), and its `copy_` waits on the forward pass's threads.
- **CUDA tensors** (`BatchedMover`): the arena is page-locked (`cudaHostRegister`) so copies are
  DMA; each layer's pages go through a device staging buffer, one host transfer per run of
  consecutive slot pages and one `index_copy_` / `index_select` per layer, on a side stream.
  A step's loads are queued lower layers first, a couple of layers ahead of the one being
  computed, and a layer's attention waits only for that layer's event, so loading overlaps
  the layers computed before it; saves
  wait for the layer's attention on the GPU, not on the host. A page-by-page copy from pageable
  memory (the CPU way) is one synchronous transfer per page and layer on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy
import torch

from antiphon.tiering import cudart
from antiphon.tiering.config import KV_COPY_MODES
from antiphon.tiering.connector_meta import (
    NO_SLOT,
    PageCopy,
    TieringMetadata,
    TieringWorkerMetadata,
)
from antiphon.tiering.host_arena import HostArena

log = logging.getLogger(__name__)

DEFAULT_STAGING_PAGES = 256  # device staging rows of the batched mover (pages of one layer)
# Asynchronous loads are queued this many layers ahead of the layer being computed: the copy
# stream always has work, and the host thread queues a layer's copies between launching the
# layers' kernels rather than all of them before the first (which delayed the forward pass by
# the whole queueing time).
LOAD_AHEAD_LAYERS = 2

# One layer's copies: (first arena row, device blocks that take the consecutive rows from it).
Runs = list[tuple[int, Sequence[int]]]


def page_rows(name: str, cache: torch.Tensor) -> torch.Tensor:
    """A layer's KV tensor as `[num_blocks, page_bytes]` bytes: row b is block b's page.

    The first dimension must be the block. vLLM lays the rest out by its KV cache layout: a
    block's bytes are one contiguous run in every layout whose block dimension sits outside the
    heads, tokens and channels (a strided view when layers are interleaved per block), which is
    all this needs; the bytes are copied as they lie, so the same layout reads them back.
    """
    if cache.dim() < 2 or cache.shape[0] < 1:
        raise ValueError(f"KV tensor of {name} has shape {tuple(cache.shape)}; tiering needs "
                         f"the block as its first dimension")
    if not _dense(cache[0]):
        raise ValueError(f"a KV page of {name} is not one contiguous run of bytes (shape "
                         f"{tuple(cache.shape)}, strides {cache.stride()}); tiering copies whole "
                         f"pages: use a layer- or block-outermost VLLM_KV_CACHE_LAYOUT")
    elem = cache.element_size()
    page_bytes = cache[0].numel() * elem
    if cache.shape[0] > 1 and cache.stride(0) * elem < page_bytes:
        raise ValueError(f"KV pages of {name} overlap (block stride {cache.stride(0)})")
    rows = torch.empty(0, dtype=torch.uint8, device=cache.device)
    rows.set_(cache.untyped_storage(), cache.storage_offset() * elem,
              (cache.shape[0], page_bytes), (cache.stride(0) * elem, 1))
    return rows


def _dense(t: torch.Tensor) -> bool:
    """True if `t`'s elements fill one contiguous run of memory, in any dimension order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class PagewiseMover:
    """One synchronous copy per page: the fastest way between two CPU memories.

    Between CPU tensors each copy is one `memcpy` on the calling thread (numpy's), not
    `Tensor.copy_`: PyTorch splits a page of 64 KiB or more over its OpenMP threads, the
    forward pass's, and each copy then waits for all of them. On 2 cores beside one busy
    process, 60 copies of 96 KiB took up to 137 ms through `copy_` and at most 0.22 ms
    through numpy (0.38 and 0.17 ms at the median, idle). (KV on a GPU, with
    `copy_mode="pagewise"`, goes through `copy_`.)"""

    name = "pagewise"

    def attach(self, slots: torch.Tensor) -> None:
        pass

    def detach(self) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def load(self, pages: torch.Tensor, slots: torch.Tensor, runs: Runs) -> None:
        _copy_runs(pages, slots, runs, to_pages=True)

    def save(self, pages: torch.Tensor, slots: torch.Tensor, runs: Runs) -> None:
        _copy_runs(pages, slots, runs, to_pages=False)

    def layer_loaded(self, layer: int) -> None:
        pass

    def before_forward(self) -> None:
        pass

    def end_step(self) -> Any:
        return None

    def done(self, handle: Any) -> bool:
        return True

    def wait(self, handle: Any) -> None:
        pass


class BatchedMover:
    """Per layer: one host transfer per run of consecutive slot pages into a staging buffer on
    the KV's device, then one indexed copy into (or out of) the KV pages.

    On CUDA every copy is queued on a side stream from a page-locked arena, through the CUDA
    runtime's `cudaMemcpyAsync` where it is found (`antiphon.tiering.cudart`: a few
    microseconds of host time per transfer, against about 15 through PyTorch); `layer_loaded`
    records an event after a layer's loads, which the compute stream alone waits for
    (`wait_layer`), a save waits for the compute stream's work so far (the layer's attention),
    and `end_step` returns an event polled before the step is reported done. On a CPU device
    the same calls run synchronously (the tests check the bytes this way; serving on CPU uses
    `PagewiseMover`).
    """

    name = "batched"

    def __init__(self, device: torch.device, page_bytes: int,
                 staging_pages: int = DEFAULT_STAGING_PAGES, *,
                 raw_copies: bool = True) -> None:
        if staging_pages < 1:
            raise ValueError(f"staging_pages must be at least 1, got {staging_pages}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.page_bytes = page_bytes
        self._staging = torch.empty((staging_pages, page_bytes), dtype=torch.uint8,
                                    device=device)
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self._runtime = cudart.runtime() if self.cuda else None
        if self.cuda and self._runtime is None:
            log.warning("CUDA runtime library not found in this process: KV copies go "
                        "through PyTorch from pageable memory (synchronous)")
        self._raw = raw_copies and self._runtime is not None
        self._layer_events: dict[int, Any] = {}
        self._registered: int | None = None  # data pointer of the page-locked arena

    def attach(self, slots: torch.Tensor) -> None:
        """Page-lock the arena, so host transfers are asynchronous DMA."""
        if self._runtime is None or slots.numel() == 0:
            return
        ptr, size = slots.data_ptr(), slots.numel()
        err = self._runtime.host_register(ptr, size)
        if err == cudart.HOST_MEMORY_ALREADY_REGISTERED:
            # an arena this process mapped at the same address before, not unregistered:
            # that registration pins the old mapping's pages, so it must go
            self._runtime.host_unregister(ptr)
            err = self._runtime.host_register(ptr, size)
        if err:
            log.warning("could not page-lock the host KV arena (%d bytes, CUDA error %d): "
                        "KV copies go through PyTorch, synchronously", size, err)
            self._raw = False
            return
        self._registered = ptr

    def detach(self) -> None:
        if self._registered is not None and self._runtime is not None:
            torch.cuda.synchronize(self.device)
            self._runtime.host_unregister(self._registered)
            self._registered = None

    def begin_step(self) -> None:
        """Order this step's copies against the GPU work queued before them: the compute
        stream waits for the last step's saves (their pages may be reallocated and written
        now), and the copy stream waits for the last step's forward pass (a page freed by a
        request it finished may be loaded into now)."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._stream)
            self._stream.wait_stream(compute)
            self._layer_events.clear()

    def _context(self) -> Any:
        return torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(blocks, dtype=torch.long, pin_memory=self.cuda)
        return index.to(self.device, non_blocking=True)

    def _batches(self, runs: Runs) -> list[tuple[list[tuple[int, int, int]], list[int]]]:
        """Split runs into batches that fit the staging buffer: per batch, (arena row, staging
        row, pages) pieces and the device blocks of its staging rows in order."""
        cap = self._staging.shape[0]
        batches: list[tuple[list[tuple[int, int, int]], list[int]]] = []
        pieces: list[tuple[int, int, int]] = []
        blocks: list[int] = []
        for row, run in runs:
            done = 0
            while done < len(run):
                if len(blocks) == cap:
                    batches.append((pieces, blocks))
                    pieces, blocks = [], []
                take = min(len(run) - done, cap - len(blocks))
                pieces.append((row + done, len(blocks), take))
                blocks.extend(run[done:done + take])
                done += take
        if blocks:
            batches.append((pieces, blocks))
        return batches

    def _transfer(self, slots: torch.Tensor, pieces: list[tuple[int, int, int]],
                  to_device: bool) -> None:
        """Move each piece between arena rows and staging rows (on the copy stream)."""
        if self._raw:
            assert self._runtime is not None
            stream = self._stream.cuda_stream
            size = self.page_bytes
            staging, arena = self._staging.data_ptr(), slots.data_ptr()
            for row, at, count in pieces:
                host, dev = arena + row * size, staging + at * size
                if to_device:
                    self._runtime.memcpy_async(dev, host, count * size, cudart.HOST_TO_DEVICE,
                                               stream)
                else:
                    self._runtime.memcpy_async(host, dev, count * size, cudart.DEVICE_TO_HOST,
                                               stream)
            return
        for row, at, count in pieces:
            if to_device:
                self._staging[at:at + count].copy_(slots[row:row + count], non_blocking=True)
            else:
                slots[row:row + count].copy_(self._staging[at:at + count], non_blocking=True)

    def load(self, pages: torch.Tensor, slots: torch.Tensor, runs: Runs) -> None:
        with self._context():
            for pieces, blocks in self._batches(runs):
                self._transfer(slots, pieces, to_device=True)
                pages.index_copy_(0, self._index(blocks), self._staging[:len(blocks)])

    def save(self, pages: torch.Tensor, slots: torch.Tensor, runs: Runs) -> None:
        if self.cuda:  # after the attention that wrote these pages
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._context():
            for pieces, blocks in self._batches(runs):
                torch.index_select(pages, 0, self._index(blocks),
                                   out=self._staging[:len(blocks)])
                self._transfer(slots, pieces, to_device=False)

    def layer_loaded(self, layer: int) -> None:
        """Record that `layer`'s loads are queued (call after queueing them)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._layer_events[layer] = event

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for `layer`'s loads (nothing to wait for on a CPU)."""
        event = self._layer_events.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def before_forward(self) -> None:
        """The compute stream waits for every copy queued so far (checkpoints, early loads)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def end_step(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def done(self, handle: Any) -> bool:
        return handle is None or bool(handle.query())

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()


Mover = PagewiseMover | BatchedMover


def _copy_runs(pages: torch.Tensor, slots: torch.Tensor, runs: Runs, *, to_pages: bool) -> None:
    """Copy each run's slot rows into its device pages (`to_pages`) or back, a page at a
    time: between CPU tensors on this thread alone (`PagewiseMover`), otherwise through
    `Tensor.copy_`."""
    on_cpu = pages.device.type == "cpu" and slots.device.type == "cpu"
    page_rows, slot_rows = (pages.numpy(), slots.numpy()) if on_cpu else (pages, slots)
    copy: Any = numpy.copyto if on_cpu else torch.Tensor.copy_  # (dst, src)
    for row, blocks in runs:
        for i, block in enumerate(blocks):
            if to_pages:
                copy(page_rows[block], slot_rows[row + i])
            else:
                copy(slot_rows[row + i], page_rows[block])


class KvPageCopier:
    """Page copies for one worker; `layer_names` fixes the layer order the keys use.

    `copy_mode`: `auto` (page by page for CPU KV, batched on a side stream for CUDA KV),
    `pagewise` or `batched`; `staging_pages` bounds the batched mover's device buffer.
    `raw_copies=False` makes the batched mover's host transfers through PyTorch.
    """

    def __init__(self, layer_names: Sequence[str], *, copy_mode: str = "auto",
                 staging_pages: int = DEFAULT_STAGING_PAGES, raw_copies: bool = True) -> None:
        if copy_mode not in KV_COPY_MODES:
            raise ValueError(f"copy_mode must be one of {KV_COPY_MODES}, got {copy_mode!r}")
        self._layer_index = {name: index for index, name in enumerate(layer_names)}
        self._layer_names = list(layer_names)
        self._copy_mode = copy_mode
        self._staging_pages = staging_pages
        self._raw_copies = raw_copies  # False: PyTorch's copies (the benchmark compares)
        self._pages: list[torch.Tensor] = []  # per layer: [num_blocks, page_bytes] uint8 rows
        self._mover: Mover = PagewiseMover()
        self._arena: HostArena | None = None
        # The arena as [num_slots * pages_per_slot, page_bytes] uint8 (see `_arena_pages`).
        self._slots: torch.Tensor | None = None
        self._pages_per_slot = 0
        self._forward_step: int | None = None  # the step whose forward pass has begun
        self._begun_step: int | None = None
        self._checkpointed_step: int | None = None
        self._queued = (-1, 0)  # (step, layers whose loads are queued)
        self._pending: list[tuple[int, Any, set[str]]] = []  # (step, end event, requests sent)
        self._done_steps: set[int] = set()
        self._failed_steps: set[int] = set()
        self._finished_sending: set[str] = set()
        # Device pages a failed load left holding what they held before: vLLM fails the
        # requests reading them (`get_block_ids_with_load_errors`).
        self._invalid_blocks: set[int] = set()
        # Fault drills (`antiphon_fail_kv_loads`): the loads of this many steps to come fail.
        self._load_steps_to_fail = 0
        self._failing_step: int | None = None

    @property
    def page_bytes(self) -> int:
        return int(self._pages[0].shape[1])

    @property
    def mover(self) -> str:
        return self._mover.name

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors: the first dimension must be the page (block)."""
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV tensors missing for layers {missing[:3]}")
        self._pages = [page_rows(name, kv_caches[name]) for name in self._layer_names]
        device = self._pages[0].device
        batched = (self._copy_mode == "batched"
                   or (self._copy_mode == "auto" and device.type == "cuda"))
        self._mover = (BatchedMover(device, self.page_bytes, self._staging_pages,
                                    raw_copies=self._raw_copies) if batched
                       else PagewiseMover())
        log.info("KV page copies %s on %s", self._mover.name, device)

    def checkpoint(self, meta: TieringMetadata) -> None:
        """Before the forward pass: copy out the pages of requests preempted this step (this
        step's forward may write another request's KV over them). vLLM calls this before
        every forward pass, so every step's copies are ordered here against the last step's,
        a step that copies nothing too (its forward may reuse pages a save still reads)."""
        self._begin(meta)
        if not meta.checkpoints or self._checkpointed_step == meta.step:
            return
        self._checkpointed_step = meta.step
        if self._forward_step == meta.step:
            # Too late: the pages may hold the new owner's KV already. Failing the step
            # drops the checkpoint's keys, so the request recomputes instead of restoring them.
            self._failed_steps.add(meta.step)
            log.error("step %d: checkpoint copies arrived after the forward pass began; "
                      "dropped (the preempted requests recompute)", meta.step)
            return
        for layer in range(len(self._layer_names)):
            self._save(meta, meta.checkpoints, layer)
        self._mover.before_forward()

    def load_early(self, meta: TieringMetadata) -> None:
        """Before the forward pass: copy partly matched pages in, every layer (they may land
        on pages a checkpoint just copied out); queue the layer-by-layer loads where the
        copies are asynchronous."""
        self.checkpoint(meta)  # where vLLM did not call `handle_preemptions`
        if meta.early_loads:
            for layer in range(len(self._layer_names)):
                self._load(meta, meta.early_loads, layer)
            self._mover.before_forward()
        if self._async and self._forward_step != meta.step:
            self._queue_loads(meta, LOAD_AHEAD_LAYERS)

    def load_layer(self, meta: TieringMetadata, layer_name: str) -> None:
        """Just before `layer_name`'s attention: its loads are in place when this returns
        (synchronous copies), or the compute stream waits for them (queued ahead)."""
        self._forward_step = meta.step
        layer = self._layer_index[layer_name]
        if not self._async:
            self._load(meta, meta.loads, layer)
            return
        self._queue_loads(meta, layer + 1 + LOAD_AHEAD_LAYERS)
        assert isinstance(self._mover, BatchedMover)
        self._mover.wait_layer(layer)

    def save_layer(self, meta: TieringMetadata, layer_name: str) -> None:
        """Copy this step's saves of `layer_name` from device pages into slots."""
        self._forward_step = meta.step
        if not meta.saves:
            return
        self._begin(meta)
        self._save(meta, meta.saves, self._layer_index[layer_name])

    def finish_step(self, meta: TieringMetadata) -> None:
        """End of the step: copy finished requests' last pages (vLLM holds their blocks until
        we report them sent); the step is done once its copies have landed."""
        self._begin(meta)
        for copies in meta.final_saves.values():
            for layer in range(len(self._layer_names)):
                self._save(meta, copies, layer)
        if not meta.has_work:
            self._finished_sending.update(meta.final_saves)
            return
        handle = self._mover.end_step()
        if meta.step in self._failed_steps:
            # Its saves are dropped, and their slots freed once it is reported: the copies
            # already queued (on a GPU's side stream) must land first, or one could write
            # over a slot the next put took.
            self._mover.wait(handle)
            self._finished_sending.update(meta.final_saves)
            return
        if meta.final_saves:  # vLLM holds their pages until they are reported: don't delay
            self._mover.wait(handle)
        self._pending.append((meta.step, handle, set(meta.final_saves)))
        self._collect()

    def fail_loads(self, steps: int) -> None:
        """A fault drill: the page loads of the next `steps` steps that load any fail, as a
        broken copy would."""
        self._load_steps_to_fail = steps

    def _drill_fails(self, step: int) -> bool:
        if self._failing_step != step and self._load_steps_to_fail > 0:
            self._load_steps_to_fail -= 1
            self._failing_step = step
        return self._failing_step == step

    def take_invalid_blocks(self) -> set[int]:
        """Device pages failed loads left wrong since the last call (vLLM fails the requests
        reading them)."""
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_finished_sending(self) -> set[str]:
        self._collect()
        finished, self._finished_sending = self._finished_sending, set()
        return finished

    def take_worker_meta(self) -> TieringWorkerMetadata | None:
        self._collect()
        if not (self._done_steps or self._failed_steps):
            return None
        meta = TieringWorkerMetadata(self._done_steps, self._failed_steps)
        self._done_steps, self._failed_steps = set(), set()
        return meta

    def close(self) -> None:
        if self._pending:
            self._mover.wait(self._pending[-1][1])
            self._collect()
        self._mover.detach()
        self._slots = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    @property
    def _async(self) -> bool:
        return isinstance(self._mover, BatchedMover) and self._mover.cuda

    def _queue_loads(self, meta: TieringMetadata, layers: int) -> None:
        """Queue the step's loads of its first `layers` layers, those not queued yet, lower
        layers first, each followed by its event (the copy stream runs them in order while
        the forward pass goes on)."""
        if not meta.loads:
            return
        step, queued = self._queued
        if step != meta.step:
            self._begin(meta)
            queued = 0
        assert isinstance(self._mover, BatchedMover)
        for layer in range(queued, min(layers, len(self._layer_names))):
            self._load(meta, meta.loads, layer)
            self._mover.layer_loaded(layer)
            queued = layer + 1
        self._queued = (meta.step, queued)

    def _begin(self, meta: TieringMetadata) -> None:
        if self._begun_step != meta.step:
            self._begun_step = meta.step
            self._mover.begin_step()

    def _collect(self) -> None:
        """Steps whose copies have landed, in order, become done."""
        while self._pending and self._mover.done(self._pending[0][1]):
            step, _, sent = self._pending.pop(0)
            self._done_steps.add(step)
            self._finished_sending |= sent

    def _load(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> None:
        self._copy(meta, copies, layer, to_device=True)

    def _save(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> None:
        self._copy(meta, copies, layer, to_device=False)

    def _copy(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int,
              to_device: bool) -> None:
        """Slots to device pages (`to_device`) or back, at `layer`. A failure fails the step
        (its saves are dropped and done again, its checkpoints recomputed) and a load's pages
        are reported invalid: vLLM fails the requests reading them and drops the pages from
        its prefix cache. Raised, it took the engine and every request in it down."""
        try:
            runs = self._runs(meta, copies, layer)
            if runs and to_device and self._drill_fails(meta.step):
                raise RuntimeError("a KV load failed in a fault drill (antiphon_fail_kv_loads)")
            if runs:
                move = self._mover.load if to_device else self._mover.save
                move(self._pages[layer], self._arena_pages(meta.arena_name), runs)
        except Exception:
            if meta.step not in self._failed_steps:
                log.exception("step %d: KV page copies failed; the step's saves are dropped, "
                              "and the requests reading its loads fail", meta.step)
            self._failed_steps.add(meta.step)
            if to_device:
                self._invalid_blocks.update(block for copy in copies for block in copy.blocks)

    def _runs(self, meta: TieringMetadata, copies: Sequence[PageCopy], layer: int) -> Runs:
        """(first arena row, device blocks) per copy at `layer`; none for a layer without a
        slot (`NO_SLOT`: a tier holds it already). Checked to stay inside the slot."""
        runs: Runs = []
        live = [copy for copy in copies if copy.slots[layer] != NO_SLOT]
        if live:
            self._arena_pages(meta.arena_name)  # attaches the arena (sets the geometry)
        per_slot = self._pages_per_slot
        for copy in live:
            slot = copy.slots[layer]
            if copy.first_page < 0 or copy.first_page + len(copy.blocks) > per_slot:
                raise ValueError(f"a page copy reaches page "
                                 f"{copy.first_page + len(copy.blocks) - 1} of a slot that "
                                 f"holds {per_slot}")
            assert self._arena is not None  # attached by _arena_pages
            if not 0 <= slot < self._arena.num_slots:
                raise ValueError(f"a page copy names slot {slot}")
            runs.append((slot * per_slot + copy.first_page, copy.blocks))
        return runs

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
            self._mover.attach(self._slots)
            log.info("attached host KV arena %s: %d slots of %d bytes (%s copies)", arena_name,
                     arena.num_slots, arena.slot_bytes, self._mover.name)
        return self._slots
