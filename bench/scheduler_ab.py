"""Engine-only A/B of scheduler classes: `python -m antiphon.bench.scheduler_ab`.

Runs the `bench serve` workload through vLLM's AsyncLLM (no server) with the stock scheduler,
vLLM's own AsyncScheduler, and Antiphon's scheduler in both forms under the identity (`fcfs`)
plan, alternating, so the cost of the scheduler class itself shows on this machine.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from antiphon.bench.serving import run_direct
from antiphon.engine_ext.config import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS, SchedulerSettings
from antiphon.model import resolve_model

ENGINE = {"max_model_len": 2048, "enforce_eager": False, "dtype": "bfloat16",
          "max_num_seqs": 64, "kv_cache_memory_bytes": 2 << 30, "seed": 0,
          "enable_prefix_caching": True, "max_num_batched_tokens": 2048}
FCFS = SchedulerSettings("fcfs").to_additional_config()
VARIANTS: dict[str, dict[str, Any]] = {
    "stock": {},
    "vllm_async": {"scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"},
    "antiphon": {"scheduler_cls": SCHEDULER_CLS, "additional_config": FCFS},
    "antiphon_async": {"scheduler_cls": ASYNC_SCHEDULER_CLS, "additional_config": FCFS},
}


def main(repeats: int = 2) -> None:
    model = resolve_model(None)
    workload = {"concurrency": (1, 16), "max_tokens": 128, "rounds": 2, "ttft_repeats": 3}
    for rep in range(repeats):
        for name, extra in VARIANTS.items():
            result = asyncio.run(run_direct(model, {**ENGINE, **extra}, **workload))
            print(rep, name, {k: round(v, 2) for k, v in result.items() if "per_s" in k},
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
