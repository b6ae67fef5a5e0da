"""The parts of a follow-up turn's TTFT at a served model's size: `python -m antiphon.bench.ttft_parts`.

What decides whether an advisory pays (issues 4 and 5) is how long each way of getting a
conversation's KV back takes against the prefill of the new message. This measures each part
on the device it runs on, for a model of a served model's shape (default Llama-3.1-8B's, random
bfloat16 weights through `transformers`; no weights are downloaded), per context length:

- **fresh**: prefill of the new message alone (a fresh conversation of that length);
- **with_context**: prefill of the new message with the context's KV already on the device
  (what a turn whose KV was prefetched computes);
- **recompute**: prefill of the whole conversation (stock vLLM once its prefix cache lost it);
- **ssd_read**: the SSD tier (`SsdTier`, the connector's own) reading the context's
  chunk-layers into page-locked host memory, with the file's pages dropped from the OS cache
  first (a cold read, as after a restart or under memory pressure);
- **disk_read**: a plain sequential read of that file, cold (the disk's own pace, against
  which `ssd_read` shows the tier's overhead);
- **host_to_device**: copying the context's KV from page-locked host memory to the device.

From those it derives a follow-up turn's TTFT per way, as sums of the parts (no overlap taken,
so the tiers' figures are upper bounds): `recompute`; `ssd` (no advisory: the context is read
from the SSD on the critical path, then loaded and the message prefilled); `host` (an advisory
brought the context to host memory ahead: loaded and prefilled). The ratios are what issue 5
(`ssd` / `host`, call TTFT at least 1.5 times lower with hints) and issue 4 (`host` / `fresh`,
at most 1.2) ask of the whole system; here they are only the parts' arithmetic, not the
benchmark. No vLLM engine runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from antiphon.bench.page_copies import timed
from antiphon.tiering.keys import ChunkKey
from antiphon.tiering.ssd_tier import SsdTier

# Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B-Instruct).
MODELS: dict[str, dict[str, Any]] = {
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                 "max_position_embeddings": 131072, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
             "max_position_embeddings": 4096},
}


def build_model(name: str, device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[name])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, not converted from float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def kv_bytes_per_token_layer(model: Any) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * head_dim * 2  # K and V, bfloat16


@torch.inference_mode()
def prefill_times(model: Any, context: int, new: int, repeats: int,
                  device: torch.device) -> dict[str, float]:
    """Seconds to prefill `new` tokens alone, after `context` cached tokens, and all of them."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(context)
    ctx_ids = torch.randint(vocab, (1, context), generator=gen).to(device)
    new_ids = torch.randint(vocab, (1, new), generator=gen).to(device)
    all_ids = torch.cat([ctx_ids, new_ids], dim=1)
    with_context = context_step(model, StaticCache(config=model.config,
                                                   max_cache_len=context + new),
                                ctx_ids, new_ids)
    return {
        "fresh": timed(repeats, lambda: model(new_ids, use_cache=False, logits_to_keep=1),
                       device),
        "with_context": timed(repeats, with_context, device),
        "recompute": timed(repeats, lambda: model(all_ids, use_cache=False, logits_to_keep=1),
                           device),
    }


