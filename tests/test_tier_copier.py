"""The connector's worker-side copier moves KV pages between vLLM's per-layer tensors and
host slots byte for byte: pages saved from some blocks and loaded into others (the next turn's,
after the originals were overwritten) come back bit-identical, in bfloat16 as in float32, for
every layer, whole chunks and chunks split across steps alike.

Every test runs both movers: page by page (CPU serving) and batched through a staging buffer
(GPU serving; here on CPU tensors, and on CUDA tensors where a GPU is present, which is the
side stream, the page-locked arena and the per-layer events)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from antiphon.tiering.connector_meta import NO_SLOT, PageCopy, TieringMetadata
from antiphon.tiering.connector_worker import KvPageCopier
from antiphon.tiering.host_arena import HostArena

LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MOVERS = [("pagewise", "cpu"), *(("batched", device) for device in DEVICES)]
NUM_BLOCKS, PAGES_PER_CHUNK = 12, 2
PAGE_SHAPE = (2, 16, 3, 8)  # K and V, tokens, heads, head size: one page of one layer


@pytest.fixture
def arena() -> Iterator[HostArena]:
    page_bytes = torch.zeros(PAGE_SHAPE, dtype=torch.float32).numel() * 4
    with HostArena.create(f"antiphon-test-{uuid.uuid4().hex[:8]}", num_slots=16,
                          slot_bytes=PAGES_PER_CHUNK * page_bytes) as created:
        yield created


@pytest.fixture(params=MOVERS, ids=[f"{mode}-{device}" for mode, device in MOVERS])
def mover(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


def kv_tensors(dtype: torch.dtype, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn((NUM_BLOCKS, *PAGE_SHAPE), generator=gen).to(dtype).to(device)
            for name in LAYERS}


_OPEN: list[KvPageCopier] = []


@pytest.fixture(autouse=True)
def _close_copiers() -> Iterator[None]:
    """Close every copier a test made, as the connector closes its own at shutdown: on CUDA
    that unregisters the page-locked arena, whose address a later mapping may reuse."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def new_copier(mode: str = "auto", staging_pages: int = 256) -> KvPageCopier:
    copier = KvPageCopier(LAYERS, copy_mode=mode, staging_pages=staging_pages)
    _OPEN.append(copier)
    return copier


def make_copier(mover: tuple[str, str], dtype: torch.dtype = torch.float32, seed: int = 0,
                staging_pages: int = 256) -> tuple[KvPageCopier, dict[str, torch.Tensor]]:
    mode, device = mover
    kv = kv_tensors(dtype, seed, device)
    copier = new_copier(mode, staging_pages)
    copier.register(kv)
    assert copier.mover == mode
    return copier, kv


def save_step(copier: KvPageCopier, meta: TieringMetadata) -> None:
    """A step that saves: every layer after its attention, then the end of the step."""
    for name in LAYERS:
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    settle(copier)


def load_step(copier: KvPageCopier, meta: TieringMetadata) -> None:
    """A step that loads, with the calls in vLLM's order."""
    copier.checkpoint(meta)
    copier.load_early(meta)
    for name in LAYERS:
        copier.load_layer(meta, name)
    copier.finish_step(meta)
    settle(copier)


