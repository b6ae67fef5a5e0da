"""Bidirectional shared KV blocks: which request owns each KV page, placed by position.

BROS lets one RT and one BE request share each KV block from opposite ends. Stock attention
kernels read a vLLM page from slot 0 upward, so Antiphon applies the layout one level up: a
*shared block* is a run of `block_pages` consecutive vLLM pages; RT requests take pages from its
low end upward, BE requests from its high end downward, and inside a page everything stays as
the kernels expect. A BE request fills its block from the top, so the page at the collision
front is its newest one: when memory runs out and an RT request grows into a preempted BE
request's block, it takes the BE request's *tail*, the pages the lazy checkpoint copied to the
host tier, while the BE request's older pages stay on the device for its prefix cache.

`SharedBlockLayout` is the bookkeeping only (no vLLM, no torch): the scheduler asks it where to
put a request's next pages (`place`) among the pages vLLM has free, and tells it when pages come
back (`release`). Placement, in order of preference:

    grow      the request's current block, next page in its direction
    new block a block with no other request of its class: the one with the most free pages
              on its side (BROS's "most empty slots"); among equals, the one whose free pages
              lose the least of vLLM's prefix cache (`eviction_cost`: pages holding no cached
              KV first, then those freed longest ago, as vLLM's own free queue evicts)
    overflow  a block that already has a request of its class, where the direction still holds
    stray     any free page (counted; the direction no longer describes that page)

`check_integrity()` verifies the invariants: every page owned once, and in every shared block
every RT page below every BE page (strays excepted, and counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable


@dataclasses.dataclass
class LayoutCounters:
    pages_placed: int = 0
    new_blocks: int = 0  # a request started a shared block of its own
    overflows: int = 0  # a request shared a block with another request of its class
    strays: int = 0  # no page kept the direction: placed anywhere
    collisions: int = 0  # an RT request took a page a preempted BE request had just held


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
        self._last: dict[str, int] = {}  # request -> the page it took last (in the layout)
        self._strays: set[int] = set()
        self._tails: set[int] = set()  # pages of preempted BE requests, not yet reused
        self.counters = LayoutCounters()

    # -- queries -----------------------------------------------------------------------------

    def owner(self, page: int) -> tuple[str, bool] | None:
        return self._owner.get(page)

    def pages_of_class(self, is_rt: bool) -> int:
        return sum(1 for _, rt in self._owner.values() if rt == is_rt)

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
              is_free: Callable[[int], bool],
              eviction_cost: Callable[[int], int] = lambda page: 0) -> list[int]:
        """Choose `num_pages` pages for the request among those `is_free` says vLLM has free
        (there must be that many), and record them as its own. `eviction_cost(page)` is what
        taking a free page loses (0: nothing cached in it); it breaks ties between blocks."""
        taken: list[int] = []
        chosen: set[int] = set()

        def free(page: int) -> bool:
            return page not in chosen and page not in self._excluded and is_free(page)

        for _ in range(num_pages):
            page = self._next_page(request_id, is_rt, free, eviction_cost)
            chosen.add(page)
            self.take(request_id, is_rt, page)
            taken.append(page)
        return taken

    def take(self, request_id: str, is_rt: bool, page: int) -> None:
        """Record `page` as the request's (placed here, or found in vLLM's prefix cache)."""
        if page in self._owner:
            raise ValueError(f"page {page} is owned by {self._owner[page][0]}")
        index = page // self.block_pages
        block = self._blocks[index]
        high_rt, low_be = self._bounds(index)
        if not (page < low_be if is_rt else page > high_rt):
            self._strays.add(page)
            self.counters.strays += 1
        side = block.rt if is_rt else block.be
        side[request_id] = side.get(request_id, 0) + 1
        self._owner[page] = (request_id, is_rt)
        self._last[request_id] = page
        self.counters.pages_placed += 1
        if page in self._tails:
            self._tails.discard(page)
            if is_rt:
                self.counters.collisions += 1

    def release(self, page: int) -> None:
        """vLLM has the page back (free, perhaps still in its prefix cache)."""
        owner = self._owner.pop(page, None)
        self._strays.discard(page)
        if owner is None:
            return
        request_id, is_rt = owner
        block = self._blocks[page // self.block_pages]
        side = block.rt if is_rt else block.be
        side[request_id] -= 1
        if not side[request_id]:
            del side[request_id]
        if self._last.get(request_id) == page:
            del self._last[request_id]

    def preempting(self, request_id: str) -> None:
        """The request is about to give its pages back for others (lazy checkpointing): an RT
        request that takes one of them next has collided with it."""
        self._tails.update(p for p, (rid, is_rt) in self._owner.items()
                           if rid == request_id and not is_rt)

    # -- integrity ---------------------------------------------------------------------------

    def check_integrity(self, is_free: Callable[[int], bool] | None = None) -> list[str]:
        """The invariants, as a list of problems (empty when they hold). With `is_free`, also
        that no owned page is free in vLLM's pool."""
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
        for index, (block, count) in enumerate(zip(self._blocks, counts, strict=True)):
            if block.rt != count.rt or block.be != count.be:
                problems.append(f"block {index}: owner counts {block} disagree with pages {count}")
            pages = range(index * self.block_pages,
                          min(self.num_pages, (index + 1) * self.block_pages))
            rt_pages = [p for p in pages if p not in self._strays
                        and self._owner.get(p, ("", False))[1]]
            be_pages = [p for p in pages if p not in self._strays and p in self._owner
                        and not self._owner[p][1]]
            if rt_pages and be_pages and max(rt_pages) > min(be_pages):
                problems.append(f"block {index}: RT page {max(rt_pages)} above BE page "
                                f"{min(be_pages)}")
        problems += [f"stray page {p} is not owned" for p in self._strays if p not in self._owner]
        return problems

    # -- placement ---------------------------------------------------------------------------

    def _next_page(self, request_id: str, is_rt: bool, free: Callable[[int], bool],
                   eviction_cost: Callable[[int], int]) -> int:
        last = self._last.get(request_id)
        if last is not None and last not in self._strays:
            page = self._page_in(last // self.block_pages, is_rt, free)
            if page is not None:
                return page
        best: tuple[bool, int] | None = None  # (has others, -room) of the best blocks
        ties: list[tuple[int, list[int]]] = []  # those blocks: (index, free window)
        for index, block in enumerate(self._blocks):
            others = [r for r in (block.rt if is_rt else block.be) if r != request_id]
            window = self._free_window(index, is_rt, free)
            if not window:
                continue
            key = (bool(others), -len(window))
            if best is None or key < best:
                best, ties = key, []
            if key == best:
                if key == (False, -self.block_pages) and not any(map(eviction_cost, window)):
                    # An empty block holding nothing cached: no other block does better.
                    self.counters.new_blocks += 1
                    return window[0] if is_rt else window[-1]  # as `_page_in` picks
                ties.append((index, window))
        if best is not None:
            # Among the best, the block whose pages lose the least of the prefix cache.
            _, index = min((max(map(eviction_cost, window)), index) for index, window in ties)
            has_others = best[0]
            page = self._page_in(index, is_rt, free)
            assert page is not None
            if has_others:
                self.counters.overflows += 1
            else:
                self.counters.new_blocks += 1
            return page
        for page in range(self.num_pages):
            if free(page):
                return page
        raise ValueError("no free page to place")

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

    def _free_window(self, index: int, is_rt: bool, free: Callable[[int], bool]) -> list[int]:
        """Free pages of the block the class may take without breaking the direction."""
        high_rt, low_be = self._bounds(index)
        pages = self._pages(index)
        window = range(pages.start, low_be) if is_rt else range(high_rt + 1, pages.stop)
        return [page for page in window if free(page)]

    def _page_in(self, index: int, is_rt: bool, free: Callable[[int], bool]) -> int | None:
        """The block's next page for the class: RT the lowest free page below every BE page,
        BE the highest free page above every RT page."""
        high_rt, low_be = self._bounds(index)
        pages = self._pages(index)
        window = range(pages.start, low_be) if is_rt else range(pages.stop - 1, high_rt, -1)
        return next((page for page in window if free(page)), None)
