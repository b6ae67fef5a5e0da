"""The step trace (`--step-trace`): each step's record carries its own latency."""

from __future__ import annotations

import json
from pathlib import Path

from antiphon.engine_ext.stepshape import StepShape
from antiphon.engine_ext.steptrace import StepTrace

PREFILL, DECODE = StepShape.of([(100, 100, True)]), StepShape.of([(1, 101, False)])


def schedule(trace: StepTrace, shape: StepShape) -> None:
    trace.scheduled(0.0, 0.0, 0.01, [], [], [], 0, {}, False, shape)


def rows(path: Path) -> list[tuple[list[int], float]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["shape"], r["lat_s"]) for r in records]


def test_overlapped_steps_each_get_their_own_latency(tmp_path: Path) -> None:
    # Async scheduling (a GPU's): step N + 1 is scheduled before step N finishes. One pending
    # record lost N's and wrote N + 1 with N's latency (found by a review).
    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    schedule(trace, PREFILL)
    schedule(trace, DECODE)
    trace.finished(0.05)
    trace.finished(0.01)
    assert rows(tmp_path / "steps.jsonl") == [(PREFILL.to_list(), 0.05),
                                              (DECODE.to_list(), 0.01)]


def test_a_step_that_never_finished_is_dropped(tmp_path: Path) -> None:
    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    schedule(trace, PREFILL)  # its step failed: no output
    trace.drop_unfinished()
    schedule(trace, DECODE)
    trace.finished(0.01)
    assert rows(tmp_path / "steps.jsonl") == [(DECODE.to_list(), 0.01)]
