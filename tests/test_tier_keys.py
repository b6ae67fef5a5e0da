"""Chunk keys and chained prefix hashes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from antiphon.tiering.keys import ChunkKey, chunk_keys, prefix_hashes, prefix_seed

MODEL = "smollm2-135m"


def test_full_chunks_only() -> None:
    assert len(prefix_hashes(list(range(10)), 4, MODEL)) == 2  # 8 tokens hashed, 2 left over
    assert prefix_hashes(list(range(3)), 4, MODEL) == []
    assert all(len(h) == 32 for h in prefix_hashes(list(range(8)), 4, MODEL))


def test_shared_prefixes_share_hashes_and_diverge_after() -> None:
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, MODEL)
    b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4, MODEL)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_hash_is_chained_over_the_whole_prefix() -> None:
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, MODEL)
    b = prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, MODEL)  # same chunk 1, other chunk 0
    assert a[0] != b[0] and a[1] != b[1]


def test_models_and_salts_never_collide() -> None:
    tokens = list(range(64))
    base = set(prefix_hashes(tokens, 8, MODEL))
    assert base.isdisjoint(prefix_hashes(tokens, 8, MODEL + "-other"))
    assert base.isdisjoint(prefix_hashes(tokens, 8, MODEL, salt=b"tenant-a"))
    assert prefix_seed("ab", b"c") != prefix_seed("a", b"bc")  # the model id is length-prefixed


def test_chunk_size_changes_hashes() -> None:
    assert prefix_hashes(list(range(8)), 8, MODEL)[0] != prefix_hashes(list(range(8)), 4, MODEL)[1]


def test_key_validation_and_helpers() -> None:
    with pytest.raises(ValueError):
        ChunkKey(MODEL, b"", 0, 0)
    with pytest.raises(ValueError):
        ChunkKey(MODEL, b"x", -1, 0)
    with pytest.raises(ValueError):
        ChunkKey("", b"x", 0, 0)
    with pytest.raises(ValueError):
        prefix_hashes([1], 0, MODEL)
    key = ChunkKey(MODEL, b"x", 2, 0)
    assert key.with_layer(5) == ChunkKey(MODEL, b"x", 2, 5)
    grid = chunk_keys(MODEL, [b"a", b"b"], num_layers=3, first_chunk=4)
    assert [[(k.chunk_index, k.layer) for k in row] for row in grid] == [
        [(4, 0), (4, 1), (4, 2)], [(5, 0), (5, 1), (5, 2)]]


def test_a_key_hashes_alike_after_crossing_to_another_process() -> None:
    """Keys cache their hash; one pickled across processes (another string hash seed) must
    find the same entries as a key built there."""
    k = ChunkKey(MODEL, b"p" * 32, 3, 7)
    same = ChunkKey(MODEL, b"p" * 32, 3, 7)
    assert k == same and hash(k) == hash(same) and len({k, same}) == 1
    assert k != ChunkKey(MODEL, b"p" * 32, 3, 8) and k != ChunkKey("other", b"p" * 32, 3, 7)
    assert k != (MODEL, b"p" * 32, 3, 7)
    check = ("import pickle, sys; from antiphon.tiering.keys import ChunkKey; "
             "k = pickle.loads(sys.stdin.buffer.read()); "
             f"fresh = ChunkKey({MODEL!r}, b'p' * 32, 3, 7); "
             "assert hash(k) == hash(fresh) and k in {fresh: 1}, 'stale hash'")
    for seed in ("1", "2"):
        subprocess.run([sys.executable, "-c", check], input=pickle.dumps(k), check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
