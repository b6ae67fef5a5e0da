"""How much engine steps of one shape vary: `python -m antiphon.bench.step_noise [options]`.

Runs the engine alone (no server) with N requests decoding at a fixed context, records every
step's latency through the scheduler (as `antiphon profile` does), and prints, per batch, the
10th, 50th and 90th percentile step time and the mean absolute deviation from the median. A
cost model cannot predict a step closer than this spread, so it bounds the model's error; the
options that change it (`--cpu-omp-spin-count`, `--cpu-reserved-cores`) are the engine's own.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from antiphon import env
from antiphon.engine_ext.config import DEFAULT_CPU_OMP_SPIN_COUNT, EngineConfig
from antiphon.engine_ext.profiler import generate_tokens, random_token_ids
from antiphon.model import resolve_model

# (requests decoding together, their context in tokens, steps)
BATCHES = ((1, 256, 60), (8, 512, 60), (32, 256, 40))
_SKIPPED = 2  # the first steps of a batch, after its prefill, run slower (docs/benchmarks.md)


def spread(latencies_s: list[float]) -> dict[str, float]:
    """p10, p50 and p90 (ms) and the mean absolute deviation from the median (a fraction)."""
    ordered = sorted(latencies_s)
    median = statistics.median(ordered)

    def at(q: float) -> float:
        return 1000 * ordered[round(q * (len(ordered) - 1))]

    return {"p10_ms": at(0.1), "p50_ms": 1000 * median, "p90_ms": at(0.9),
            "mean_abs_dev": statistics.mean(abs(x - median) for x in ordered) / median}


async def measure(config: EngineConfig, tiering_dir: Path | None) -> list[dict[str, float]]:
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.tiering.config import TieringConfig

    tiering = TieringConfig(ssd_dir=tiering_dir) if tiering_dir is not None else None
    engine = VllmEngine(config, resolve_model(config.model), tiering=tiering)
    await engine.start()
    rng = random.Random(0)
    results = []
    try:
        for n, context, steps in BATCHES:
            # prompts share the prefix's pages: the decoders skip its prefill
            prefix = random_token_ids(rng, context)
            prompts = [prefix + random_token_ids(rng, 4) for _ in range(n + 1)]
            await generate_tokens(engine, f"noise{n}-primer", prompts[n], 1)
            await engine.recorded_steps(record=True)
            await asyncio.gather(*(generate_tokens(engine, f"noise{n}-{i}", prompts[i], steps)
                                   for i in range(n)))
            rows = await engine.recorded_steps(record=False)
            # decode-only steps of the whole batch: [*StepShape fields, latency]
            latencies = [row[-1] for row in rows if row[0] == 0 and row[3] == n][_SKIPPED:]
            results.append({"requests": n, "context": context, "steps": len(latencies),
                            **spread(latencies)})
    finally:
        await engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-omp-spin-count", type=int, default=DEFAULT_CPU_OMP_SPIN_COUNT)
    parser.add_argument("--cpu-reserved-cores", type=int, default=0)
    parser.add_argument("--tiering", action="store_true", help="with the KV connector on")
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (EngineConfig.dtype)")
    args = parser.parse_args()
    config = EngineConfig(model=env.model(), enforce_eager=args.enforce_eager,
                          cost_model="online", dtype=args.dtype, cpu_omp_spin_count=args.cpu_omp_spin_count,
                          cpu_reserved_cores=args.cpu_reserved_cores)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(measure(config, Path(tmp) if args.tiering else None))
    print(f"dtype {args.dtype}, omp spin count {args.cpu_omp_spin_count}, reserved cores "
          f"{args.cpu_reserved_cores}, tiering {'on' if args.tiering else 'off'}")
    for r in results:
        print(f"{r['requests']:>3} requests at {r['context']:>4} tokens, {r['steps']} steps: "
              f"p10 {r['p10_ms']:.1f} p50 {r['p50_ms']:.1f} p90 {r['p90_ms']:.1f} ms, "
              f"mean |deviation| {r['mean_abs_dev']:.1%} of the median")


if __name__ == "__main__":
    main()
