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
are found by their exact tokens alone (token ids are never written to disk; a deleted session's
are found by their owner, `TierPlanner.forget`).
"""

from __future__ import annotations

import array
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from antiphon.tiering.keys import ChunkKey

# Tails kept per chain they continue, the most recently saved or used: a match compares the
# prompt with each (a few µs apiece), under the planner's lock. A session's own tail follows
# its own chunks; only conversations shorter than a chunk share a chain (the salted seed, or a
# long common system prompt), and there the most recent tails are the ones likely asked for.
TAILS_PER_CHAIN = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclasses.dataclass
class _Tail:
    previous: bytes
    tokens: array.array[int]
    session: str | None
    is_full: bool  # a full chunk in the place of the partial ones it covers


class TailIndex:
    """Partial chunks by the chain they continue (`previous`: the hash of the full chunks
    before them, or the salted seed), with their tokens and the session whose request saved
    them: at most `capacity` (one is at most `chunk_tokens` token ids, 4 bytes each) and
    `TAILS_PER_CHAIN` per chain, the least recently saved or used leaving first. A full chunk
    that took the place of the partial ones it covers (`retirement.py`) is one too: its first
    tokens serve the same prompts."""

    def __init__(self, capacity: int, per_chain: int = TAILS_PER_CHAIN) -> None:
        if capacity < 0 or per_chain < 1:
            raise ValueError(f"capacity must be >= 0 and per_chain >= 1, got {capacity}, "
                             f"{per_chain}")
        self.capacity = capacity
        self.per_chain = per_chain
        self._entries: OrderedDict[ChunkKey, _Tail] = OrderedDict()
        self._after: dict[bytes, OrderedDict[ChunkKey, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def add(self, previous: bytes, key: ChunkKey, tokens: Sequence[int],
            session: str | None = None, *, is_full: bool = False) -> None:
        """`key` (layer 0) is the partial chunk of `tokens` after `previous` (`is_full`: the
        full chunk that covers the partial ones there were)."""
        if self.capacity == 0 or not tokens:
            return
        if key in self._entries:
            self.touch(key)
            return
        self._entries[key] = _Tail(previous, array.array("I", tokens), session, is_full)
        chain = self._after.setdefault(previous, OrderedDict())
        chain[key] = None
        if len(chain) > self.per_chain:
            self.discard(next(iter(chain)))
        if len(self._entries) > self.capacity:
            self.discard(next(iter(self._entries)))

    def touch(self, key: ChunkKey) -> None:
        """`key` was used: the last to leave."""
        tail = self._entries.get(key)
        if tail is not None:
            self._entries.move_to_end(key)
            self._after[tail.previous].move_to_end(key)

    def discard(self, key: ChunkKey) -> None:
        tail = self._entries.pop(key, None)
        if tail is None:
            return
        chain = self._after[tail.previous]
        del chain[key]
        if not chain:
            del self._after[tail.previous]

    def discard_hashes(self, prefix_hashes: set[bytes]) -> None:
        """Drop the entries of chunks stored under any of `prefix_hashes` (erased)."""
        for key in [key for key in self._entries if key.prefix_hash in prefix_hashes]:
            self.discard(key)

    def candidates(self, previous: bytes, tokens: Sequence[int]) -> list[tuple[int, ChunkKey]]:
        """(tokens shared with `tokens`, key) of every partial chunk after `previous` that
        shares at least one, longest first (the most recent first among equals)."""
        found = []
        for key in reversed(self._after.get(previous, {})):
            shared = common_prefix(self._entries[key].tokens, tokens)
            if shared:
                found.append((shared, key))
        found.sort(key=lambda item: -item[0])
        return found

    def extending(self, previous: bytes, tokens: Sequence[int]) -> list[ChunkKey]:
        """The partial chunks after `previous` whose tokens begin with all of `tokens`: KV
        computed past where a session's known tokens end (not a full chunk: one that covers
        them is another conversation's, which began with these tokens)."""
        return [key for key in self._after.get(previous, ())
                if not self._entries[key].is_full
                and common_prefix(self._entries[key].tokens, tokens) == len(tokens)]

    def covered_by(self, previous: bytes, tokens: Sequence[int]) -> list[ChunkKey]:
        """The chunks after `previous` whose tokens are all a prefix of `tokens`: KV that a
        chunk of `tokens` after `previous` holds too."""
        found = []
        for key in self._after.get(previous, ()):
            own = self._entries[key].tokens
            if len(own) <= len(tokens) and common_prefix(own, tokens) == len(own):
                found.append(key)
        return found

    def after(self, prefix_hashes: set[bytes]) -> list[ChunkKey]:
        """The partial chunks that continue any of the chains `prefix_hashes` (full chunks)."""
        return [key for previous, chain in self._after.items() if previous in prefix_hashes
                for key in chain]

    def of_session(self, session: str) -> list[ChunkKey]:
        """The partial chunks requests of `session` saved."""
        return [key for key, tail in self._entries.items() if tail.session == session]
