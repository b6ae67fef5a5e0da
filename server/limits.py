"""Limits per API key: one key cannot take the connections or the engine from the others.

With API keys, each key is a tenant: `--max-connections` and the engine are shared, and one
client holding every websocket or sending hundreds of completions at once would shut the
others out. Without keys there is one owner, and only the server-wide limits apply.
"""

from __future__ import annotations

import collections

from antiphon.server.errors import ApiError, ErrorCode


class Slot:
    """One use counted against a key; `release` is safe to call more than once."""

    def __init__(self, limit: PerKeyLimit, owner: str) -> None:
        self._limit: PerKeyLimit | None = limit
        self._owner = owner

    def release(self) -> None:
        if self._limit is not None:
            self._limit.give_back(self._owner)
            self._limit = None


class PerKeyLimit:
    """At most `limit` uses at once per owner (when `applies`)."""

    def __init__(self, limit: int, what: str, option: str, *, applies: bool) -> None:
        self.limit = limit
        self.what = what  # "open websocket connections", for the error
        self.option = option
        self.applies = applies
        self._in_use: collections.Counter[str] = collections.Counter()

    def take(self, owner: str) -> Slot:
        """A slot for `owner`; raises `too_many_requests` when it holds `limit` already."""
        if self.applies and self._in_use[owner] >= self.limit:
            raise ApiError(ErrorCode.TOO_MANY_REQUESTS, f"this API key has {self.limit} "
                           f"{self.what} already (the limit per key, {self.option})")
        self._in_use[owner] += 1
        return Slot(self, owner)

    def give_back(self, owner: str) -> None:
        self._in_use[owner] -= 1
        if self._in_use[owner] <= 0:
            del self._in_use[owner]
