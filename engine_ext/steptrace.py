"""A per-step trace of the scheduler's decisions, for diagnosing latency (`--step-trace FILE`).

One JSON line per scheduled step, written when the step's output arrives:

    t         wall-clock time the step was scheduled (seconds, time.time())
    lat_s     measured step latency, schedule to output (seconds)
    pred_s    the cost model's prediction for the step's shape (seconds)
    plan_s    time in the policy's plan (seconds)
    rt, be    per class: [prefill requests, prefill tokens, decode requests]
    waiting   per class: requests left waiting after the step was scheduled
    running   per class: requests running after the step was scheduled
    free      free KV pages after scheduling
    copies    KV pages the connector copies in the step, once per layer (0 without tiering)
    preempted per class: requests preempted while scheduling this step
    fallback  the step was vLLM's own (the policy's plan had stalled)
    shape     the step's StepShape as a list (`StepShape.to_list`), what the cost model saw
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable
from typing import IO, Any

from antiphon.engine_ext.stepshape import StepShape
from antiphon.engine_ext.types import RequestClass


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered, engine life)
        # Records of the steps scheduled and not finished yet, oldest first: with async
        # scheduling (a GPU's) step N + 1 is scheduled before step N finishes.
        self._pending: collections.deque[dict[str, Any]] = collections.deque()

    def scheduled(self, t: float, plan_s: float, predicted_s: float,
                  scheduled: Iterable[tuple[RequestClass, int, bool]],
                  waiting: Iterable[RequestClass], running: Iterable[RequestClass],
                  free_pages: int, preempted: dict[str, int], fallback: bool,
                  shape: StepShape) -> None:
        """A step was scheduled: `scheduled` holds (class, new tokens, is prefill) per
        request. The record is written when `finished` gives its latency."""
        phases = {c.value: [0, 0, 0] for c in RequestClass}
        for cls, num_new, is_prefill in scheduled:
            row = phases[cls.value]
            if is_prefill:
                row[0] += 1
                row[1] += num_new
            else:
                row[2] += 1
        self._pending.append({"t": round(t, 4), "plan_s": round(plan_s, 6),
                              "pred_s": round(predicted_s, 4), **phases,
                              "waiting": _count(waiting), "running": _count(running),
                              "free": free_pages, "copies": shape.page_copies,
                              "preempted": preempted, "fallback": fallback,
                              "shape": shape.to_list()})

    def finished(self, latency_s: float) -> None:
        """The oldest step scheduled and not finished has finished, in `latency_s`."""
        if not self._pending:
            return
        record = self._pending.popleft()
        record["lat_s"] = round(latency_s, 4)
        self._file.write(json.dumps(record) + "\n")

    def drop_unfinished(self) -> None:
        """Forget the steps scheduled and never finished (a step that failed)."""
        self._pending.clear()


def _count(classes: Iterable[RequestClass]) -> dict[str, int]:
    counts = {c.value: 0 for c in RequestClass}
    for cls in classes:
        counts[cls.value] += 1
    return counts

