"""The tokens of the partial chunks this engine saved, so a turn can use a prefix of one.

A partial chunk (the last chunk of a finished or checkpointed request) is stored under the
hash of its exact tokens (`keys.tail_hashes`), and a follow-up turn finds it by probing the
lengths its own prompt allows. That misses a chunk that runs past where the follow-up's prompt
leaves it: a reply a stop string ended (vLLM's front end finds the stop string and aborts the
request, by when the engine has computed a token or more past it, and the next prompt renders
the reply without it) or one its user cancelled (the engine ran ahead of what was shown).
Position i's KV depends on tokens 0..i alone, so the first n pages of such a chunk hold the KV
of any prompt that shares its first n tokens; this index finds the chunk with the longest
common prefix. It lives in memory, for one engine's life: after a restart the stored chunks
are found by their exact tokens alone.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence

from antiphon.tiering.keys import ChunkKey


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TailIndex:
    """Partial chunks by the chain they continue (`previous`: the hash of the full chunks
    before them, or the salted seed), with their tokens; the `capacity` most recently saved,
    at most (one entry is at most `chunk_tokens - 1` token ids, 4 bytes each)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[ChunkKey, tuple[bytes, array.array[int]]] = OrderedDict()
        self._after: dict[bytes, set[ChunkKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, previous: bytes, key: ChunkKey, tokens: Sequence[int]) -> None:
        """`key` (layer 0) is the partial chunk of `tokens` after `previous`."""
        if self.capacity == 0 or not tokens:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = (previous, array.array("I", tokens))
        self._after.setdefault(previous, set()).add(key)
        while len(self._entries) > self.capacity:
            self.discard(next(iter(self._entries)))

    def discard(self, key: ChunkKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        siblings = self._after[entry[0]]
        siblings.discard(key)
        if not siblings:
            del self._after[entry[0]]

    def candidates(self, previous: bytes, tokens: Sequence[int]) -> list[tuple[int, ChunkKey]]:
        """(tokens shared with `tokens`, key) of every partial chunk after `previous` that
        shares at least one, longest first."""
        found = []
        for key in self._after.get(previous, ()):
            shared = common_prefix(self._entries[key][1], tokens)
            if shared:
                found.append((shared, key))
        found.sort(key=lambda item: -item[0])
        return found

    def extending(self, previous: bytes, tokens: Sequence[int]) -> list[ChunkKey]:
        """The partial chunks after `previous` whose tokens begin with all of `tokens`: KV
        computed past where a session's known tokens end (erased with the session)."""
        return [key for key in self._after.get(previous, ())
                if common_prefix(self._entries[key][1], tokens) == len(tokens)]

    def discard_hashes(self, prefix_hashes: set[bytes]) -> None:
        """Drop the entries of chunks stored under any of `prefix_hashes` (erased)."""
        for key in [key for key in self._entries if key.prefix_hash in prefix_hashes]:
            self.discard(key)
