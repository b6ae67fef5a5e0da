"""Limits per API key: one key cannot take the connections or the engine from the others.

With API keys, each key is a tenant: `--max-connections` and the engine are shared, and one
client holding every websocket or sending hundreds of completions at once would shut the
others out. Without keys there is one owner, and only the server-wide limits apply.
"""

from __future__ import annotations

import collections

from antiphon.server.errors import ApiError, ErrorCode, over_limit


class Slot:
    """Uses counted against a key; `release` is safe to call more than once."""

    def __init__(self, limit: PerKeyLimit, owner: str, count: int = 1) -> None:
        self._limit: PerKeyLimit | None = limit
        self._owner = owner
        self._count = count

    def release(self) -> None:
        if self._limit is not None:
            self._limit.give_back(self._owner, self._count)
            self._limit = None

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class PerKeyLimit:
    """At most `limit` uses at once per owner (when `applies`)."""

    def __init__(self, limit: int, what: str, option: str, *, applies: bool) -> None:
        self.limit = limit
        self.what = what  # "open websocket connections", for the error
        self.option = option
        self.applies = applies
        self._in_use: collections.Counter[str] = collections.Counter()

    def take(self, owner: str, count: int = 1) -> Slot:
        """`count` uses for `owner` (a completion with several choices takes one for each);
        raises `too_many_requests` when that would hold more than `limit`."""
        if self.applies and count > self.limit:  # would never fit: not worth a retry
            raise over_limit(f"{count} {self.what} in one request; this API key may have "
                             f"{self.limit} at once ({self.option})")
        held = self._in_use[owner]
        if self.applies and held + count > self.limit:
            more = f"; {count} more would pass it" if count > 1 else ""
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, f"this API key has {held} {self.what} "
                           f"(the limit per key is {self.limit}, {self.option}){more}")
        self._in_use[owner] += count
        return Slot(self, owner, count)

    def give_back(self, owner: str, count: int = 1) -> None:
        self._in_use[owner] -= count
        if self._in_use[owner] <= 0:
            del self._in_use[owner]
