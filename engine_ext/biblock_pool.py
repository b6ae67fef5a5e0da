"""`PositionalPages`: vLLM's page pool allocating by position in bidirectional shared blocks.

vLLM's `BlockPool.get_new_blocks` pops free pages from the head of its free queue. Installed on
a scheduler's KV cache manager, this takes them by position instead, as `SharedBlockLayout`
places them for the request being allocated for (RT from the low end of a shared block, BE from
the high end). The free queue is a doubly linked list, so taking a page from its middle is
O(1); prefix caching keeps working: a free page that still holds a cached prefix is evicted
from the cache when taken, exactly as when vLLM pops it, and pages a request finds in the
prefix cache (`touch`) become its own in the layout when nobody else holds them. Where the
layout has a choice of blocks, it takes pages holding no cached KV first, then those freed
longest ago, as vLLM's LRU free queue does: taking the lowest block every time, it evicted the
turn that had just finished, and vLLM's prefix cache never hit for a follow-up turn. A freed
page's eviction cost is fixed when it is freed (it holds cached KV or not, and when it was
freed); only taking the page, or resetting the prefix cache, changes that.

Four methods of the pool instance are wrapped (`get_new_blocks`, `touch`, `free_blocks`,
`reset_prefix_cache`), and `allocate_slots` of the manager, which names the request the pages
are for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from antiphon.engine_ext.biblocks import SharedBlockLayout


class PositionalPages:
    def __init__(self, manager: KVCacheManager, block_pages: int,
                 is_rt: Callable[[Request], bool]) -> None:
        pool = manager.block_pool
        self.pool = pool
        self.layout = SharedBlockLayout(pool.num_gpu_blocks, block_pages,
                                        excluded=[pool.null_block.block_id])
        self._is_rt = is_rt
        self._current: tuple[str, bool] | None = None
        self._frees = 0  # pages freed so far: orders the cached free pages by recency
        self._install(manager)

    def _install(self, manager: KVCacheManager) -> None:
        pool = self.pool
        free_blocks, touch, allocate_slots = pool.free_blocks, pool.touch, manager.allocate_slots
        reset_prefix_cache = pool.reset_prefix_cache

        def get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
            return self._get_new_blocks(num_blocks)

        def touch_blocks(blocks: Sequence[KVCacheBlock]) -> None:
            taken = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
            touch(blocks)
            if self._current is not None:
                request_id, is_rt = self._current
                for block in taken:
                    if self.layout.owner(block.block_id) is None:
                        self.layout.take(request_id, is_rt, block.block_id, from_cache=True)

        def free(ordered_blocks: Iterable[KVCacheBlock]) -> None:
            blocks = list(ordered_blocks)
            free_blocks(blocks)
            for block in blocks:
                if block.ref_cnt == 0:
                    self._frees += 1
                    # Cached KV is evicted oldest first: a more recent page costs more.
                    cost = 0 if block.block_hash is None else self._frees
                    self.layout.release(block.block_id, cost)

        def reset(*args: Any, **kwargs: Any) -> bool:
            done: bool = reset_prefix_cache(*args, **kwargs)
            if done:
                self.layout.forget_costs()
            return done

        def allocate(request: Request, *args: Any, **kwargs: Any) -> Any:
            with self.allocating_for(request):
                return allocate_slots(request, *args, **kwargs)

        pool.get_new_blocks = get_new_blocks  # type: ignore[method-assign]
        pool.touch = touch_blocks  # type: ignore[method-assign]
        pool.free_blocks = free  # type: ignore[method-assign]
        pool.reset_prefix_cache = reset  # type: ignore[method-assign]
        manager.allocate_slots = allocate  # type: ignore[method-assign]

    @contextmanager
    def allocating_for(self, request: Request) -> Iterator[None]:
        previous = self._current
        self._current = (request.request_id, self._is_rt(request))
        try:
            yield
        finally:
            self._current = previous

    def _get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """`BlockPool.get_new_blocks`, with pages chosen by the layout."""
        pool = self.pool
        if num_blocks > pool.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        if self._current is None:  # not for a request (none in vLLM 0.32): the queue's head
            ret = pool.free_block_queue.popleft_n(num_blocks)
        else:
            request_id, is_rt = self._current
            pages = self.layout.place(request_id, is_rt, num_blocks, self._is_free)
            ret = [pool.blocks[page] for page in pages]
            for block in ret:
                pool.free_block_queue.remove(block)
        return _hand_out(pool, ret)

    def _is_free(self, page: int) -> bool:
        block = self.pool.blocks[page]
        return block.ref_cnt == 0 and not block.is_null

    def preempting(self, request_id: str) -> None:
        self.layout.preempting(request_id)

    def check_integrity(self) -> list[str]:
        return self.layout.check_integrity(self._is_free)

    def stats(self) -> dict[str, Any]:
        return {**self.layout.occupancy(), **vars(self.layout.counters)}


def _hand_out(pool: BlockPool, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    """The rest of vLLM's `get_new_blocks` once the pages are out of the free queue."""
    if pool._reuse_watchers:
        pool._notify_reuse(blocks)
    for block in blocks:
        if pool.enable_caching:
            pool._maybe_evict_cached_block(block)
        assert block.ref_cnt == 0
        block.ref_cnt += 1
        if pool.metrics_collector:
            pool.metrics_collector.on_block_allocated(block)
    return blocks
