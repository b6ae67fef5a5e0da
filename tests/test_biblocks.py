"""`SharedBlockLayout` without vLLM: placement by position in bidirectional shared blocks, and
property tests that drive it with random RT/BE arrivals, growth, preemptions and completions,
checking the invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from antiphon.engine_ext.biblocks import SharedBlockLayout


class Pool:
    """vLLM's page pool, reduced to which pages are free (page 0 is the null page)."""

    def __init__(self, num_pages: int, block_pages: int) -> None:
        self.layout = SharedBlockLayout(num_pages, block_pages, excluded=[0])
        self.free = set(range(1, num_pages))
        self.pages: dict[str, list[int]] = {}

    def grow(self, request_id: str, is_rt: bool, num_pages: int) -> list[int]:
        taken = self.layout.place(request_id, is_rt, num_pages, self.free.__contains__)
        self.free -= set(taken)
        self.pages.setdefault(request_id, []).extend(taken)
        return taken

    def finish(self, request_id: str) -> None:
        for page in self.pages.pop(request_id):
            self.layout.release(page)
            self.free.add(page)


def test_rt_grows_up_from_the_low_end_and_be_down_from_the_high_end() -> None:
    pool = Pool(9, 4)  # blocks [1..3] (page 0 is null) and [4..7], [8]
    assert pool.grow("be", False, 3) == [7, 6, 5]
    assert pool.grow("rt", True, 2) == [1, 2]  # the emptiest block without an RT request
    assert pool.grow("rt", True, 1) == [3]
    assert pool.grow("rt", True, 1) == [4]  # its block is full: continues below the BE pages
    assert pool.layout.shared_blocks() == 1
    assert pool.layout.check_integrity(pool.free.__contains__) == []


def test_an_rt_request_that_grows_into_a_preempted_be_block_takes_its_tail() -> None:
    pool = Pool(9, 8)  # one shared block of pages 1..7 (and page 8)
    pool.grow("be", False, 4)  # pages 7, 6, 5, 4: page 4 is its newest
    pool.grow("rt", True, 3)  # pages 1, 2, 3
    pool.layout.preempting("be")
    pool.finish("be")
    assert pool.grow("rt", True, 1) == [4]  # the BE request's tail, first
    assert pool.layout.counters.collisions == 1


def test_a_page_is_a_collision_only_while_its_be_request_waits_to_run_again() -> None:
    """A preempted BE request's pages stayed tails for ever: an RT request taking one long
    after the BE request had resumed, or ended, counted a collision."""
    pool = Pool(9, 8)
    pool.grow("be", False, 2)  # pages 7, 6
    pool.layout.preempting("be")
    pool.finish("be")
    pool.grow("be", False, 1)  # it resumes (page 7 again, from the prefix cache say)
    pool.grow("rt", True, 7)  # every other page, 6 among them
    assert pool.layout.counters.collisions == 0
    pool.finish("rt")
    pool.grow("other", False, 1)
    pool.layout.preempting("other")
    pool.finish("other")
    pool.layout.forget_tails("other")  # it ended while it waited (aborted)
    pool.grow("rt", True, 6)
    assert pool.layout.counters.collisions == 0


def test_a_preempted_be_page_found_in_the_prefix_cache_is_no_collision() -> None:
    """An RT turn sharing a preempted BE request's cached prefix reads those pages, it does
    not overwrite them: each counted a collision."""
    pool = Pool(9, 8)
    pool.grow("be", False, 2)  # pages 7, 6
    pool.layout.preempting("be")
    pool.finish("be")
    pool.layout.take("rt", True, 7, from_cache=True)  # its prompt shares be's first page
    assert pool.layout.counters.collisions == 0
    pool.free.discard(7)
    pool.layout.take("rt", True, 6)  # placed over be's tail: overwritten
    assert pool.layout.counters.collisions == 1


