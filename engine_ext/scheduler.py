"""`AntiphonScheduler`: the vLLM scheduler subclass Antiphon's decisions grow into.

It runs inside vLLM's EngineCore process, installed through `scheduler_cls`. It subclasses
`AsyncScheduler` (not `Scheduler`) so engines that overlap scheduling with execution keep doing
so. Today it keeps vLLM's decisions and measures what they cost; the RT/BE policies replace the
decisions without changing this class's place in the engine.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput

# Under vLLM's logger tree, so the message shows in the EngineCore process's log.
logger = init_logger("vllm.antiphon.scheduler")


class SchedulerTimer:
    """Running totals of time spent inside `schedule()` (seconds) and the steps counted."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def record(self, elapsed_s: float) -> None:
        self.num_steps += 1
        self.total_s += elapsed_s
        self.max_s = max(self.max_s, elapsed_s)

    @property
    def mean_s(self) -> float:
        return self.total_s / self.num_steps if self.num_steps else 0.0


class AntiphonScheduler(AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timer = SchedulerTimer()
        logger.info("AntiphonScheduler installed (%s)", type(self).__mro__[1].__name__)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        started = time.perf_counter()
        output = super().schedule(throttle_prefills)
        if output.total_num_scheduled_tokens:
            self.timer.record(time.perf_counter() - started)
        return output