def settle(copier: KvPageCopier) -> None:
    """Wait for queued device copies (a no-op on CPU, where every copy is synchronous)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step(arena: HostArena, number: int, **copies: list[PageCopy]) -> TieringMetadata:
    return TieringMetadata(step=number, arena_name=arena.name, **copies)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_pages_load_back_bit_identical_into_other_blocks(
        arena: HostArena, dtype: torch.dtype, mover: tuple[str, str]) -> None:
    # bfloat16 pages are half the bytes: a slot sized for 2 float32 pages holds 4
    pages_per_slot = 2 * PAGES_PER_CHUNK if dtype is torch.bfloat16 else PAGES_PER_CHUNK
    copier, kv = make_copier(mover, dtype, seed=1)
    original = {name: t.clone() for name, t in kv.items()}
    blocks = tuple(range(1, 1 + pages_per_slot))
    # a slot per layer for the chunk; the chunk's pages saved by layer, as attention writes them
    save = PageCopy(blocks, slots=(3, 7, 11))
    meta = step(arena, 1, saves=[save])
    for name in LAYERS:
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    settle(copier)
    # the blocks are reused and overwritten before the next turn loads the chunk elsewhere
    for t in kv.values():
        t[list(blocks)] = 0
    targets = tuple(range(NUM_BLOCKS - pages_per_slot, NUM_BLOCKS))
    meta = step(arena, 2, loads=[PageCopy(targets, slots=(3, 7, 11))])
    copier.load_early(meta)
    for name in LAYERS:
        copier.load_layer(meta, name)
    settle(copier)
    for name in LAYERS:
        assert torch.equal(kv[name][list(targets)].view(torch.uint8),
                           original[name][list(blocks)].view(torch.uint8))
    assert copier.take_worker_meta() is not None


def test_cpu_page_copies_stay_on_the_calling_thread(arena: HostArena,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Between CPU tensors a page copy is one memcpy on the worker's thread, never
    `Tensor.copy_`: PyTorch splits a page of 64 KiB or more over the OpenMP threads of the
    forward pass, and each copy then waits for every one of them (60 pages took up to 137 ms
    beside one busy process on 2 cores, against 0.22 ms on one thread)."""
    copier, kv = make_copier(("pagewise", "cpu"), seed=4)
    original = {name: t.clone() for name, t in kv.items()}

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU page copy went through Tensor.copy_")

    monkeypatch.setattr(torch.Tensor, "copy_", refused)
    save_step(copier, step(arena, 1, saves=[PageCopy((2, 3), slots=(4, 5, 6))],
                          final_saves={"r": [PageCopy((7,), slots=(8, 9, 10))]}))
    for t in kv.values():
        t[[2, 3, 7]] = 0
    load_step(copier, step(arena, 2, loads=[PageCopy((0, 1), slots=(4, 5, 6))],
                           early_loads=[PageCopy((11,), slots=(8, 9, 10))]))
    monkeypatch.undo()
    for name in LAYERS:
        assert torch.equal(kv[name][[0, 1, 11]], original[name][[2, 3, 7]])
    meta = copier.take_worker_meta()
    assert meta is not None and not meta.failed_steps


def test_partial_pages_and_checkpoints_round_trip(arena: HostArena,
                                                  mover: tuple[str, str]) -> None:
    """A chunk saved a page at a time (first_page), a checkpoint taken before the forward pass,
    and an early load of a partly matched page: each restores exactly the bytes it copied."""
    copier, kv = make_copier(mover, seed=2)
    original = {name: t.clone() for name, t in kv.items()}
    first = step(arena, 1, saves=[PageCopy((4,), slots=(0, 1, 2), first_page=0)])
    second = step(arena, 2, checkpoints=[PageCopy((5,), slots=(0, 1, 2), first_page=1)])
    for name in LAYERS:
        copier.save_layer(first, name)
    copier.finish_step(first)
    copier.checkpoint(second)  # handle_preemptions: before the forward pass
    copier.load_early(second)  # loads nothing, and does not take the checkpoint again
    settle(copier)
    for t in kv.values():
        t[4:6] = 0
    back = step(arena, 3, early_loads=[PageCopy((8, 9), slots=(0, 1, 2))])
    copier.checkpoint(back)
    copier.load_early(back)
    settle(copier)
    for name in LAYERS:
        assert torch.equal(kv[name][8:10], original[name][4:6])


