"""The connector's worker-side copier moves KV pages between vLLM's per-layer tensors and
host slots byte for byte: pages saved from some blocks and loaded into others (the next turn's,
after the originals were overwritten) come back bit-identical, in bfloat16 as in float32, for
every layer, whole chunks and chunks split across steps alike."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from antiphon.tiering.connector_meta import NO_SLOT, PageCopy, TieringMetadata
from antiphon.tiering.connector_worker import KvPageCopier
from antiphon.tiering.host_arena import HostArena

LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
NUM_BLOCKS, PAGES_PER_CHUNK = 12, 2
PAGE_SHAPE = (2, 16, 3, 8)  # K and V, tokens, heads, head size: one page of one layer


@pytest.fixture
def arena() -> Iterator[HostArena]:
    page_bytes = torch.zeros(PAGE_SHAPE, dtype=torch.float32).numel() * 4
    with HostArena.create(f"antiphon-test-{uuid.uuid4().hex[:8]}", num_slots=16,
                          slot_bytes=PAGES_PER_CHUNK * page_bytes) as created:
        yield created


def kv_tensors(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn((NUM_BLOCKS, *PAGE_SHAPE), generator=gen).to(dtype)
            for name in LAYERS}


def step(arena: HostArena, number: int, **copies: list[PageCopy]) -> TieringMetadata:
    return TieringMetadata(step=number, arena_name=arena.name, **copies)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_pages_load_back_bit_identical_into_other_blocks(
        arena: HostArena, dtype: torch.dtype) -> None:
    # bfloat16 pages are half the bytes: a slot sized for 2 float32 pages holds 4
    pages_per_slot = 2 * PAGES_PER_CHUNK if dtype is torch.bfloat16 else PAGES_PER_CHUNK
    kv = kv_tensors(dtype, seed=1)
    original = {name: t.clone() for name, t in kv.items()}
    copier = KvPageCopier(LAYERS)
    copier.register(kv)
    blocks = tuple(range(1, 1 + pages_per_slot))
    # a slot per layer for the chunk; the chunk's pages saved by layer, as attention writes them
    save = PageCopy(blocks, slots=(3, 7, 11))
    meta = step(arena, 1, saves=[save])
    for name in LAYERS:
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    # the blocks are reused and overwritten before the next turn loads the chunk elsewhere
    for t in kv.values():
        t[list(blocks)] = 0
    targets = tuple(range(NUM_BLOCKS - pages_per_slot, NUM_BLOCKS))
    meta = step(arena, 2, loads=[PageCopy(targets, slots=(3, 7, 11))])
    for name in LAYERS:
        copier.load_layer(meta, name)
    for name in LAYERS:
        assert torch.equal(kv[name][list(targets)].view(torch.uint8),
                           original[name][list(blocks)].view(torch.uint8))
    assert copier.take_worker_meta() is not None


def test_partial_pages_and_checkpoints_round_trip(arena: HostArena) -> None:
    """A chunk saved a page at a time (first_page), a checkpoint taken before the forward pass,
    and an early load of a partly matched page: each restores exactly the bytes it copied."""
    kv = kv_tensors(torch.float32, seed=2)
    original = {name: t.clone() for name, t in kv.items()}
    copier = KvPageCopier(LAYERS)
    copier.register(kv)
    first = step(arena, 1, saves=[PageCopy((4,), slots=(0, 1, 2), first_page=0)])
    second = step(arena, 2, checkpoints=[PageCopy((5,), slots=(0, 1, 2), first_page=1)])
    for name in LAYERS:
        copier.save_layer(first, name)
    copier.load_early(second)  # saves the checkpoint, then loads nothing
    for t in kv.values():
        t[4:6] = 0
    back = step(arena, 3, early_loads=[PageCopy((8, 9), slots=(0, 1, 2))])
    copier.load_early(back)
    for name in LAYERS:
        assert torch.equal(kv[name][8:10], original[name][4:6])


def test_a_copy_outside_its_slot_fails_the_step(arena: HostArena) -> None:
    """Pages are checked to lie inside their slot (a slot holds PAGES_PER_CHUNK float32 pages):
    a copy reaching past it fails the step instead of writing into the next slot."""
    kv = kv_tensors(torch.float32, seed=3)
    copier = KvPageCopier(LAYERS)
    copier.register(kv)
    bad = step(arena, 1, saves=[PageCopy((1, 2), slots=(0, 1, 2), first_page=1)])
    with pytest.raises(ValueError, match="reaches page 2 of a slot that holds 2"):
        copier.save_layer(bad, LAYERS[0])
    assert arena.read(1) == bytes(arena.slot_bytes)  # nothing written
    meta = copier.take_worker_meta()
    assert meta is not None and meta.failed_steps == {1}


def test_layers_without_a_slot_are_not_copied(arena: HostArena) -> None:
    """A chunk whose middle layer a tier already holds is saved with NO_SLOT for that layer:
    only the other layers are copied, and no slot (the last one in particular, which a slot
    number of -1 would index) is written for it; a load leaves that layer's block alone."""
    kv = kv_tensors(torch.float32, seed=4)
    original = {name: t.clone() for name, t in kv.items()}
    copier = KvPageCopier(LAYERS)
    copier.register(kv)
    last = arena.num_slots - 1
    sentinel = bytes([7]) * arena.slot_bytes
    arena.write(last, sentinel)
    meta = step(arena, 1, saves=[PageCopy((2, 3), slots=(4, NO_SLOT, 6))])
    for name in LAYERS:
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    assert arena.read(last) == sentinel
    assert arena.read(5) == bytes(arena.slot_bytes)  # no layer's pages went anywhere else
    for t in kv.values():
        t[8:10] = 0
    load = step(arena, 2, loads=[PageCopy((8, 9), slots=(4, NO_SLOT, 6))])
    for name in LAYERS:
        copier.load_layer(load, name)
    assert torch.equal(kv[LAYERS[0]][8:10], original[LAYERS[0]][2:4])
    assert torch.equal(kv[LAYERS[2]][8:10], original[LAYERS[2]][2:4])
    assert not kv[LAYERS[1]][8:10].any()
    assert copier.take_worker_meta().failed_steps == set()  # type: ignore[union-attr]
