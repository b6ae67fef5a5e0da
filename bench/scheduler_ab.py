"""Engine-only A/B of scheduler classes: `python -m antiphon.bench.scheduler_ab [REPEATS]`.

Runs the `bench serve` workload through vLLM's AsyncLLM (no server), alternating: the stock
scheduler, vLLM's own AsyncScheduler, Antiphon's scheduler in both forms under the identity
(`fcfs`) plan, so the cost of the scheduler class itself shows on this machine, and Antiphon's
scheduler under the `bros` (or `echo`) policy with every request RT, then every request BE
(issue 3: with one class only, throughput at least 97% of stock vLLM).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from antiphon.bench.serving import run_direct
from antiphon.engine_ext.config import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS, SchedulerSettings
from antiphon.engine_ext.model_defaults import resolve_dtype
from antiphon.engine_ext.vllm_engine import default_scheduler_cls
from antiphon.model import resolve_model

# Eager engines start in seconds; compiled ones run faster, but every variant alike. The dtype
# is the server's default for this machine (`resolve_dtype("auto")`).
ENGINE = {"max_model_len": 2048, "enforce_eager": True,
          "max_num_seqs": 64, "kv_cache_memory_bytes": 2 << 30, "seed": 0,
          "enable_prefix_caching": True, "max_num_batched_tokens": 2048}


def policy_engine(policy: str, scheduler_cls: str | None = None) -> dict[str, Any]:
    """Engine arguments for Antiphon's scheduler (`scheduler_cls`; unset: the class `antiphon
    serve` runs on this machine, as stock vLLM gets its own) under `policy`. Always the
    synchronous class, a GPU's policy runs lost vLLM's overlap that stock vLLM kept."""
    return {"scheduler_cls": scheduler_cls or default_scheduler_cls(),
            "additional_config": SchedulerSettings(policy).to_additional_config()}


# name: (engine arguments, class of every request)
VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "stock": ({}, None),
    "vllm_async": ({"scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"}, None),
    "antiphon": (policy_engine("fcfs", SCHEDULER_CLS), None),
    "antiphon_async": (policy_engine("fcfs", ASYNC_SCHEDULER_CLS), None),
    **{f"{policy}_{cls}_only": (policy_engine(policy), cls)
       for policy in ("bros", "echo") for cls in ("rt", "be")},
}


def main(repeats: int = 2, names: list[str] | None = None) -> None:
    model = resolve_model(None)
    engine = {**ENGINE, "dtype": resolve_dtype("auto")}
    workload = {"concurrency": (1, 16), "max_tokens": 128, "rounds": 2, "ttft_repeats": 3}
    names = names or list(VARIANTS)
    for rep in range(repeats):
        first = rep % len(names)  # rotated, so a host that drifts favours no variant
        for name in names[first:] + names[:first]:
            extra, request_class = VARIANTS[name]
            result = asyncio.run(run_direct(model, {**engine, **extra}, request_class,
                                            **workload))
            print(rep, name, {k: round(v, 2) for k, v in result.items() if "per_s" in k},
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2].split(",")
         if len(sys.argv) > 2 else None)
