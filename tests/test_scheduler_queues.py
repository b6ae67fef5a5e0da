"""Switching policies at run time puts waiting requests on the new policy's vLLM queue."""

from __future__ import annotations

from types import SimpleNamespace

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
