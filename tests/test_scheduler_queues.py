"""AntiphonScheduler's own bookkeeping around vLLM's: the queues a policy switched to at run
time runs on, and the time the scheduler counts as its own."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.request import Request

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.scheduler import AntiphonScheduler


def request(rid: str, priority: int, arrival: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), None,
                   arrival_time=arrival, priority=priority)


def test_switching_to_priority_and_back_changes_the_queue_discipline() -> None:
    sched = SimpleNamespace(cost_model=CostModel(), policy=SchedulingPolicy.FCFS)
    sched._requeued = lambda queue: AntiphonScheduler._requeued(sched, queue)  # type: ignore[arg-type]
    sched.waiting = create_request_queue(SchedulingPolicy.FCFS)
    sched.kv_holding_waiting = create_request_queue(SchedulingPolicy.FCFS)
    for rid, priority, arrival in (("be-0", 1, 1.0), ("be-1", 1, 2.0), ("rt", 0, 3.0)):
        sched.waiting.add_request(request(rid, priority, arrival))
    sched.kv_holding_waiting.add_request(request("held", 1, 0.5))

    AntiphonScheduler.set_policy(sched, "priority")  # type: ignore[arg-type]
    assert sched.policy == SchedulingPolicy.PRIORITY
    assert sched.step_policy.name == "priority"
    assert sched.waiting.peek_request().request_id == "rt"  # RT first, whatever its arrival
    assert [r.request_id for r in sched.kv_holding_waiting] == ["held"]

    AntiphonScheduler.set_policy(sched, "bros")  # type: ignore[arg-type]
    assert sched.policy == SchedulingPolicy.FCFS
    assert [r.request_id for r in sched.waiting] == ["be-0", "be-1", "rt"]  # arrival order
    assert [r.request_id for r in sched.kv_holding_waiting] == ["held"]
    queue = sched.waiting
    AntiphonScheduler.set_policy(sched, "echo")  # type: ignore[arg-type]
    assert sched.waiting is queue  # same discipline: the queue stays as it is


def test_the_bookkeeping_after_a_step_counts_as_scheduler_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`sched_overhead_frac` left out the cost model's update and refit after each step
    (0.5-2.6% of a 28 ms step on this host), and schedule() calls that scheduled nothing."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from antiphon.engine_ext.schedstats import SchedulerStats

    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, out, runner: {})
    sched = object.__new__(AntiphonScheduler)
    sched.stats = SchedulerStats()
    sched._steps_in_flight = collections.deque([("shape", 0.0, 0.0)])
    sched._observe_step = lambda *_step: time.sleep(0.02)  # type: ignore[method-assign]
    sched._note_first_tokens = lambda _output: None  # type: ignore[method-assign]
    sched._tier_planner, sched.pages = None, None
    sched.update_from_output(SimpleNamespace(total_num_scheduled_tokens=4), None)  # type: ignore[arg-type]
    assert sched.stats.schedule_s >= 0.02
