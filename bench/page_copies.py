"""The worker's KV page copies at GPU sizes: `python -m antiphon.bench.page_copies [options]`.

Drives `KvPageCopier`, the code vLLM's worker runs for the KV connector, over KV tensors of a
served model's shape (default: Llama-3.1-8B's, 32 layers of 16-token bfloat16 pages, 64 KiB per
page and layer) and a host arena in shared memory, with both movers side by side in one run:
`pagewise` (one synchronous copy per page and layer, the CPU way), `batched` (page-locked
arena, staging buffer, side stream, per-layer events, transfers through the CUDA runtime) and
`batched_torch` (the same with each transfer through `Tensor.copy_`). Per mover it reports:

- **load** and **save**: a step that loads (saves) `--pages` pages of every layer, alone: wall
  time until the bytes have landed, and GB/s;
- **under a forward pass**: the same step with a stand-in forward pass (a matrix product per
  layer sized to `--layer-compute-ms`), the copier called where vLLM calls it (loads before
  each layer's attention, saves after it); the time it adds to the forward pass alone;
- **bytes**: a save then a load into other blocks must give back every byte.

No vLLM engine runs here (the copier needs none); the numbers are the copies' own. Prints a
table and writes `--out` JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from antiphon.tiering.connector_meta import PageCopy, TieringMetadata
from antiphon.tiering.connector_worker import KvPageCopier
from antiphon.tiering.host_arena import HostArena

MOVERS = ("pagewise", "batched_torch", "batched")  # batched_torch: transfers via Tensor.copy_


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rig:
    """KV tensors, an arena holding `pages` pages of every layer, and a copier per mover."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
        page_elems = args.page_bytes // 2
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.kv = {name: torch.randn((args.blocks, page_elems), generator=gen,
                                     device=self.device).to(torch.bfloat16)
                   for name in self.layers}
        chunks = -(-args.pages // args.chunk_pages)
        self.arena = HostArena.create(f"antiphon-bench-{uuid.uuid4().hex[:8]}",
                                      num_slots=chunks * args.layers,
                                      slot_bytes=args.chunk_pages * args.page_bytes)
        self.step = 0
        # Source blocks spread over the pool, targets elsewhere: vLLM's blocks are not in order.
        order = torch.randperm(args.blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.sources = order[:args.pages]
        self.targets = order[args.pages:2 * args.pages]

    def copies(self, blocks: list[int]) -> list[PageCopy]:
        per, layers = self.args.chunk_pages, self.args.layers
        return [PageCopy(tuple(blocks[c * per:(c + 1) * per]),
                         slots=tuple(c * layers + layer for layer in range(layers)))
                for c in range(-(-len(blocks) // per))]

    def meta(self, **copies: list[PageCopy]) -> TieringMetadata:
        self.step += 1
        return TieringMetadata(step=self.step, arena_name=self.arena.name,
                               **copies)  # type: ignore[arg-type]

    def copier(self, mode: str) -> KvPageCopier:
        copier = KvPageCopier(self.layers, copy_mode=mode.removesuffix("_torch"),
                              staging_pages=self.args.staging_pages,
                              raw_copies=not mode.endswith("_torch"))
        copier.register({name: t.view(self.args.blocks, -1) for name, t in self.kv.items()})
        return copier


def run_step(rig: Rig, copier: KvPageCopier, meta: TieringMetadata,
             compute: Callable[[str], None] | None) -> None:
    """One engine step as vLLM's worker makes it: preemptions, early loads, then per layer
    the load wait, the layer's work, the save; then the end of the step, until it is done."""
    copier.checkpoint(meta)
    copier.load_early(meta)
    for name in rig.layers:
        copier.load_layer(meta, name)
        if compute is not None:
            compute(name)
        copier.save_layer(meta, name)
    copier.finish_step(meta)
    while meta.has_work:
        done = copier.take_worker_meta()
        if done is not None and meta.step in done.done_steps | done.failed_steps:
            assert meta.step not in done.failed_steps, "copies failed"
            break
        time.sleep(0)
    _sync(rig.device)


def timed(repeats: int, body: Callable[[], None], device: torch.device) -> float:
    """Median seconds of `body` over `repeats` runs, after one warm-up."""
    body()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_compute(device: torch.device, ms: float, n: int) -> Callable[[str], None]:
    """A stand-in for one layer of a forward pass: bf16 products of `n`x`n` matrices taking
    about `ms` in all."""
    a = torch.randn((n, n), device=device, dtype=torch.bfloat16)
    b = torch.randn((n, n), device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def once() -> None:
        torch.matmul(a, b, out=out)

    def twenty() -> None:
        for _ in range(20):
            once()

    per = timed(5, twenty, device) / 20
    reps = max(1, round(ms / 1000 / per))

    def layer(name: str) -> None:
        for _ in range(reps):
            once()
    return layer


def measure(rig: Rig, mode: str, compute: Callable[[str], None]) -> dict[str, Any]:
    args = rig.args
    copier = rig.copier(mode)
    moved = args.pages * args.layers * args.page_bytes
    saves, loads = rig.copies(rig.sources), rig.copies(rig.targets)
    # bytes: save the sources, zero the targets, load them, compare
    run_step(rig, copier, rig.meta(saves=saves), None)
    for t in rig.kv.values():
        t[rig.targets] = 0
    run_step(rig, copier, rig.meta(loads=loads), None)
    exact = all(torch.equal(t[rig.targets].view(torch.int16), t[rig.sources].view(torch.int16))
                for t in rig.kv.values())
    # the layer reads its loaded pages right after its load wait, as attention does: each
    # read must see the loaded bytes (the compute stream waited for that layer's copies)
    expected = {name: t[rig.sources].view(torch.int16).sum(dtype=torch.int64)
                for name, t in rig.kv.items()}
    seen: dict[str, torch.Tensor] = {}

    def attention(name: str) -> None:
        seen[name] = rig.kv[name][rig.targets].view(torch.int16).sum(dtype=torch.int64)
        compute(name)

    ordered = True
    for _ in range(3):
        for t in rig.kv.values():
            t[rig.targets] = 0
        run_step(rig, copier, rig.meta(loads=loads), attention)
        ordered &= all(bool(seen[name] == expected[name]) for name in rig.layers)
    load_s = timed(args.repeats, lambda: run_step(rig, copier, rig.meta(loads=loads), None),
                   rig.device)
    save_s = timed(args.repeats, lambda: run_step(rig, copier, rig.meta(saves=saves), None),
                   rig.device)
    forward_s = timed(args.repeats, lambda: run_step(rig, copier, rig.meta(), compute),
                      rig.device)
    with_loads_s = timed(args.repeats,
                         lambda: run_step(rig, copier, rig.meta(loads=loads), compute),
                         rig.device)
    with_saves_s = timed(args.repeats,
                         lambda: run_step(rig, copier, rig.meta(saves=saves), compute),
                         rig.device)
    copier.close()
    return {
        "bytes_exact": exact,
        "layer_reads_exact": ordered,
        "bytes_per_step": moved,
        "load_ms": 1000 * load_s, "load_gb_per_s": moved / load_s / 1e9,
        "save_ms": 1000 * save_s, "save_gb_per_s": moved / save_s / 1e9,
        "forward_ms": 1000 * forward_s,
        "forward_with_loads_ms": 1000 * with_loads_s,
        "forward_with_saves_ms": 1000 * with_saves_s,
        "loads_add_ms": 1000 * (with_loads_s - forward_s),
        "saves_add_ms": 1000 * (with_saves_s - forward_s),
    }


def link_gb_per_s(rig: Rig) -> dict[str, float]:
    """The link's own speed: one contiguous copy of a step's bytes from page-locked host
    memory to the device and back (what the movers' many transfers are measured against)."""
    nbytes = rig.args.pages * rig.args.layers * rig.args.page_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=rig.device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    def down() -> None:
        dev.copy_(host, non_blocking=True)

    def up() -> None:
        host.copy_(dev, non_blocking=True)

    to_device, to_host = timed(rig.args.repeats, down, rig.device), timed(rig.args.repeats, up,
                                                                          rig.device)
    return {"to_device": nbytes / to_device / 1e9, "to_host": nbytes / to_host / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--movers", default=",".join(MOVERS))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-bytes", type=int, default=16 * 8 * 128 * 2 * 2,
                        help="one layer's page (default: 16 tokens x 8 KV heads x 128 x K,V "
                             "x bf16)")
    parser.add_argument("--blocks", type=int, default=2048, help="pages in the KV pool")
    parser.add_argument("--pages", type=int, default=256,
                        help="pages of every layer loaded or saved in one step")
    parser.add_argument("--chunk-pages", type=int, default=8, help="pages per host slot")
    parser.add_argument("--staging-pages", type=int, default=256)
    parser.add_argument("--layer-compute-ms", type=float, default=0.5)
    parser.add_argument("--matrix", type=int, default=0,
                        help="side of the stand-in layer's matrices (default: 2048 on a GPU, "
                             "128 on a CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if 2 * args.pages > args.blocks:
        parser.error("--blocks must hold twice --pages")
    rig = Rig(args)
    matrix = args.matrix or (2048 if rig.device.type == "cuda" else 128)
    compute = layer_compute(rig.device, args.layer_compute_ms, matrix)
    name = torch.cuda.get_device_name(rig.device) if rig.device.type == "cuda" else "cpu"
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"device_name": name}
    results: dict[str, Any] = {}
    link = link_gb_per_s(rig)
    try:
        for mode in args.movers.split(","):
            results[mode] = measure(rig, mode, compute)
    finally:
        rig.arena.close()  # the owner's close unlinks it
    mib = args.pages * args.layers * args.page_bytes / 2**20
    print(f"{name}: {args.pages} pages x {args.layers} layers x {args.page_bytes} B = "
          f"{mib:.0f} MiB per step; forward stand-in {args.layer_compute_ms} ms per layer; "
          f"one contiguous pinned copy: {link['to_device']:.1f} GB/s to the device, "
          f"{link['to_host']:.1f} back")
    columns = ("bytes_exact", "layer_reads_exact", "load_ms", "load_gb_per_s", "save_ms", "save_gb_per_s",
               "forward_ms", "loads_add_ms", "saves_add_ms")
    print(f"{'mover':<14}" + "".join(f"{c:>18}" for c in columns))
    for mode, row in results.items():
        cells = "".join(f"{row[c]:>18.2f}" if isinstance(row[c], float) else f"{row[c]!s:>18}"
                        for c in columns)
        print(f"{mode:<14}{cells}")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "page_copies", "config": config,
                                        "link_gb_per_s": link, "systems": results}, indent=2))
    return 0 if all(row["bytes_exact"] and row["layer_reads_exact"]
                    for row in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