def test_placement_prefers_blocks_without_a_request_of_the_same_class() -> None:
    pool = Pool(13, 4)  # blocks [1..3], [4..7], [8..11], [12]
    pool.grow("rt-a", True, 1)
    pool.grow("rt-b", True, 1)
    pool.grow("rt-c", True, 1)
    owners = {pool.pages[r][0] // 4 for r in ("rt-a", "rt-b", "rt-c")}
    assert owners == {0, 1, 2} and pool.layout.counters.overflows == 0


def test_placement_spares_the_cached_pages_of_a_turn_that_just_finished() -> None:
    """Among equally empty blocks, pages holding no cached KV first, then those freed longest
    ago (vLLM's LRU): a new turn must not evict the turn that just finished."""
    pool = Pool(17, 4)  # blocks [1..3], [4..7], [8..11], [12..15], [16]

    def finish(request_id: str, when: int) -> None:  # its pages stay cached, freed at `when`
        for page in pool.pages.pop(request_id):
            pool.layout.release(page, eviction_cost=when)
            pool.free.add(page)

    assert pool.grow("turn-1", True, 3) == [4, 5, 6]  # a full block first (most room)
    finish("turn-1", when=1)
    assert pool.grow("turn-2", True, 3) == [8, 9, 10]  # not [4..7]: it holds turn-1's KV
    finish("turn-2", when=2)
    assert pool.grow("turn-3", True, 3) == [12, 13, 14]
    finish("turn-3", when=3)
    # Three pages holding nothing beat four holding a finished turn's KV (vLLM's free queue,
    # too, hands out the pages that hold nothing first)...
    assert pool.grow("turn-4", True, 3) == [1, 2, 3]
    finish("turn-4", when=4)
    # ...but a lone free page at the pool's end does not: the turn would spill over two
    # blocks and take cached pages all the same. Every block caches: the oldest goes.
    assert pool.grow("turn-5", True, 3) == [4, 5, 6]
    finish("turn-5", when=5)
    pool.layout.forget_costs()  # the prefix cache was reset: nothing cached anywhere
    assert pool.grow("turn-6", True, 3) == [4, 5, 6]  # the lowest of the emptiest blocks
    assert pool.layout.check_integrity(pool.free.__contains__) == []


def test_a_page_the_pool_holds_unknown_to_the_layout_is_set_aside_until_freed() -> None:
    pool = Pool(9, 4)  # blocks [1..3], [4..7], [8]
    pool.free.discard(4)  # vLLM handed page 4 out without naming a request
    assert pool.grow("rt", True, 2) == [1, 2]  # block [4..7] looked emptiest; 4 was held
    assert pool.layout.counters.foreign == 1
    assert pool.grow("rt2", True, 3) == [5, 6, 7]  # page 4 is not handed out twice
    assert pool.layout.check_integrity(pool.free.__contains__) == []
    pool.layout.release(4)  # the pool frees it
    pool.free.add(4)
    assert sorted(pool.grow("rt3", True, 3)) == [3, 4, 8]  # page 4 is placed again
    assert pool.layout.check_integrity(pool.free.__contains__) == []


def test_placement_does_not_scan_the_pool() -> None:
    """On a GPU-sized pool, placing a page looks at a few blocks, not at every page: count
    the layout's reads of page ownership per page placed."""
    layout = SharedBlockLayout(100_000, 16, excluded=[0])
    free = set(range(1, 100_000))
    reads = 0

    class CountingOwners(dict[int, tuple[str, bool]]):
        def get(self, *args: object) -> object:  # type: ignore[override]
            nonlocal reads
            reads += 1
            return super().get(*args)  # type: ignore[arg-type]

    layout._owner = CountingOwners()
    held: list[list[int]] = []
    for i in range(400):
        pages = layout.place(f"r{i}", i % 2 == 0, 5, free.__contains__)
        free -= set(pages)
        held.append(pages)
        if len(held) > 50:
            for page in held.pop(0):
                layout.release(page, eviction_cost=i)
                free.add(page)
    assert reads / (400 * 5) < 20 * 16  # a few blocks of 16 pages each, not 100,000 pages
    assert layout.check_integrity(free.__contains__) == []


def test_a_stray_page_is_found_without_a_scan_of_the_pool() -> None:
    """With no block's window open to RT (BE pages at the foot of every block), a stray was
    found by scanning the pool from its start: 5 ms a page on a pool of 10^5."""
    layout = SharedBlockLayout(32_000, 16, excluded=[0])
    for index in range(layout.num_blocks):  # the free pages in the last 4 blocks only
        pages = layout._pages(index)
        for page in pages if index < layout.num_blocks - 4 else pages[:1]:
            if page:  # (page 0 is the null page)
                layout.take(f"be-{index}", False, page)
    looked = 0
    is_free = layout._is_free

    def counted(page: int) -> bool:
        nonlocal looked
        looked += 1
        return is_free(page)

    layout._is_free = counted  # type: ignore[method-assign]
    pages = layout.place("rt", True, 32, lambda page: True)
    assert len(set(pages)) == 32 and layout.counters.strays == 32
    assert looked < 32 * 200  # a few blocks a page, not 32,000 pages
    layout._is_free = is_free  # type: ignore[method-assign]
    assert layout.check_integrity() == []


def test_integrity_reports_a_broken_direction_and_a_double_owner() -> None:
    layout = SharedBlockLayout(8, 8)
    layout.take("be", False, 2)
    layout.take("rt", True, 5)  # above the BE page: counted as a stray, not silently mixed
    assert layout.counters.strays == 1
    assert layout.check_integrity() == []
    with pytest.raises(ValueError, match="owned"):
        layout.take("rt2", True, 2)
    assert layout.check_integrity(is_free=lambda page: page != 2) == [
        "page 5 of rt is free in the pool"]
    hit = SharedBlockLayout(8, 8)
    hit.take("be", False, 2)
    hit.take("rt", True, 5, from_cache=True)  # a prefix-cache hit: not placed, so no stray
    assert (hit.counters.pages_placed, hit.counters.strays) == (1, 0)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        SharedBlockLayout(0, 4)
    with pytest.raises(ValueError):
        SharedBlockLayout(8, 0)


def eligible(pool: Pool, is_rt: bool) -> tuple[set[int], set[int]]:
    """By brute force: free pages the class can take keeping the direction, and those of
    them in blocks with no other request of its class (a fresh block for the request)."""
    layout = pool.layout
    ok, alone = set(), set()
    for page in pool.free:
        block = range(page // layout.block_pages * layout.block_pages,
                      min(layout.num_pages, (page // layout.block_pages + 1) * layout.block_pages))
        owners = [(p, layout.owner(p)) for p in block if layout.owner(p) is not None]
        rt = [p for p, o in owners if o and o[1]]
        be = [p for p, o in owners if o and not o[1]]
        if (is_rt and all(page < p for p in be)) or (not is_rt and all(page > p for p in rt)):
            ok.add(page)
            if not (rt if is_rt else be):
                alone.add(page)
    return ok, alone


operation = st.tuples(st.sampled_from(["arrive", "grow", "finish", "preempt"]),
                      st.booleans(), st.integers(0, 7), st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(4, 40), block_pages=st.integers(1, 6),
       ops=st.lists(operation, min_size=1, max_size=60))
def test_random_traffic_keeps_every_invariant(num_pages: int, block_pages: int,
                                              ops: list[tuple[str, bool, int, int]]) -> None:
    pool = Pool(num_pages, block_pages)
    classes: dict[str, bool] = {}
    for kind, is_rt, index, size in ops:
        request_id = f"{'rt' if is_rt else 'be'}-{index}"
        if kind in ("arrive", "grow"):
            if kind == "grow" and request_id not in pool.pages:
                continue
            classes[request_id] = is_rt
            for _ in range(min(size, len(pool.free))):
                ok, alone = eligible(pool, is_rt)
                strays, overflows = pool.layout.counters.strays, pool.layout.counters.overflows
                (page,) = pool.grow(request_id, is_rt, 1)
                if pool.layout.counters.strays > strays:
                    assert not ok, "a stray page although one kept the direction"
                else:
                    assert page in ok
                if pool.layout.counters.overflows > overflows:
                    assert not alone, "shared a block although a block of its own had room"
        elif request_id in pool.pages:
            if kind == "preempt":
                pool.layout.preempting(request_id)
            pool.finish(request_id)
        assert pool.layout.check_integrity(pool.free.__contains__) == []
        owned = {p for pages in pool.pages.values() for p in pages}
        assert not owned & pool.free and len(owned) == sum(map(len, pool.pages.values()))
        assert pool.layout.pages_of_class(True) == sum(
            len(p) for r, p in pool.pages.items() if classes[r])


def test_layout_counters_are_exported_to_prometheus() -> None:
    from antiphon.server.rest import biblocks_metrics_lines

    pool = Pool(5, 4)  # blocks [1..3] and [4]
    assert pool.grow("be", False, 2) == [3, 2]
    assert pool.grow("rt", True, 1) == [1]
    text = "\n".join(biblocks_metrics_lines({**pool.layout.occupancy(),
                                             **vars(pool.layout.counters)}))
    assert 'antiphon_biblocks_pages{request_class="be"} 2' in text
    assert 'antiphon_biblocks_blocks{kind="shared"} 1' in text
    assert 'antiphon_biblocks_placements_total{kind="strays"} 0' in text
    assert biblocks_metrics_lines(None) == []


def test_a_page_the_pool_holds_is_not_counted_as_a_second_placement() -> None:
    pool = Pool(9, 4)  # blocks [1..3], [4..7], [8]
    pool.free.discard(4)  # held by the pool, unknown to the layout: set aside
    assert pool.grow("rt", True, 2) == [1, 2]
    counters = pool.layout.counters
    assert counters.foreign == 1
    assert (counters.pages_placed, counters.new_blocks, counters.overflows) == (2, 1, 0)


def test_a_page_found_in_the_prefix_cache_is_not_placed() -> None:
    pool = Pool(9, 4)
    pool.layout.take("rt", True, 5, from_cache=True)
    assert pool.layout.counters.pages_placed == 0
