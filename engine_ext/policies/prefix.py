"""Prompt prefixes seen through page hashes: prefix-tree order and pages already resident.

vLLM chains its page hashes (hash k covers pages 0..k), so two prompts share their first k pages
exactly when their first k hashes are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from antiphon.engine_ext.views import RequestView


def leading_run(num: int, holds: Callable[[int], bool]) -> int:
    """The longest run of pages `0 .. k-1` (k <= `num`) for which `holds(page)`, where what
    holds for a page holds for those before it (chained hashes: a request holding a page
    holds its prefix), found by bisection."""
    lo, hi = 0, num
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def dfs_order(views: Iterable[RequestView]) -> list[RequestView]:
    """`views` in depth-first order of the prefix tree over their page hashes, so requests that
    share a prefix come out next to each other, longest shared prefix closest.

    With chained hashes the lexicographic order of the hash tuples *is* a depth-first walk of
    that tree (a node before its children, children in hash order), so the tree is walked by
    sorting, in C; requests with equal hashes keep their input order.
    """
    return sorted(views, key=_as_list)


def _as_list(view: RequestView) -> list[bytes]:
    """The view's page hashes as a list to sort by: vLLM's own list as it is (comparing lists
    stops at their first difference; a copy per request per step cost more than the sort)."""
    hashes = view.prefix_page_hashes
    return hashes if isinstance(hashes, list) else list(hashes)


class ResidentPrefixes:
    """Page hashes whose KV the running requests hold now: a waiting request starting with them
    reuses those pages through vLLM's prefix cache instead of computing them.

    A policy keeps one across steps and calls `update` each step. A GPU pool holds 10^5
    pages; collecting them all every step cost milliseconds. Instead each step adds the pages
    a running request computed since the last (vLLM appends to a request's hash list in place,
    so the same list seen again is only extended) and drops requests no longer running.
    """

    def __init__(self, views: Iterable[RequestView] = (), page_tokens: int = 1) -> None:
        self.page_tokens = page_tokens
        self._num_holders: dict[bytes, int] = {}  # page hash -> running requests holding it
        self._held: dict[str, tuple[Sequence[bytes], int]] = {}  # request -> (hashes, counted)
        self.update(views, page_tokens)

    def update(self, views: Iterable[RequestView], page_tokens: int) -> ResidentPrefixes:
        """Make the index the running requests among `views` (pages of `page_tokens`)."""
        if page_tokens != self.page_tokens:
            self.page_tokens = page_tokens
            for request_id in list(self._held):
                self._drop(request_id)
        running: set[str] = set()
        for view in views:
            if not view.is_running:
                continue
            running.add(view.request_id)
            hashes = view.prefix_page_hashes
            num_pages = min(len(hashes), view.num_computed_tokens // page_tokens)
            held = self._held.get(view.request_id)
            start = 0
            if held is not None:
                if held[0] is hashes and held[1] <= num_pages:
                    start = held[1]
                else:  # another list, or fewer pages: count it afresh
                    self._drop(view.request_id)
            for page_hash in hashes[start:num_pages]:
                self._num_holders[page_hash] = self._num_holders.get(page_hash, 0) + 1
            self._held[view.request_id] = (hashes, num_pages)
        for request_id in [r for r in self._held if r not in running]:
            self._drop(request_id)
        return self

    def _drop(self, request_id: str) -> None:
        hashes, num_pages = self._held.pop(request_id)
        for page_hash in hashes[:num_pages]:
            left = self._num_holders[page_hash] - 1
            if left:
                self._num_holders[page_hash] = left
            else:
                del self._num_holders[page_hash]

    def num_cached_tokens(self, view: RequestView) -> int:
        """Tokens of waiting `view` found resident (whole pages, and never its last token,
        which vLLM always computes) beyond those its view counts as computed already (the
        scheduler's view counts the device's prefix hit, pages running requests hold among
        them: counted twice, a request sharing a running one's document came out with fewer
        than no tokens to compute, and was never admitted); 0 for running requests."""
        hashes = view.prefix_page_hashes
        if view.is_running or not hashes or hashes[0] not in self._num_holders:
            return 0
        lo = leading_run(len(hashes), lambda page: hashes[page] in self._num_holders)
        num_tokens = view.num_prompt_tokens + view.num_output_tokens
        max_pages = max(0, num_tokens - 1) // self.page_tokens
        return max(0, min(lo, max_pages) * self.page_tokens - view.num_computed_tokens)
