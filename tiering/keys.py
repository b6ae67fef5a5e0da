"""Chunk keys: what one stored piece of KV is called, derived from hashes only.

KV is stored per *chunk-layer*: the KV of `chunk_tokens` consecutive tokens (a whole number of
KV pages) for one attention layer. A chunk is named by the hash of the whole token prefix up to
its end, chained so that two sessions that share a prefix share its chunks:

    tokens   |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|<- partial (not stored) ->|
    hashes        h0             h1             h2
    h_-1 = sha256("antiphon-kv-v1" || len(model_id) || model_id || salt)
    h_i  = sha256(h_{i-1} || int64-le tokens of chunk i)

Keys never hold user text: the token ids enter only through the hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterable, Sequence

_SEED_DOMAIN = b"antiphon-kv-v1\0"
PREFIX_HASH_BYTES = 32  # sha256


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ChunkKey:
    """One chunk-layer of KV: the unit every tier stores, evicts and prefetches.

    Every tier, index and eviction heap keys a dict or set by it, a few times per chunk-layer
    per turn (8,192 chunk-layers for a 32k-token context of 32 layers), so its hash is computed
    once and equality tests the hash first.
    """

    model_id: str  # the served model (and anything else that changes KV bytes, e.g. kv dtype)
    prefix_hash: bytes  # chained hash of all tokens up to the end of this chunk
    chunk_index: int  # position of the chunk in its sequence (0 = first `chunk_tokens` tokens)
    layer: int  # attention layer index, 0 = first
    _hash: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_hash, bytes) or not self.prefix_hash:
            raise ValueError("prefix_hash must be non-empty bytes")
        if self.chunk_index < 0 or self.layer < 0:
            raise ValueError(f"chunk_index and layer must be >= 0, got "
                             f"{self.chunk_index}, {self.layer}")
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        object.__setattr__(self, "_hash", hash(
            (self.model_id, self.prefix_hash, self.chunk_index, self.layer)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not ChunkKey:
            return NotImplemented
        assert isinstance(other, ChunkKey)
        return (self._hash == other._hash and self.prefix_hash == other.prefix_hash
                and self.layer == other.layer and self.chunk_index == other.chunk_index
                and self.model_id == other.model_id)

    def __reduce__(self) -> tuple[type[ChunkKey], tuple[str, bytes, int, int]]:
        """Pickled without its hash: another process hashes strings differently."""
        return (ChunkKey, (self.model_id, self.prefix_hash, self.chunk_index, self.layer))

    def with_layer(self, layer: int) -> ChunkKey:
        """The same chunk at another layer."""
        # Not `dataclasses.replace`: this runs per chunk-layer matched, and it costs half.
        return ChunkKey(self.model_id, self.prefix_hash, self.chunk_index, layer)


def salt_bytes(cache_salt: str | None) -> bytes:
    """vLLM's `cache_salt` of a request (a tenant's) as the bytes its keys are salted with."""
    return cache_salt.encode() if cache_salt else b""


def prefix_seed(model_id: str, salt: bytes = b"") -> bytes:
    """The hash chain's starting value for `model_id`: different models never share a key."""
    model = model_id.encode()
    return hashlib.sha256(_SEED_DOMAIN + struct.pack("<I", len(model)) + model + salt).digest()


def prefix_hashes(token_ids: Sequence[int], chunk_tokens: int, model_id: str, *,
                  salt: bytes = b"") -> list[bytes]:
    """The chained prefix hash of every *full* chunk of `token_ids` (a partial tail gets none).

    `chunk_tokens` is the chunk size in tokens; `salt` separates tenants that must not share KV
    (vLLM's `cache_salt`), and anything else that changes KV bytes belongs in `model_id`.
    """
    return continue_prefix_hashes(prefix_seed(model_id, salt), token_ids, chunk_tokens)


def continue_prefix_hashes(previous: bytes, token_ids: Sequence[int],
                           chunk_tokens: int) -> list[bytes]:
    """`prefix_hashes` of the full chunks of `token_ids`, continuing the chain at `previous`
    (the hash of the chunk just before them, or `prefix_seed`): how a request growing by a
    few tokens per step extends its hashes without rehashing its whole prefix."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        chunk = token_ids[start:start + chunk_tokens]
        previous = hashlib.sha256(previous + struct.pack(f"<{chunk_tokens}q", *chunk)).digest()
        hashes.append(previous)
    return hashes


def chunk_keys(model_id: str, hashes: Sequence[bytes], num_layers: int,
               first_chunk: int = 0) -> list[list[ChunkKey]]:
    """Keys by chunk, then layer: `result[c][l]` is chunk `first_chunk + c` at layer `l`.

    This is the shape `TieredStore.lookup_prefix` takes.
    """
    return [[ChunkKey(model_id, h, first_chunk + c, layer) for layer in range(num_layers)]
            for c, h in enumerate(hashes)]


_TAIL_DOMAIN = b"antiphon-kv-tail\0"


def tail_hashes(previous: bytes, tail_token_ids: Sequence[int]) -> list[bytes]:
    """The hash of every partial chunk that continues the chain at `previous`: `result[n - 1]`
    names the first `n` tokens of `tail_token_ids`.

    A session's last chunk is usually partial (the turn ended mid-chunk). It is stored under
    `sha256(previous || "tail" || tokens)`, apart from full chunks, so a follow-up turn finds it
    by probing the lengths its own prompt allows; no directory of stored lengths is needed.
    """
    digest = hashlib.sha256(previous + _TAIL_DOMAIN)
    hashes: list[bytes] = []
    for token in tail_token_ids:
        digest.update(struct.pack("<q", token))
        hashes.append(digest.copy().digest())
    return hashes


def chain_hashes(chains: Iterable[Sequence[int]], chunk_tokens: int, model_id: str, *,
                 salt: bytes = b"") -> set[bytes]:
    """Every prefix hash the KV of `chains` (token sequences a session ran) can be stored
    under: each full chunk, and each partial chunk that a turn ending at any point of a chain
    would have saved (every length from 1 to `chunk_tokens - 1` after every full chunk)."""
    found: set[bytes] = set()
    seed = prefix_seed(model_id, salt)
    for tokens in chains:
        hashes = prefix_hashes(tokens, chunk_tokens, model_id, salt=salt)
        found.update(hashes)
        for index in range(len(hashes) + 1):
            start = index * chunk_tokens
            rest = tokens[start:min(len(tokens), start + chunk_tokens - 1)]
            found.update(tail_hashes(hashes[index - 1] if index else seed, rest))
    return found


_OWNER_DOMAIN = b"antiphon-kv-owner\0"
OWNER_TAG_BYTES = 16


def owner_tag(session: str | None) -> bytes:
    """The tag a tier keeps with the KV a request of `session` saved (empty for none): a hash,
    so a tier never holds the session's id, and fixed in length."""
    if not session:
        return b""
    return hashlib.sha256(_OWNER_DOMAIN + session.encode()).digest()[:OWNER_TAG_BYTES]
