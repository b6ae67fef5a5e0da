"""The index of saved partial chunks' tokens: which share a prefix with a prompt, which run on
past a session's end, and its bound."""

from __future__ import annotations

import pytest

from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.tails import TailIndex, common_prefix


def key(name: bytes) -> ChunkKey:
    return ChunkKey("m", name, 1, 0)


def test_candidates_are_the_tails_after_the_chain_longest_shared_prefix_first() -> None:
    index = TailIndex(8)
    index.add(b"p", key(b"a"), [1, 2, 3])
    index.add(b"p", key(b"b"), [1, 2, 9, 9])
    index.add(b"p", key(b"c"), [5])
    index.add(b"q", key(b"d"), [1, 2, 3, 4])  # another chain: never a candidate
    assert index.candidates(b"p", [1, 2, 3, 4]) == [(3, key(b"a")), (2, key(b"b"))]
    assert index.candidates(b"p", [7]) == []
    assert set(index.extending(b"p", [1, 2])) == {key(b"a"), key(b"b")}
    assert index.extending(b"p", [1, 2, 3, 4]) == []  # shorter tails are the chain's own


def test_the_index_keeps_the_most_recently_saved_or_used_up_to_its_bounds() -> None:
    index = TailIndex(3, per_chain=2)
    index.add(b"p", key(b"a"), [1])
    index.add(b"p", key(b"b"), [1, 2])
    index.touch(key(b"a"))  # used: b leaves first
    index.add(b"p", key(b"c"), [1, 2, 3])  # a third after p: over per_chain
    assert [k for _, k in index.candidates(b"p", [1, 2, 3])] == [key(b"c"), key(b"a")]
    index.add(b"q", key(b"d"), [1])
    index.add(b"r", key(b"e"), [1])  # a fourth in all: over capacity, a leaves
    assert len(index) == 3 and index.candidates(b"p", [1]) == [(1, key(b"c"))]
    index.discard_hashes({b"c", b"d"})
    assert len(index) == 1 and index.candidates(b"p", [1]) == []
    off = TailIndex(0)
    off.add(b"p", key(b"a"), [1])
    assert len(off) == 0
    with pytest.raises(ValueError):
        TailIndex(-1)


def test_tails_by_the_chain_they_continue_and_by_session() -> None:
    index = TailIndex(8)
    index.add(b"p", key(b"a"), [1], session="s1")
    index.add(b"q", key(b"b"), [2], session="s2")
    index.add(b"r", key(b"c"), [3])
    assert set(index.after({b"p", b"q", b"x"})) == {key(b"a"), key(b"b")}
    assert index.of_session("s1") == [key(b"a")]
    assert index.extending(b"p", []) == [key(b"a")]  # a chain ending at a chunk boundary


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_the_chunks_a_longer_one_covers() -> None:
    index = TailIndex(8)
    index.add(b"p", key(b"a"), [1, 2])
    index.add(b"p", key(b"b"), [1, 3])
    index.add(b"p", key(b"c"), [1, 2, 5, 6])
    index.add(b"q", key(b"d"), [1])
    assert index.covered_by(b"p", [1, 2, 5, 6]) == [key(b"a"), key(b"c")]  # itself included
    assert index.covered_by(b"p", [1, 2]) == [key(b"a")]
    assert index.covered_by(b"p", [1]) == []
    assert index.covered_by(b"x", [1, 2]) == []
