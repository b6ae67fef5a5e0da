"""The preemption table: checkpointed BE requests and the chunks each restore loads.

`TierPlanner.checkpoint` fills it when a request is preempted, its restore (`plan_load`) or
its end empties it. The tiers keep a checkpoint's chunks until then (an eviction hint), but
a host tier that is full of nothing else may evict one; the tier reports it
(`note_evicted`, from the evicting thread) and the table cuts the checkpoint at that chunk
(`settle_evictions`, under the planner's lock): the request recomputes from there.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Container

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.plan_state import Checkpoint


class PreemptionTable:
    """Checkpoints by request id. Not locked: the planner's lock guards every call but
    `note_evicted`, which only appends to a deque."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._checkpoints: dict[str, Checkpoint] = {}
        # the prefix hashes of every checkpoint's chunks, replaced whole on each change (a
        # tier's evicting thread reads it)
        self._chunk_hashes: frozenset[bytes] = frozenset()
        self._evicted: collections.deque[ChunkKey] = collections.deque()

    def __len__(self) -> int:
        return len(self._checkpoints)

    def get(self, request_id: str) -> Checkpoint | None:
        return self._checkpoints.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._checkpoints)

    def record(self, request_id: str, checkpoint: Checkpoint) -> None:
        self._checkpoints[request_id] = checkpoint
        self._index_chunks()

    def drop(self, request_id: str) -> bool:
        """Take the request out of the table; False if it was not in it."""
        if self._checkpoints.pop(request_id, None) is None:
            return False
        self._index_chunks()
        return True

    def _index_chunks(self) -> None:
        self._chunk_hashes = frozenset(key.prefix_hash for cp in self._checkpoints.values()
                                       for key in cp.chunks)

    @property
    def chunk_hashes(self) -> frozenset[bytes]:
        """The prefix hashes of the chunks some checkpointed request will restore."""
        return self._chunk_hashes

    def note_evicted(self, keys: list[ChunkKey]) -> None:
        """A tier evicted `keys` (its lock held: only noted here)."""
        self._evicted.extend(key for key in keys if key.prefix_hash in self._chunk_hashes)

    def settle_evictions(self, is_held: Callable[[ChunkKey], bool]) -> int:
        """Cut each checkpoint at its first chunk a full tier evicted from every tier (no
        longer `is_held`): the request recomputes from there when it runs again, and the table
        says what the tiers hold. Returns the tokens cut."""
        cut_tokens = 0
        while self._evicted:
            key = self._evicted.popleft()
            if is_held(key.with_layer(0)):
                continue
            for request_id, cp in self._checkpoints.items():
                cut = next((i for i, k in enumerate(cp.chunks)
                            if k.prefix_hash == key.prefix_hash), None)
                if cut is None:
                    continue
                held = min(cp.held_tokens, cp.chunks[cut].chunk_index * self.chunk_tokens)
                cut_tokens += cp.held_tokens - held
                self._checkpoints[request_id] = Checkpoint(
                    cp.num_tokens, held, cp.chunks[:cut],
                    tuple(k for k in cp.copying if k.chunk_index < cp.chunks[cut].chunk_index))
        if cut_tokens:
            self._index_chunks()  # what was cut off is no checkpoint's: an erasure takes it
        return cut_tokens

    def problems(self, tracked: Container[str], is_held: Callable[[ChunkKey], bool]
                 ) -> list[str]:
        """Every checkpoint is of a `tracked` request, holds no more than it computed, and
        every chunk its restore loads `is_held` by a tier. Returns what is wrong."""
        problems = []
        for request_id, cp in self._checkpoints.items():
            if request_id not in tracked:
                problems.append(f"checkpoint of unknown request {request_id}")
            if cp.held_tokens > cp.num_tokens:
                problems.append(f"{request_id}: holds {cp.held_tokens} of {cp.num_tokens}")
            problems += [f"{request_id}: chunk {key.chunk_index} of its checkpoint is in "
                         f"no tier" for key in cp.chunks if not is_held(key)]
        return problems
