"""LARRY: load-adaptive reordering of the waiting queue (section 4.1).

Each waiting request is keyed

    key(r) = queue_len * memory(r) - alpha * waiting_time(r)

and dispatched smallest key first (the paper's score, highest first, with memory counted
against). `memory(r)` is the KV pages its prompt (and, once preempted, its output so far) needs
to start; `queue_len` is the length of the waiting queue the request competes in, the paper's
measure of memory pressure; `waiting_time` is seconds since arrival. With a short queue the
waiting time dominates and the order is nearly FCFS; with a long one small prompts go first,
so one large prompt does not block many small ones; waiting time lifts any request in the end.

RT requests come before BE requests, each class a queue of its own (an RT request does not
compete with the BE backlog). The plan only orders: vLLM still dispatches waiting requests in
that order until one does not fit, as LARRY does, and running requests keep arrival order, RT
first, so the preemptions vLLM makes for memory (newest running request first) hit BE first.
"""

from __future__ import annotations

from collections.abc import Sequence

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.policies.base import Policy, pages_for
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan


class LarryPolicy(Policy):
    name = "larry"

    def __init__(self, cost_model: CostModel, alpha: float = 1.0) -> None:
        super().__init__(cost_model)
        if alpha < 0:
            raise ValueError(f"alpha must be non-negative, got {alpha}")
        self.alpha = alpha  # pages per queued request per second of waiting (paper: 1)

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        order: list[str] = []
        for is_rt in (True, False):
            running = sorted((v for v in views if v.is_rt is is_rt and v.is_running),
                             key=lambda v: v.arrival_s)
            waiting = [v for v in views if v.is_rt is is_rt and not v.is_running]
            order += [v.request_id for v in running]
            order += [v.request_id for v in self.waiting_order(waiting, budget)]
        return StepPlan(order=order)

    def waiting_order(self, waiting: Sequence[RequestView],
                      budget: StepBudget) -> list[RequestView]:
        """`waiting` (one queue) in LARRY's dispatch order."""
        queue_len = len(waiting)

        def key(view: RequestView) -> tuple[float, float]:
            memory = pages_for(view.num_prompt_tokens + view.num_output_tokens,
                               budget.page_tokens)
            waited_s = budget.now_s - view.arrival_s
            return queue_len * memory - self.alpha * waited_s, view.arrival_s

        return sorted(waiting, key=key)
