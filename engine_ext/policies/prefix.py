"""Prompt prefixes seen through page hashes: prefix-tree order and pages already resident.

vLLM chains its page hashes (hash k covers pages 0..k), so two prompts share their first k pages
exactly when their first k hashes are equal.
"""

from __future__ import annotations

from collections.abc import Iterable

from antiphon.engine_ext.views import RequestView


def dfs_order(views: Iterable[RequestView]) -> list[RequestView]:
    """`views` in depth-first order of the prefix tree over their page hashes, so requests that
    share a prefix come out next to each other, longest shared prefix closest.

    With chained hashes the lexicographic order of the hash tuples *is* a depth-first walk of
    that tree (a node before its children, children in hash order), so the tree is walked by
    sorting, in C; requests with equal hashes keep their input order.
    """
    return sorted(views, key=lambda v: tuple(v.prefix_page_hashes))


class ResidentPrefixes:
    """Page hashes whose KV the running requests hold now: a waiting request starting with them
    reuses those pages through vLLM's prefix cache instead of computing them."""

    def __init__(self, views: Iterable[RequestView], page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self._hashes: set[bytes] = set()
        for view in views:
            if view.is_running:
                self._hashes.update(
                    view.prefix_page_hashes[:view.num_computed_tokens // page_tokens])

    def num_cached_tokens(self, view: RequestView) -> int:
        """Tokens of waiting `view` found resident (whole pages, and never its last token,
        which vLLM always computes); 0 for running requests."""
        hashes = view.prefix_page_hashes
        if view.is_running or not self._hashes or not hashes or hashes[0] not in self._hashes:
            return 0
        # Page k resident implies pages before it are (chained hashes): bisect the longest run.
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self._hashes:
                lo = mid
            else:
                hi = mid - 1
        num_tokens = view.num_prompt_tokens + view.num_output_tokens
        max_pages = max(0, num_tokens - 1) // self.page_tokens
        return min(lo, max_pages) * self.page_tokens
