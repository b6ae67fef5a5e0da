"""What KV tiering costs the decoding requests: `python -m antiphon.bench.tier_cost [options]`.

Runs the engine alone (no server), once per system, side by side in one run: `none` (no KV
connector), `host` (the host tier alone) and `ssd` (host and SSD tiers, the default). In each,
`--decoders` requests decode `--tokens` tokens while `--prompts` prompts of `--prompt-tokens`
arrive `--gap-s` apart, each prompt's KV saved by the tiers as a chat turn's is. It prints the
decoders' wall time per token for each system and its ratio to `none`; `--repeats` alternates
the systems that many times, since one engine start differs from the next by a few percent.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

from antiphon import env
from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.profiler import generate_tokens, random_token_ids
from antiphon.model import resolve_model

SYSTEMS = ("none", "host", "ssd")


@dataclasses.dataclass(frozen=True)
class Load:
    decoders: int = 8
    tokens: int = 500  # each decoder's
    prompts: int = 12
    prompt_tokens: int = 600
    prompt_output_tokens: int = 16
    gap_s: float = 0.5
    host_tier_bytes: int = 512 << 20


async def decode_ms_per_token(system: str, load: Load, ssd_dir: Path) -> float:
    """The decoders' wall time over their tokens (ms) on a fresh engine with `system`."""
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.tiering.config import TieringConfig

    config = EngineConfig(model=env.model(), enforce_eager=True, cost_model="online")
    tiering = {"none": None,
               "host": TieringConfig(ssd_dir=ssd_dir, ssd_tier_bytes=0,
                                     host_tier_bytes=load.host_tier_bytes),
               # the requests name no session: written through as a session's turns are
               "ssd": TieringConfig(ssd_dir=ssd_dir, host_tier_bytes=load.host_tier_bytes,
                                    ssd_write_through="all"),
               }[system]
    engine = VllmEngine(config, resolve_model(config.model), tiering=tiering)
    await engine.start()
    rng = random.Random(0)
    try:
        # the decoders share a prefix, so they start decoding after one short prefill
        prefix = random_token_ids(rng, 256)
        await generate_tokens(engine, "primer", [*prefix, 1], 1)
        started = time.perf_counter()
        decoders = [asyncio.create_task(generate_tokens(
            engine, f"decoder{i}", prefix + random_token_ids(rng, 4), load.tokens))
            for i in range(load.decoders)]
        await asyncio.sleep(load.gap_s)
        for k in range(load.prompts):
            await generate_tokens(engine, f"prompt{k}", random_token_ids(rng, load.prompt_tokens),
                                  load.prompt_output_tokens)
            await asyncio.sleep(load.gap_s)
        await asyncio.gather(*decoders)
        return 1000 * (time.perf_counter() - started) / load.tokens
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=2)
    for field in dataclasses.fields(Load):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default)
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; valid: {', '.join(SYSTEMS)}")
    load = Load(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Load)})
    runs: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for system in systems:
            with tempfile.TemporaryDirectory() as tmp:
                runs[system].append(asyncio.run(decode_ms_per_token(system, load, Path(tmp))))
            print(f"{system}: {runs[system][-1]:.1f} ms per token", flush=True)
    base = statistics.median(runs["none"]) if runs.get("none") else None
    print(f"\n{load}")
    print(f"{'system':<6} {'ms per token (each run)':<28} {'median':>7} {'/ none':>7}")
    for system, values in runs.items():
        median = statistics.median(values)
        ratio = f"{median / base:.3f}" if base else "-"
        print(f"{system:<6} {', '.join(f'{v:.1f}' for v in values):<28} {median:>7.1f} "
              f"{ratio:>7}")


if __name__ == "__main__":
    main()
