"""Bidirectional shared KV blocks: which request owns each KV page, placed by position.

BROS lets one RT and one BE request share each KV block from opposite ends. Stock attention
kernels read a vLLM page from slot 0 upward, so Antiphon applies the layout one level up: a
*shared block* is a run of `block_pages` consecutive vLLM pages; RT requests take pages from its
low end upward, BE requests from its high end downward, and inside a page everything stays as
the kernels expect. A BE request fills its block from the top, so the page at the collision
front is its newest one in that block: when memory runs out and an RT request grows into a
preempted BE request's block, it takes the BE request's *tail*, the pages the lazy checkpoint
copied to the host tier, while the BE request's older pages stay on the device for its prefix
cache. A BE request that went on into another block has its tail there: an RT request growing
in its first block takes a page from the middle of its sequence, and the restore loads every
page after it from the host tier (vLLM's prefix cache stops at the first page missing), pages
still on the device among them. Nothing is recomputed for it, but those loads are wasted.

`SharedBlockLayout` is the bookkeeping only (no vLLM, no torch): the scheduler asks it where to
put a request's next pages (`place`), and tells it which pages a request found in the prefix
cache (`take`) and which came back (`release`, with what taking the page again would evict).
Placement, in order of preference:

    grow      the request's current block, next page in its direction
    new block a block with no request of its class: the one with the most free pages on its
              side (BROS's "most empty slots"), pages that hold cached KV counting
              `block_pages // 2` fewer (vLLM's own free queue hands out pages holding
              nothing first: ranked by free pages alone, a new turn took the pages of the
              turn that had just finished while a block of pages holding nothing was free;
              ranked by cached or not first, it took a lone free page at the pool's end and
              spilled into a second block); among equals, the one whose free pages lose the
              least of vLLM's prefix cache (freed longest ago, as vLLM's free queue evicts)
    overflow  a block that already has a request of its class, where the direction still holds
    stray     any free page (counted; the direction no longer describes that page)

A GPU pool has 10^5 pages, so placement must not scan them. Each class keeps a heap of blocks
keyed by (has a request of the class, -free pages on that side less the cached penalty,
eviction cost, index); a page
taken or released in a block re-keys that block alone (O(block_pages + log blocks)), and stale
entries are skipped when popped. The pages the layout sees as free are those it does not own;
`place` checks each page it picks against vLLM's pool, and a page the pool holds without the
layout knowing (`foreign`, counted) is set aside until the pool frees it.

`check_integrity()` verifies the invariants: every page owned once, and in every shared block
every RT page below every BE page (strays excepted, and counted).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable

# A block's place in a class's heap: (has a request of the class, -free pages on the class's
# side, plus `_cached_penalty` where they hold cached KV, eviction cost of those pages, block
# index, the block's version when keyed).
_Key = tuple[bool, int, int, int, int]


@dataclasses.dataclass
class LayoutCounters:
    pages_placed: int = 0  # pages chosen for requests (not those found in the prefix cache)
    new_blocks: int = 0  # a request started a shared block of its own
    overflows: int = 0  # a request shared a block with another request of its class
    strays: int = 0  # no page kept the direction: placed anywhere
    collisions: int = 0  # an RT request took a page a preempted BE request had just held
    foreign: int = 0  # pages the pool held although the layout had them free (set aside)


@dataclasses.dataclass
class _Block:
    rt: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> pages held here
    be: dict[str, int] = dataclasses.field(default_factory=dict)


class SharedBlockLayout:
    """Page ownership of a KV pool of `num_pages` pages in shared blocks of `block_pages`.

    `excluded` pages (vLLM's null page) are never placed.
    """

    def __init__(self, num_pages: int, block_pages: int, excluded: Iterable[int] = ()) -> None:
        if num_pages < 1 or block_pages < 1:
            raise ValueError("num_pages and block_pages must be at least 1")
        self.num_pages = num_pages
        self.block_pages = block_pages
        self.num_blocks = -(-num_pages // block_pages)
        self._excluded = frozenset(excluded)
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        self._owner: dict[int, tuple[str, bool]] = {}  # page -> (request id, is RT)
        self._pages_of: dict[str, set[int]] = {}  # request -> its pages
        self._num_rt_pages = 0
        self._last: dict[str, int] = {}  # request -> the page it took last (in the layout)
        self._strays: set[int] = set()
        # pages of preempted BE requests, not yet reused: page -> request, and by request
        self._tails: dict[int, str] = {}
        self._tails_of: dict[str, set[int]] = {}
        self._foreign: set[int] = set()  # held by the pool, not by the layout
        self._cost: dict[int, int] = {}  # free page -> what taking it evicts (absent: nothing)
        self._version = [0] * self.num_blocks
        self._cached_penalty = max(1, block_pages // 2)  # pages; see placement above
        self._heaps: dict[bool, list[_Key]] = {True: [], False: []}  # by class (is RT)
        self._with_free: set[int] = set()  # blocks with a free page
        for index in range(self.num_blocks):
            self._rekey(index)
        self.counters = LayoutCounters()

    def reset_counters(self) -> None:
        """`counters` from zero (the placements of a start-up profile are not the server's)."""
        self.counters = LayoutCounters()

    # -- queries -----------------------------------------------------------------------------

    def owner(self, page: int) -> tuple[str, bool] | None:
        return self._owner.get(page)

    def pages_of_class(self, is_rt: bool) -> int:
        return self._num_rt_pages if is_rt else len(self._owner) - self._num_rt_pages

    def shared_blocks(self) -> int:
        """Blocks that hold an RT and a BE request now."""
        return sum(1 for b in self._blocks if b.rt and b.be)

    def occupancy(self) -> dict[str, int]:
        return {"pages_rt": self.pages_of_class(True), "pages_be": self.pages_of_class(False),
                "blocks_shared": self.shared_blocks(),
                "blocks_used": sum(1 for b in self._blocks if b.rt or b.be),
                "blocks_total": self.num_blocks}

    # -- changes -----------------------------------------------------------------------------

    def place(self, request_id: str, is_rt: bool, num_pages: int,
              is_free: Callable[[int], bool]) -> list[int]:
        """Choose `num_pages` pages for the request among those free in vLLM's pool (`is_free`;
        there must be that many), and record them as its own."""
        taken: list[int] = []
        for _ in range(num_pages):
            page, overflow = self._next_page(request_id, is_rt)
            while not is_free(page):  # the pool holds it: set it aside until it comes back
                self._foreign.add(page)
                self.counters.foreign += 1
                self._rekey(page // self.block_pages)
                page, overflow = self._next_page(request_id, is_rt)
            # counted only for the page taken: one set aside was chosen the same way
            if overflow is not None:
                self.counters.overflows += overflow
                self.counters.new_blocks += not overflow
            self.take(request_id, is_rt, page)
            taken.append(page)
        return taken

    def take(self, request_id: str, is_rt: bool, page: int, *, from_cache: bool = False) -> None:
        """Record `page` as the request's: placed here, or found in vLLM's prefix cache
        (`from_cache`: its KV is read, not overwritten, so a preempted BE request's page taken
        so is no collision)."""
        if page in self._owner:
            raise ValueError(f"page {page} is owned by {self._owner[page][0]}")
        index = page // self.block_pages
        block = self._blocks[index]
        high_rt, low_be = self._bounds(index)
        if not (page < low_be if is_rt else page > high_rt):
            self._strays.add(page)
            self.counters.strays += not from_cache  # a placement's kind, as `pages_placed`
        side = block.rt if is_rt else block.be
        side[request_id] = side.get(request_id, 0) + 1
        self._owner[page] = (request_id, is_rt)
        self._pages_of.setdefault(request_id, set()).add(page)
        self._num_rt_pages += is_rt
        self._last[request_id] = page
        self._cost.pop(page, None)
        self._foreign.discard(page)
        self.counters.pages_placed += not from_cache  # (a cache hit was placed before)
        tail_of = self._tails.pop(page, None)
        if tail_of is not None:
            self._tails_of[tail_of].discard(page)
            if is_rt and not from_cache:
                self.counters.collisions += 1
        self.forget_tails(request_id)  # running again: what it gave back is no one's tail
        self._rekey(index)

    def release(self, page: int, eviction_cost: int = 0) -> None:
        """vLLM has the page back, free; `eviction_cost` is what taking it again loses (0: it
        holds no cached KV; else larger the more recently it was freed)."""
        self._foreign.discard(page)
        if eviction_cost:
            self._cost[page] = eviction_cost
        owner = self._owner.pop(page, None)
        self._strays.discard(page)
        if owner is not None:
            request_id, is_rt = owner
            block = self._blocks[page // self.block_pages]
            side = block.rt if is_rt else block.be
            side[request_id] -= 1
            if not side[request_id]:
                del side[request_id]
            pages = self._pages_of[request_id]
            pages.discard(page)
            if not pages:
                del self._pages_of[request_id]
            self._num_rt_pages -= is_rt
            if self._last.get(request_id) == page:
                del self._last[request_id]
        self._rekey(page // self.block_pages)

    def forget_costs(self) -> None:
        """vLLM's prefix cache was reset: no free page holds cached KV any more."""
        touched = {page // self.block_pages for page in self._cost}
        self._cost.clear()
        for index in touched:
            self._rekey(index)

    def preempting(self, request_id: str) -> None:
        """The request is about to give its pages back for others (lazy checkpointing): an RT
        request that takes one of them next, while it waits to run again, has collided with
        it."""
        pages = {p for p in self._pages_of.get(request_id, ()) if not self._owner[p][1]}
        for page in pages:
            self._tails[page] = request_id
        if pages:
            self._tails_of.setdefault(request_id, set()).update(pages)

    def forget_tails(self, request_id: str) -> None:
        """The request runs again or is gone: its pages given back are no collision's any
        more (counted for ever, a page taken long after its BE request ended or resumed was a
        collision: 18 of 553 in a review's run)."""
        for page in self._tails_of.pop(request_id, ()):
            del self._tails[page]

    # -- integrity ---------------------------------------------------------------------------

    def check_integrity(self, is_free: Callable[[int], bool] | None = None) -> list[str]:
        """The invariants, as a list of problems (empty when they hold). With `is_free`, also
        that the pages the layout owns are the pages the pool holds."""
        problems = []
        counts: list[_Block] = [_Block() for _ in range(self.num_blocks)]
        for page, (request_id, is_rt) in self._owner.items():
            if page in self._excluded or not 0 <= page < self.num_pages:
                problems.append(f"page {page} cannot be owned")
            if is_free is not None and is_free(page):
                problems.append(f"page {page} of {request_id} is free in the pool")
            side = counts[page // self.block_pages]
            table = side.rt if is_rt else side.be
            table[request_id] = table.get(request_id, 0) + 1
        if is_free is not None:
            problems += [f"page {page} is held in the pool but not in the layout"
                         for page in range(self.num_pages) if page not in self._owner
                         and page not in self._excluded and page not in self._foreign
                         and not is_free(page)]
        for index, (block, count) in enumerate(zip(self._blocks, counts, strict=True)):
            if block.rt != count.rt or block.be != count.be:
                problems.append(f"block {index}: owner counts {block} disagree with pages {count}")
            high_rt, low_be = self._bounds(index)
            if high_rt > low_be:
                problems.append(f"block {index}: RT page {high_rt} above BE page {low_be}")
        problems += [f"stray page {p} is not owned" for p in self._strays if p not in self._owner]
        with_free = {index for index in range(self.num_blocks)
                     if any(self._is_free(page) for page in self._pages(index))}
        if with_free != self._with_free:
            problems.append(f"blocks with a free page {sorted(with_free)} are not those "
                            f"known {sorted(self._with_free)}")
        if sum(map(len, self._pages_of.values())) != len(self._owner):
            problems.append("pages by request disagree with page owners")
        return problems

    # -- placement ---------------------------------------------------------------------------

    def _next_page(self, request_id: str, is_rt: bool) -> tuple[int, bool | None]:
        """The request's next page, and for a page in another block whether that block has a
        request of its class already (an overflow) or not (a new block); None when the page
        grows its block or strays."""
        last = self._last.get(request_id)
        if last is not None and last not in self._strays:
            page = self._page_in(last // self.block_pages, is_rt)
            if page is not None:
                return page, None
        index = self._best_block(is_rt)
        if index is not None:
            side = self._blocks[index].rt if is_rt else self._blocks[index].be
            page = self._page_in(index, is_rt)
            assert page is not None, "a keyed block with room has a free page"
            return page, any(other != request_id for other in side)
        # Rare: no block has room in the class's direction. Any free page (a stray), from a
        # block known to have one: a scan of a GPU pool's 10^5 pages took 5 ms a page.
        for index in self._with_free:
            for page in self._pages(index):
                if self._is_free(page):
                    return page, None
        raise ValueError("no free page to place")

    def _best_block(self, is_rt: bool) -> int | None:
        """The block the class's heap puts first, skipping stale entries."""
        heap = self._heaps[is_rt]
        while heap:
            index, version = heap[0][-2], heap[0][-1]
            if version == self._version[index]:
                return index
            heapq.heappop(heap)
        return None

    def _rekey(self, index: int) -> None:
        """The block changed: a new entry in each class's heap (the old ones go stale)."""
        self._version[index] += 1
        version = self._version[index]
        block = self._blocks[index]
        bounds = self._bounds(index)
        if any(self._is_free(page) for page in self._pages(index)):
            self._with_free.add(index)
        else:
            self._with_free.discard(index)
        for is_rt, heap in self._heaps.items():
            window = self._free_window(index, is_rt, bounds)
            if window:
                cost = max(self._cost.get(page, 0) for page in window)
                room = len(window) - (self._cached_penalty if cost else 0)
                heapq.heappush(heap, (bool(block.rt if is_rt else block.be), -room, cost,
                                      index, version))
            if len(heap) > 4 * self.num_blocks + 64:
                heap[:] = [key for key in heap if key[-1] == self._version[key[-2]]]
                heapq.heapify(heap)

    def _is_free(self, page: int) -> bool:
        return not (page in self._owner or page in self._excluded or page in self._foreign)

    def _pages(self, index: int) -> range:
        return range(index * self.block_pages,
                     min(self.num_pages, (index + 1) * self.block_pages))

    def _bounds(self, index: int) -> tuple[int, int]:
        """(highest RT page, lowest BE page) of the block, with sentinels when it has none."""
        pages = self._pages(index)
        high_rt, low_be = pages.start - 1, pages.stop
        for page in pages:
            owner = self._owner.get(page)
            if owner is None or page in self._strays:
                continue
            if owner[1]:
                high_rt = max(high_rt, page)
            else:
                low_be = min(low_be, page)
        return high_rt, low_be

    def _free_window(self, index: int, is_rt: bool,
                     bounds: tuple[int, int] | None = None) -> list[int]:
        """Free pages of the block the class may take without breaking the direction
        (`bounds`: the block's `_bounds`, where the caller has them)."""
        high_rt, low_be = bounds or self._bounds(index)
        pages = self._pages(index)
        window = range(pages.start, low_be) if is_rt else range(high_rt + 1, pages.stop)
        return [page for page in window if self._is_free(page)]

    def _page_in(self, index: int, is_rt: bool) -> int | None:
        """The block's next page for the class: RT the lowest free page below every BE page,
        BE the highest free page above every RT page."""
        window = self._free_window(index, is_rt)
        if not window:
            return None
        return window[0] if is_rt else window[-1]
