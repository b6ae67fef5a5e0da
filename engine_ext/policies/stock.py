"""Stock vLLM behaviour, kept as baselines: first come first served, and static priority."""

from __future__ import annotations

from collections.abc import Sequence

from antiphon.engine_ext.policies.base import Policy
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan


class FcfsPolicy(Policy):
    """vLLM's default: arrival order; preemption takes the newest running request."""

    name = "fcfs"
    is_rt_first = False

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        return StepPlan()


class PriorityPolicy(Policy):
    """vLLM's priority scheduling (RT before BE in the waiting queue); a waiting RT request
    never preempts running BE ones."""

    name = "priority"
    vllm_scheduling_policy = "priority"
    is_rt_first = False

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        return StepPlan()