def test_a_copy_outside_its_slot_fails_the_step(arena: HostArena, mover: tuple[str, str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Pages are checked to lie inside their slot (a slot holds PAGES_PER_CHUNK float32 pages):
    a copy reaching past it fails the step instead of writing into the next slot. A failed
    load's pages are reported, for vLLM to recompute: the error was raised, and took the
    engine and every request in it down."""
    copier, kv = make_copier(mover, seed=3)
    bad = step(arena, 1, saves=[PageCopy((1, 2), slots=(0, 1, 2), first_page=1)])
    copier.save_layer(bad, LAYERS[0])
    assert "reaches page 2 of a slot that holds 2" in caplog.text
    assert arena.read(1) == bytes(arena.slot_bytes)  # nothing written
    meta = copier.take_worker_meta()
    assert meta is not None and meta.failed_steps == {1}
    assert copier.take_invalid_blocks() == set()  # (a save: the device pages are right)
    before = {name: t.clone() for name, t in kv.items()}
    load = step(arena, 2, loads=[PageCopy((5, 6), slots=(0, 1, 2), first_page=1)],
                early_loads=[PageCopy((9,), slots=(99, 99, 99))])
    load_step(copier, load)
    assert copier.take_invalid_blocks() == {5, 6, 9}
    assert copier.take_invalid_blocks() == set()
    meta = copier.take_worker_meta()
    assert meta is not None and meta.failed_steps == {2}
    for name in LAYERS:
        assert torch.equal(kv[name], before[name])


def test_layers_without_a_slot_are_not_copied(arena: HostArena,
                                              mover: tuple[str, str]) -> None:
    """A chunk whose middle layer a tier already holds is saved with NO_SLOT for that layer:
    only the other layers are copied, and no slot (the last one in particular, which a slot
    number of -1 would index) is written for it; a load leaves that layer's block alone."""
    copier, kv = make_copier(mover, seed=4)
    original = {name: t.clone() for name, t in kv.items()}
    last = arena.num_slots - 1
    sentinel = bytes([7]) * arena.slot_bytes
    arena.write(last, sentinel)
    meta = step(arena, 1, saves=[PageCopy((2, 3), slots=(4, NO_SLOT, 6))])
    for name in LAYERS:
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    settle(copier)
    assert arena.read(last) == sentinel
    assert arena.read(5) == bytes(arena.slot_bytes)  # no layer's pages went anywhere else
    for t in kv.values():
        t[8:10] = 0
    load = step(arena, 2, loads=[PageCopy((8, 9), slots=(4, NO_SLOT, 6))])
    copier.load_early(load)
    for name in LAYERS:
        copier.load_layer(load, name)
    settle(copier)
    assert torch.equal(kv[LAYERS[0]][8:10], original[LAYERS[0]][2:4])
    assert torch.equal(kv[LAYERS[2]][8:10], original[LAYERS[2]][2:4])
    assert not kv[LAYERS[1]][8:10].any()
    assert copier.take_worker_meta().failed_steps == set()  # type: ignore[union-attr]


def test_copies_larger_than_the_staging_buffer_go_through_it_in_turns(
        arena: HostArena, mover: tuple[str, str]) -> None:
    """Two chunks, one split over steps, with a staging buffer of 3 pages (5 pages per layer
    to move): the batches cut runs of slot pages anywhere and still land every byte."""
    copier, kv = make_copier(mover, seed=5, staging_pages=3)
    original = {name: t.clone() for name, t in kv.items()}
    saves = [PageCopy((1, 2), slots=(0, 1, 2)), PageCopy((5, 3), slots=(3, 4, 5)),
             PageCopy((7,), slots=(6, 7, 8), first_page=1)]
    save_step(copier, step(arena, 1, saves=saves))
    for t in kv.values():
        t.zero_()
    loads = [PageCopy((10, 11), slots=(0, 1, 2)), PageCopy((0, 4), slots=(3, 4, 5)),
             PageCopy((9,), slots=(6, 7, 8), first_page=1)]
    load_step(copier, step(arena, 2, loads=loads))
    for name in LAYERS:
        assert torch.equal(kv[name][[10, 11, 0, 4, 9]], original[name][[1, 2, 5, 3, 7]])
    done = copier.take_worker_meta()
    assert done is not None and done.done_steps == {1, 2} and not done.failed_steps


def test_a_checkpoint_after_the_forward_pass_began_fails_its_step(
        arena: HostArena, mover: tuple[str, str]) -> None:
    """A checkpoint copies a preempted request's pages before this step's forward pass writes
    another request's KV over them. Called once a layer of the step has run, it copies
    nothing and fails the step (the scheduler side then drops the checkpoint's keys and the
    request recomputes) instead of storing the new owner's KV under the old one's keys."""
    copier, _ = make_copier(mover, seed=6)
    meta = step(arena, 1, checkpoints=[PageCopy((2, 3), slots=(0, 1, 2))],
                saves=[PageCopy((4, 5), slots=(3, 4, 5))])
    copier.save_layer(meta, LAYERS[0])
    copier.load_early(meta)  # vLLM calls it after the forward when nothing loads stored KV
    # The saves queued before it (on a GPU, still in flight) land before the step is
    # reported: the scheduler frees its slots then, and a late copy would write over the
    # next put's KV. The step's end waits for them.
    waited: list[object] = []
    ended = copier._mover.end_step
    copier._mover.end_step = lambda: ("end of step 1", ended())  # type: ignore[method-assign]
    copier._mover.wait = waited.append  # type: ignore[method-assign,assignment]
    copier.finish_step(meta)
    assert [handle[0] for handle in waited] == ["end of step 1"]  # type: ignore[index]
    settle(copier)
    assert arena.read(0) == bytes(arena.slot_bytes)
    done = copier.take_worker_meta()
    assert done is not None and done.failed_steps == {1}


@pytest.mark.parametrize("layout", ["heads-inside", "blocks-outermost"])
def test_pages_of_other_kv_layouts_round_trip(arena: HostArena, mover: tuple[str, str],
                                              layout: str) -> None:
    """vLLM's KV cache layout decides the strides of a layer's tensor: a block's interior may
    be permuted (tokens outside heads, as FlashAttention's default LBNHC gives on a GPU) or
    layers interleaved per block (BLNHC: each layer's pages strided by all layers' bytes).
    Each page is still one run of bytes, and is copied as such."""
    mode, device = mover
    blocks, heads, tokens, width = NUM_BLOCKS, 3, 16, 16
    gen = torch.Generator().manual_seed(7)
    if layout == "heads-inside":  # stored [B, N, H, C], seen as [B, H, N, C]
        kv = {name: torch.randn((blocks, tokens, heads, width), generator=gen).to(device)
              .permute(0, 2, 1, 3) for name in LAYERS}
    else:  # stored [B, L, H, N, C], a layer seen as [B, H, N, C]
        whole = torch.randn((blocks, len(LAYERS), heads, tokens, width), generator=gen)
        whole = whole.to(device)
        kv = {name: whole[:, i] for i, name in enumerate(LAYERS)}
        assert not kv[LAYERS[0]].is_contiguous()
    original = {name: t.clone() for name, t in kv.items()}
    copier = new_copier(mode)
    copier.register(kv)
    save_step(copier, step(arena, 1, saves=[PageCopy((1, 2), slots=(0, 1, 2))]))
    for t in kv.values():
        t.zero_()
    load_step(copier, step(arena, 2, loads=[PageCopy((6, 9), slots=(0, 1, 2))]))
    for name in LAYERS:
        assert torch.equal(kv[name][[6, 9]], original[name][[1, 2]])
        assert not kv[name][[0, 1, 2, 3]].any()  # nothing written outside the loaded pages


def test_a_layout_that_splits_pages_is_refused() -> None:
    """Heads outside the blocks (LHBNC) splits each page into one run per head: refused at
    registration with the layout to use, not copied wrong."""
    kv = {name: torch.zeros((3, NUM_BLOCKS, 16, 8)).permute(1, 0, 2, 3) for name in LAYERS}
    with pytest.raises(ValueError, match=r"not one contiguous run.*VLLM_KV_CACHE_LAYOUT"):
        new_copier().register(kv)


def test_a_step_that_moves_no_kv_skips_the_per_layer_hooks() -> None:
    """vLLM calls `wait_for_layer_load` and `save_kv_layer` around every attention layer while
    `has_connector_metadata()` is true: a lone decode step took 16.1 ms on 2 cores with
    tiering against 15.6 ms without, most steps copying nothing. Steps that copy layer by
    layer keep their hooks; a finished request's last pages are still copied after the step."""
    from antiphon.tiering.connector import AntiphonKVConnector

    finished: list[int] = []
    connector = object.__new__(AntiphonKVConnector)
    connector._copier = type("Copier", (), {"finish_step": lambda self, meta: finished.append(
        meta.step)})()  # type: ignore[assignment]
    connector._connector_metadata = None
    assert not connector.has_connector_metadata()
    copy = PageCopy(blocks=(1,), slots=(0, 1))
    for step, meta, hooks in [
            (1, {}, False), (2, {"final_saves": {"r": [copy]}}, False),
            (3, {"loads": [copy]}, True), (4, {"early_loads": [copy]}, True),
            (5, {"saves": [copy]}, True), (6, {"checkpoints": [copy]}, True)]:
        connector.bind_connector_metadata(TieringMetadata(step=step, arena_name="a", **meta))
        assert connector.has_connector_metadata() is hooks, meta
        connector.wait_for_save()
        connector.clear_connector_metadata()
    assert finished == [1, 2, 3, 4, 5, 6]  # every step's end, hooks or not


def test_every_step_orders_its_copies_before_the_forward_pass(
        arena: HostArena, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, `begin_step` makes the compute stream wait for the last step's saves on the
    side stream: a page a save is still reading may be reallocated and written by this step's
    forward pass, whether or not this step copies anything. vLLM calls `handle_preemptions`
    (our `checkpoint`) before every forward pass, so the ordering is taken there, once a step,
    and not at the step's first copy (which a step that copies nothing never makes)."""
    copier, _ = make_copier(("batched", "cpu"))
    begun: list[int] = []
    monkeypatch.setattr(copier._mover, "begin_step", lambda: begun.append(len(begun)))
    copy = PageCopy((4,), slots=(0, 1, 2))
    for number, copies in enumerate([{"saves": [copy]}, {}, {}, {"loads": [copy]}], start=1):
        meta = step(arena, number, **copies)
        copier.checkpoint(meta)  # handle_preemptions
        assert len(begun) == number, "no ordering before the forward pass"
        copier.load_early(meta)
        for name in LAYERS:
            if meta.loads:
                copier.load_layer(meta, name)
            if meta.saves:
                copier.save_layer(meta, name)
        copier.finish_step(meta)
        assert len(begun) == number, "ordered twice in one step"
