"""Matching a token sequence against the tiers: the longest prefix whose KV is stored.

KV is stored per chunk of `chunk_tokens` tokens and per layer, under keys that hash the whole
token prefix up to the chunk's end (`keys.prefix_hashes`): a full chunk matches only if every
earlier one does. After the full chunks, a partial chunk a turn ended with (its reply cut by
the token limit, a stop string or a cancel) matches by its exact tokens:

    tokens   |  chunk 0  |  chunk 1  | partial |
    keys      h0 (x layers) h1 (x layers)  t(h1, tokens after chunk 1)

The tail index (`TailIndex`) remembers the tokens of the partial chunks saved in this run, so
one that runs on past the prompt still matches the part the prompt shares.
"""

from __future__ import annotations

from collections.abc import Sequence

from antiphon.tiering.keys import (
    ChunkKey,
    continue_prefix_hashes,
    prefix_hashes,
    prefix_seed,
    tail_hashes,
)
from antiphon.tiering.manager import TieredStore
from antiphon.tiering.plan_state import RequestState, StoredMatch
from antiphon.tiering.tails import TailIndex


class PrefixMatcher:
    """Lookups of stored prefixes (the planner's lock held: the tail index is not locked)."""

    def __init__(self, store: TieredStore, tails: TailIndex, *, model_id: str,
                 chunk_tokens: int, num_layers: int) -> None:
        self.store = store
        self.tails = tails
        self.model_id = model_id
        self.chunk_tokens = chunk_tokens
        self.num_layers = num_layers

    def match(self, token_ids: Sequence[int], limit: int, salt: bytes,
               st: RequestState | None, *, session: str | None = None) -> StoredMatch:
        """The longest stored prefix of `token_ids[:limit]`: full chunks with every layer in
        some tier, then the longest stored partial chunk after them. A partial chunk found by
        its exact tokens joins the tail index (one saved before a restart: an advisory's
        context finds the reply a stop string ended, its turn the part it shares)."""
        hashes = (self.hashes(st, limit // self.chunk_tokens) if st is not None else
                  prefix_hashes(token_ids[:limit], self.chunk_tokens, self.model_id, salt=salt))
        chunks: list[ChunkKey] = []
        layers: list[list[ChunkKey]] = []
        for index, prefix_hash in enumerate(hashes[:limit // self.chunk_tokens]):
            key = ChunkKey(self.model_id, prefix_hash, index, 0)
            keys = self.stored(key)
            if keys is None:
                break
            chunks.append(key)
            layers.append(keys)
        start = len(chunks) * self.chunk_tokens
        rest = token_ids[start:min(limit, start + self.chunk_tokens - 1)]
        previous = chunks[-1].prefix_hash if chunks else prefix_seed(self.model_id, salt)
        # A partial chunk saved in this run that shares a prefix with `rest`, if any (it may
        # run past `rest`: a reply ended by a stop string, or cancelled), then one saved with
        # exactly the first `length` tokens of `rest` for a longer length (one from before a
        # restart, or evicted from the index).
        shared, tail, tail_layers = 0, None, None
        for length, key in self.tails.candidates(previous, rest):
            keys = self.stored(key)
            if keys is not None:
                shared, tail, tail_layers = length, key, keys
                break
        for length, tail_hash in reversed(list(enumerate(tail_hashes(previous, rest), 1))):
            if length <= shared:
                break
            key = ChunkKey(self.model_id, tail_hash, len(chunks), 0)
            keys = self.stored(key)
            if keys is not None:
                shared, tail, tail_layers = length, key, keys
                self.tails.add(previous, key, rest[:length],
                                st.view.session if st is not None else session)
                break
        if tail is not None and tail_layers is not None:
            self.tails.touch(tail)
            return StoredMatch([*chunks, tail], start + shared, [*layers, tail_layers])
        return StoredMatch(chunks, start, layers)

    def stored(self, key: ChunkKey) -> list[ChunkKey] | None:
        """`key`'s chunk at every layer, if some tier holds each (layer 0 first: a partial
        chunk is probed at up to 127 lengths, most of them stored nowhere)."""
        if not self.store.contains(key):
            return None
        keys = [key, *(key.with_layer(layer) for layer in range(1, self.num_layers))]
        return keys if all(self.store.contains(k) for k in keys[1:]) else None

    def hashes(self, st: RequestState, num_chunks: int) -> list[bytes]:
        """The request's first `num_chunks` full-chunk hashes, extending the cached chain."""
        have = len(st.hashes)
        if num_chunks > have:
            previous = st.hashes[-1] if st.hashes else prefix_seed(self.model_id, st.view.salt)
            tokens = st.view.token_ids[have * self.chunk_tokens:num_chunks * self.chunk_tokens]
            st.hashes.extend(continue_prefix_hashes(previous, tokens, self.chunk_tokens))
        return st.hashes[:num_chunks]

    def tail_chain(self, st: RequestState, num_tokens: int) -> tuple[bytes, Sequence[int]]:
        """(the hash of the chain it continues, its tokens) of the partial chunk that ends at
        `num_tokens` (not a chunk boundary)."""
        full = num_tokens // self.chunk_tokens
        hashes = self.hashes(st, full)
        previous = hashes[-1] if hashes else prefix_seed(self.model_id, st.view.salt)
        return previous, st.view.token_ids[full * self.chunk_tokens:num_tokens]

    def tail_key(self, st: RequestState, num_tokens: int) -> ChunkKey:
        """The key of the partial chunk that ends at `num_tokens` (not a chunk boundary)."""
        previous, tokens = self.tail_chain(st, num_tokens)
        return ChunkKey(self.model_id, tail_hashes(previous, tokens)[-1],
                        num_tokens // self.chunk_tokens, 0)

    def index_tail(self, st: RequestState, num_tokens: int, key: ChunkKey) -> None:
        """`key` (`tail_key(st, num_tokens)`) is stored or on its way: keep its tokens."""
        previous, tokens = self.tail_chain(st, num_tokens)
        self.tails.add(previous, key, tokens, st.view.session)
