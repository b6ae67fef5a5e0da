"""Counters the scheduler keeps in the EngineCore process and reports on request."""

from __future__ import annotations

import dataclasses
from typing import Any

from antiphon.engine_ext.types import RequestClass


def _per_class() -> dict[str, int]:
    return {c.value: 0 for c in RequestClass}


@dataclasses.dataclass
class SchedulerStats:
    num_steps: int = 0
    plan_fallbacks: int = 0  # steps run by vLLM's own logic because the plan stalled
    seat_preemptions: int = 0  # BE requests sitting a step out that gave their seat to RT
    policy_s: float = 0.0  # total time in the policy's plan (seconds)
    # total time of the scheduler's own work (seconds): schedule(), plan and vLLM's part
    # included, also when it scheduled nothing, and its bookkeeping after each step (the cost
    # model's update and refit, first tokens, tier tokens), vLLM's output handling not
    schedule_s: float = 0.0
    step_s: float = 0.0  # total time from a step's schedule to its output (seconds)
    max_schedule_s: float = 0.0
    num_preemptions: dict[str, int] = dataclasses.field(default_factory=_per_class)
    recomputed_tokens: dict[str, int] = dataclasses.field(default_factory=_per_class)
    cost_model_mape: float | None = None  # of recent predictions, online
    cost_model_calibration: float = 1.0  # factor policies plan with (CostModel.planning_s)
    cost_model_form: str = ""  # bros, hygen or echo (engine_ext/costforms)
    cost_model_profiled_mape: float | None = None  # held-out error of the profiled fit in use
    kv_usage: float = 0.0  # KV pool use (fraction of pages) at the last scheduled step
    kv_usage_sum: float = 0.0  # KV pool use (fraction of pages) summed over scheduled steps
    kv_usage_s: float = 0.0  # KV pool use times each step's time: over a window's step_s, the
    # time-weighted use (steps of different lengths count by their length)
    cost_model_error_sum: float = 0.0  # each step's |predicted - measured| / measured, summed
    cost_model_errors: int = 0  # steps in that sum: a window's MAPE is their deltas' ratio
    integrity_problems: int = 0  # bidirectional-block invariants found broken (should stay 0)

    def record_step(self, policy_s: float, schedule_s: float, kv_usage: float) -> None:
        self.num_steps += 1
        self.kv_usage = kv_usage
        self.kv_usage_sum += kv_usage
        self.policy_s += policy_s
        self.schedule_s += schedule_s
        self.max_schedule_s = max(self.max_schedule_s, schedule_s)

    def record_overhead(self, seconds: float) -> None:
        """Scheduler time outside a scheduled step's schedule(): one that scheduled nothing,
        or the bookkeeping after a step."""
        self.schedule_s += seconds

    def record_step_latency(self, step_s: float, kv_usage: float,
                            cost_model_error: float | None) -> None:
        """A finished step: its time, the KV pool use it was scheduled with, and the cost
        model's relative error on it (None: not measurable)."""
        self.step_s += step_s
        self.kv_usage_s += kv_usage * step_s
        if cost_model_error is not None:
            self.cost_model_error_sum += cost_model_error
            self.cost_model_errors += 1

    def reset(self) -> SchedulerStats:
        """New counters, with this one's cost-model state (form, errors, calibration)."""
        return SchedulerStats(
            cost_model_mape=self.cost_model_mape,
            cost_model_calibration=self.cost_model_calibration,
            cost_model_form=self.cost_model_form,
            cost_model_profiled_mape=self.cost_model_profiled_mape)

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        return {**dataclasses.asdict(self), **extra}