def context_step(model: Any, cache: Any, ctx_ids: torch.Tensor,
                 new_ids: torch.Tensor) -> Callable[[], Any]:
    """A prefill of `new_ids` after `ctx_ids`, to be timed again and again: `ctx_ids` is
    prefilled into `cache` (a `StaticCache` of exactly context + new slots) once here; each
    call writes the new tokens' KV into the same last slots and returns their last logits.

        slots  [ context ...................... | new ...... ]
                 written once, here               rewritten by every call

    A `DynamicCache` concatenated the whole context's K/V into a new tensor on every call,
    a copy a paged cache never makes, and the "with context" time counted it (found by a
    review). This transformers' static layers write at their `cumulative_length`, not at a
    position passed in: it is set back to the context's end before each call."""
    context, new = ctx_ids.shape[1], new_ids.shape[1]
    model(ctx_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    positions = torch.arange(context, context + new, device=new_ids.device).unsqueeze(0)

    def step() -> Any:  # (the logits; `timed` takes a body that returns None)
        for layer in cache.layers:
            layer.cumulative_length.fill_(context)
        return model(new_ids, past_key_values=cache, use_cache=True, position_ids=positions,
                     logits_to_keep=1).logits

    return step


def _drop_cached_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ssd_read_time(directory: Path, context: int, chunk_tokens: int, layers: int,
                  token_layer_bytes: int, pinned: torch.Tensor,
                  repeats: int) -> tuple[float, float]:
    """Seconds for the SSD tier to read a context's chunk-layers (cold) into `pinned`, and
    for a plain sequential read of its whole file (cold)."""
    chunk_bytes = chunk_tokens * token_layer_bytes
    chunks = -(-context // chunk_tokens)
    payload = os.urandom(chunk_bytes)
    keys = [ChunkKey("bench", bytes([c % 256, c // 256]) + b"ctx", c, layer)
            for c in range(chunks) for layer in range(layers)]
    tier = SsdTier(directory, capacity_bytes=(len(keys) + 1) * (chunk_bytes + 8192),
                   slot_bytes=chunk_bytes)
    try:
        for key in keys:
            tier.put(key, payload)
        tier.flush()
        host = pinned.view(-1)[:len(keys) * chunk_bytes].view(len(keys), chunk_bytes)
        times = []
        # The tier's reads are read-only views; they are only copied from.
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        for _ in range(repeats):
            _drop_cached_pages(tier.path)
            start = time.perf_counter()
            for i, key in enumerate(keys):
                data = tier.get(key)
                assert data is not None, "the SSD tier lost a chunk-layer"
                host[i].copy_(torch.frombuffer(memoryview(data).cast("B"), dtype=torch.uint8))
            times.append(time.perf_counter() - start)
        disk = []
        for _ in range(repeats):
            _drop_cached_pages(tier.path)
            disk.append(_read_whole(tier.path))
        return statistics.median(times), statistics.median(disk)
    finally:
        tier.close()


def _read_whole(path: Path, block: int = 8 << 20) -> float:
    """Seconds to read `path` front to back in `block`-byte reads: the disk's own pace."""
    buffer = bytearray(block)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def host_to_device_time(pinned: torch.Tensor, nbytes: int, device: torch.device,
                        repeats: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = pinned.view(-1)[:nbytes]

    def copy() -> None:
        dev.copy_(src, non_blocking=True)

    return timed(repeats, copy, device)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model = build_model(args.model, device)
    layers = model.config.num_hidden_layers
    token_layer = kv_bytes_per_token_layer(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    most = max(-(-c // args.chunk_tokens) * args.chunk_tokens for c in contexts)
    pinned = torch.empty(most * layers * token_layer, dtype=torch.uint8,
                         pin_memory=device.type == "cuda")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for context in contexts:
            row = prefill_times(model, context, args.new_tokens, args.repeats, device)
            nbytes = context * layers * token_layer
            row["ssd_read"], row["disk_read"] = ssd_read_time(
                Path(scratch) / f"ssd-{context}", context, args.chunk_tokens, layers,
                token_layer, pinned, args.repeats)
            row["host_to_device"] = host_to_device_time(pinned, nbytes, device, args.repeats)
            ms = {f"{k}_ms": 1000 * v for k, v in row.items()}
            host = ms["host_to_device_ms"] + ms["with_context_ms"]
            ssd = ms["ssd_read_ms"] + host
            rows[str(context)] = ms | {
                "kv_mib": nbytes / 2**20,
                "ssd_gb_per_s": nbytes / row["ssd_read"] / 1e9,
                "disk_gb_per_s": nbytes / row["disk_read"] / 1e9,
                "ttft_recompute_ms": ms["recompute_ms"], "ttft_ssd_ms": ssd,
                "ttft_host_ms": host, "ssd_over_host": ssd / host,
                "host_over_fresh": host / ms["fresh_ms"],
                "recompute_over_host": ms["recompute_ms"] / host,
            }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-8b")
    parser.add_argument("--contexts", default="1024,4096,16384",
                        help="context lengths in tokens, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="the new message's tokens")
    parser.add_argument("--chunk-tokens", type=int, default=128,
                        help="tokens per stored chunk (the server's --chunk-tokens)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the SSD tier's file goes (default: the system's temp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = measure(args)
    name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
            else "cpu")
    print(f"{name}, {args.model}, new message {args.new_tokens} tokens "
          f"(sums of parts; ms)")
    columns = ("kv_mib", "fresh_ms", "with_context_ms", "recompute_ms", "ssd_read_ms",
               "ssd_gb_per_s", "disk_gb_per_s", "host_to_device_ms", "ttft_ssd_ms", "ttft_host_ms",
               "ssd_over_host", "host_over_fresh", "recompute_over_host")
    print(f"{'context':>8}" + "".join(f"{c:>20}" for c in columns))
    for context, row in rows.items():
        print(f"{context:>8}" + "".join(f"{row[c]:>20.2f}" for c in columns))
    if args.out:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                  if k != "out"} | {"device_name": name}
        args.out.write_text(json.dumps({"benchmark": "ttft_parts", "config": config,
                                        "contexts": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
