"""`AntiphonScheduler`: vLLM's scheduler with Antiphon's decisions.

It runs inside vLLM's EngineCore process, installed through `scheduler_cls`, in one of two
forms with the same decisions: `AntiphonScheduler` extends vLLM's `Scheduler` for engines that
schedule synchronously (vLLM turns async scheduling off on the CPU backend, where running
`AsyncScheduler` synchronously was measured 9-19% slower), and `AntiphonAsyncScheduler` adds
`AsyncScheduler` for engines that overlap scheduling with execution (GPUs). vLLM's
mechanism stays (token budget, chunked prefill, page allocation, output handling); before each
step the policy's `StepPlan` is applied to vLLM's queues:

    preempt   running requests named by the plan give up their pages (RT takes from BE)
    order     running and waiting queues are reordered, most important first
    sit out   with a restrictive plan, requests not chosen leave the queues for this step
              and return right after it, keeping their pages

Every preempted token that has to be computed again is counted per request class, and each
measured step latency trains the cost model the policies predict with.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from antiphon.engine_ext import core_utilities  # noqa: F401  (adds its utility methods to EngineCore)
from antiphon.engine_ext.biblock_pool import PositionalPages
from antiphon.engine_ext.config import SchedulerSettings
from antiphon.engine_ext.costmodel import CostModel, StepShape
from antiphon.engine_ext.orphan import watch_parent
from antiphon.engine_ext.policies import make_policy
from antiphon.engine_ext.policies.prefix import leading_run
from antiphon.engine_ext.schedstats import SchedulerStats
from antiphon.engine_ext.steptrace import StepTrace
from antiphon.engine_ext.types import MAX_REQUEST_SLO_S, TIER_TOKENS_KEY, RequestClass
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan

# Under vLLM's logger tree, so the message shows in the EngineCore process's log.
logger = init_logger("vllm.antiphon.scheduler")

# A waiting request's remembered device prefix-cache hit is looked up in full again this often.
DEVICE_HIT_REFRESH_STEPS = 64
# The invariants are checked when the engine goes idle, at most this often: on a GPU pool of
# 10^5 pages a check takes tens of milliseconds, which a request arriving then would wait for.
IDLE_CHECK_INTERVAL_S = 60.0


def _slo_s(extra: dict[str, Any], key: str, default_s: float) -> float:
    """The request's own target `key` where it set one (at most `MAX_REQUEST_SLO_S`, as the
    server allows: a larger one overflowed the policies' planning), else `default_s`."""
    return min(extra.get(key, default_s), MAX_REQUEST_SLO_S)


def request_class_of(request: Request) -> RequestClass:
    return RequestClass.of_extra_args(
        request.sampling_params.extra_args if request.sampling_params else None)


class AntiphonScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # An engine core whose server was killed alone stops, aborting its requests: nobody
        # reads their output, and a drain (vLLM's on a signal, up to --drain-timeout-s) would
        # hold the SSD tier's lock that long from the server's restart.
        watch_parent(before_stop=self._abort_at_stop)
        self.settings = SchedulerSettings.from_additional_config(
            self.vllm_config.additional_config)
        self.cost_model = CostModel()
        self.step_policy = make_policy(self.settings.policy, self.cost_model)
        self.stats = SchedulerStats(cost_model_form=self.cost_model.form.name)
        self.page_tokens = self.cache_config.block_size
        self._lost_tokens: dict[str, int] = {}  # preempted, computed tokens not yet redone
        self._token_limits: dict[str, int] = {}  # the step's plan: most new tokens per request
        self._queue_order: dict[str, int] = {}  # the waiting queue's order before the plan's
        self._first_token_s: dict[str, float] = {}  # RT: when its first token was produced
        # Steps scheduled and not yet updated, oldest first, each (shape, when scheduled, KV
        # pool use then): one at a time when scheduling is synchronous; with async scheduling
        # vLLM schedules the next step before it updates from the last, and updates them in
        # order.
        self._steps_in_flight: collections.deque[tuple[StepShape, float, float]] = (
            collections.deque())
        self._last_step_done = 0.0  # when the last step's output was taken
        self._last_step_had_prefill = False  # of the last step scheduled
        self._trace = StepTrace(self.settings.step_trace) if self.settings.step_trace else None
        # Measured steps, [*shape fields, latency in seconds], while a profile records them.
        self._recorded_steps: list[list[float]] | None = None
        # The last step scheduled nothing although requests were queued: the policy's plan left
        # no request room (e.g. every page taken by RT turns that each need one more), so this
        # step is vLLM's own, which preempts to make progress.
        self._stalled = False
        # Tokens of a waiting request the KV tiers will load (Antiphon's connector), if any.
        self._stored_prefix_tokens = getattr(self.connector, "stored_prefix_tokens", None)
        # What the tiers served each request's prompt, where they did (`_say_tier_tokens`).
        self._tier_planner: Any = getattr(self.connector, "planner", None)
        self._tier_params: dict[str, dict[str, Any]] = {}
        # Waiting requests' device prefix-cache hits: (hashes, step, tokens) per request. A
        # hit can be checked at its ends alone where pages and hashes are one size, in one
        # KV cache group, with nothing sharding or dropping pages.
        self._device_hits: dict[str, tuple[int, int, int]] = {}
        self._last_idle_check_s = -math.inf
        self._can_probe_hits = (len(self.kv_cache_config.kv_cache_groups) == 1
                                and self.hash_block_size == self.block_size
                                and self.dcp_world_size == 1 and self.pcp_world_size == 1
                                and not self.use_eagle)
        # Bidirectional blocks: pages placed by position, preempted requests checkpointed to
        # the KV tiers (the connector) instead of recomputed.
        self.pages: PositionalPages | None = None
        self._checkpoint = self._checkpoint_cost = None
        if self.settings.biblocks:
            self.pages = PositionalPages(
                self.kv_cache_manager, self.settings.shared_block_pages,
                lambda request: request_class_of(request) is RequestClass.RT)
            self._checkpoint = getattr(self.connector, "checkpoint", None)
            self._checkpoint_cost = getattr(self.connector, "checkpoint_cost_pages", None)
            if self._checkpoint is None:
                logger.warning("bidirectional blocks without KV tiering: preempted requests "
                               "are recomputed, not checkpointed")
        logger.info("AntiphonScheduler installed (%s, policy %s)",
                    type(self).__name__, self.step_policy.name)

    def _abort_at_stop(self) -> None:
        """The engine's next stop aborts its requests (vLLM reads the timeout when a signal
        asks it to stop; 0: abort)."""
        self.vllm_config.shutdown_timeout = 0

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        started = time.perf_counter()
        sat_out: tuple[list[Request], list[Request]] = ([], [])
        preemptions = dict(self.stats.num_preemptions) if self._trace else {}
        fallback = self._stalled
        if self._stalled:
            self.stats.plan_fallbacks += 1
        elif self.running or self.waiting:
            views = self._views()
            plan = self.step_policy.plan(views, self._budget())
            sat_out = self._apply(plan)
            self._token_limits = plan.token_limits
        planned = time.perf_counter()
        # Requests sitting out keep their seats: vLLM admits only into the others.
        max_active = self.max_num_active_reqs
        self.max_num_active_reqs = min(max_active, self.max_num_running_reqs - len(sat_out[0]))
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs = max_active
            self._token_limits = {}
            self._rejoin(sat_out[0])
            if sat_out[1]:
                self._requeue(sat_out[1])
        self._count_recomputed(output)
        # Stalled: running requests and nothing scheduled, though one of them has no output
        # in flight. With async scheduling a step is empty, not stalled, while every running
        # request waits for its last token (taken for a stall, the next step ran without the
        # plan, its BE chunk limits with it, at the end of nearly every turn). Nor is it
        # while pages come back at the next step (vLLM's deferred frees: a victim of the plan
        # on a GPU with the KV connector, the turn it preempted for waiting for them): run
        # without the plan, the next step gave them to BE work and the turn no longer fit.
        self._stalled = not output.total_num_scheduled_tokens and not self.deferred_frees \
            and any(not r.num_output_placeholders for r in self.running)
        if output.total_num_scheduled_tokens:
            shape = self._shape_of(output)
            self._last_step_had_prefill = shape.num_prefill_tokens > 0
            scheduled = time.perf_counter()
            if not isinstance(self, AsyncScheduler):
                self._steps_in_flight.clear()  # one step at a time (none left by a failure)
                if self._trace is not None:
                    self._trace.drop_unfinished()
            usage = self.kv_cache_manager.block_pool.get_usage()
            self._steps_in_flight.append((shape, scheduled, usage))
            self.stats.record_step(planned - started, scheduled - started, usage)
            if self._trace is not None:
                self._trace_step(output, shape, planned - started, preemptions, fallback)
        else:
            self.stats.record_overhead(time.perf_counter() - started)
        return output

    def _rejoin(self, sat_out: list[Request]) -> None:
        """Running requests that sat the step out rejoin the queue, and the queue puts RT
        ahead of BE (each class in its order), after every step: vLLM's own preemption, in a
        step the plan left to it, takes from the tail, which must never be an RT turn while
        BE work runs (vLLM appends the turns it admits, behind the BE work running). The
        stock baselines keep vLLM's order (sorted, their preemptions spared RT turns)."""
        self.running += sat_out
        if self.step_policy.is_rt_first:  # stable: each class keeps its order
            self.running.sort(key=lambda r: request_class_of(r) is not RequestClass.RT)

    def _requeue(self, sat_out: list[Request]) -> None:
        """Waiting requests that sat the step out rejoin the waiting queue, and the queue
        takes back its order from before the plan's (requests vLLM queued in the step, such
        as those it preempted, ahead), RT ahead of BE: appended, they fell behind requests
        that arrived after them, and a step the plan leaves to vLLM seats in queue order."""
        queued = [*self.waiting, *sat_out]
        self.waiting.remove_requests(list(self.waiting))
        order = self._queue_order
        for request in sorted(queued, key=lambda r: (
                request_class_of(r) is not RequestClass.RT, order.get(r.request_id, -1))):
            self.waiting.add_request(request)

    def _trace_step(self, output: SchedulerOutput, shape: StepShape, plan_s: float,
                    preemptions_before: dict[str, int], fallback: bool) -> None:
        assert self._trace is not None
        scheduled = ((request_class_of(request), num_new, is_prefill)
                     for request, num_new, is_prefill in self._scheduled(output))
        self._trace.scheduled(
            time.time(), plan_s, self.cost_model.predict_s(shape), scheduled,
            map(request_class_of, self.waiting), map(request_class_of, self.running),
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            {c: n - preemptions_before[c] for c, n in self.stats.num_preemptions.items()
             if n > preemptions_before[c]}, fallback, shape)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> Any:
        started = time.perf_counter()
        if scheduler_output.total_num_scheduled_tokens and self._steps_in_flight:
            self._observe_step(*self._steps_in_flight.popleft())
        handled = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        resumed = time.perf_counter()
        self._note_first_tokens(scheduler_output)
        if self._tier_planner is not None:
            self._say_tier_tokens(outputs)
        # (the idle check below runs when no request waits: no step's overhead)
        self.stats.record_overhead(handled - started + time.perf_counter() - resumed)
        if self.pages is not None and not self.running and not self.waiting \
                and scheduler_output.total_num_scheduled_tokens:
            self._check_when_idle()
        return outputs

    def _observe_step(self, shape: StepShape, scheduled_s: float, kv_usage: float) -> None:
        """Train the cost model on a finished step: its time runs from when it was scheduled,
        or from when the step before it finished where that was later (with async scheduling
        a step is scheduled while the one before it still runs)."""
        done = time.perf_counter()
        latency = done - max(scheduled_s, self._last_step_done)
        self._last_step_done = done
        error = self.cost_model.observe(shape, latency)
        self.stats.record_step_latency(latency, kv_usage, error)
        if self._trace is not None:
            self._trace.finished(latency)
        self.stats.cost_model_mape = self.cost_model.mape
        self.stats.cost_model_calibration = self.cost_model.calibration
        if self._recorded_steps is not None:
            self._recorded_steps.append([*shape.to_list(), latency])

    def _note_first_tokens(self, output: SchedulerOutput) -> None:
        now = time.time()  # the clock of Request.arrival_time
        for rid in output.num_scheduled_tokens:
            request = self.requests.get(rid)
            # A finished request whose pages the KV connector still holds stays in
            # `requests` until they are freed: it is past needing its first token's time.
            if request is not None and request.num_output_tokens and \
                    not request.is_finished() and rid not in self._first_token_s:
                self._first_token_s[rid] = now

    def _say_tier_tokens(self, outputs: dict[int, Any]) -> None:
        """Every output of a request whose prompt the KV tiers served says how many tokens
        came from each (`TIER_TOKENS_KEY` in vLLM's `kv_transfer_params`, which the connector
        gives its last output): a reply that vLLM's front end ends itself (a stop string), and
        so aborts in the engine, gets no last output from here, and vLLM merges outputs that
        queue up into the newest."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.kv_transfer_params is not None:
                    continue
                params = self._tier_params.get(out.request_id)
                if params is None:
                    loads = self._tier_planner.served_from(out.request_id)
                    if loads is None:  # not admitted, or finished
                        continue
                    params = self._tier_params[out.request_id] = {
                        TIER_TOKENS_KEY: list(loads)}
                out.kv_transfer_params = params

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._tier_params.pop(request.request_id, None)
        self._first_token_s.pop(request.request_id, None)
        self._lost_tokens.pop(request.request_id, None)
        self._device_hits.pop(request.request_id, None)
        if self.pages is not None:
            self.pages.layout.forget_tails(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def check_integrity(self) -> list[str]:
        """The bidirectional-block invariants: page ownership and direction (the layout) and
        the preemption table against the KV tiers (the connector). Empty when they hold."""
        problems = [] if self.pages is None else self.pages.check_integrity()
        planner = getattr(self.connector, "planner", None)
        if planner is not None and hasattr(planner, "check_integrity"):
            problems += planner.check_integrity()
        return problems

    def _check_when_idle(self) -> None:
        """The engine just went idle: check the invariants (nothing running changes them),
        unless they were checked within `IDLE_CHECK_INTERVAL_S`."""
        now = time.monotonic()
        if now - self._last_idle_check_s < IDLE_CHECK_INTERVAL_S:
            return
        self._last_idle_check_s = now
        problems = self.check_integrity()
        if problems:
            self.stats.integrity_problems += len(problems)
            logger.error("bidirectional block integrity: %s", "; ".join(problems[:5]))

    def _scheduled(self, output: SchedulerOutput) -> Iterator[tuple[Request, int, bool]]:
        """(request, new tokens, is prefill) per request of the scheduled step."""
        for rid, num_new in output.num_scheduled_tokens.items():
            request = self.requests[rid]
            # vLLM has already advanced the computed tokens past the step
            before = request.num_computed_tokens - num_new
            yield request, num_new, num_new > 1 or before < request.num_prompt_tokens

    def _shape_of(self, output: SchedulerOutput) -> StepShape:
        """The scheduled step's composition (context counted after the step), with the KV
        connector's page copies that vLLM's schedule() just planned."""
        shape = StepShape(after_prefill=int(self._last_step_had_prefill),
                          page_copies=getattr(output.kv_connector_metadata, "num_page_copies", 0))
        for request, num_new, is_prefill in self._scheduled(output):
            shape = shape.plus(num_new, request.num_computed_tokens, is_prefill)
        return shape

    def _preempt_request(self, request: Request, timestamp: float,
                         drop_stale_output: bool = False) -> None:
        rid = request.request_id
        self._lost_tokens[rid] = max(self._lost_tokens.get(rid, 0), request.num_computed_tokens)
        self.stats.num_preemptions[request_class_of(request).value] += 1
        if self.pages is not None:
            self.pages.preempting(rid)
        if self._checkpoint is not None:
            self._checkpoint(request)  # before vLLM frees the pages: the copy goes first
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _views(self) -> list[RequestView]:
        """Views of the running requests and of the waiting ones vLLM would admit now: not
        those it skips this step (a grammar still compiling), which a plan could only seat,
        or take pages from BE work for, in vain."""
        return [self._view(r, is_running=True) for r in self.running] + [
            self._view(r, is_running=False) for r in self.waiting if not self._is_blocked(r)]

    def _is_blocked(self, request: Request) -> bool:
        """Whether vLLM skips waiting `request` this step (its `_handle_blocked_waiting_
        request`, without its side effects). A grammar that failed to compile is not: vLLM
        fails the request once it sees it."""
        status = request.status
        if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            wanted = request.structured_output_request
            return wanted is None or wanted.grammar is None
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return request.request_id not in self.finished_recving_kv_req_ids
        return status == RequestStatus.WAITING_FOR_STREAMING_REQ

    def _view(self, request: Request, is_running: bool) -> RequestView:
        cls = request_class_of(request)
        extra = request.sampling_params.extra_args or {} if request.sampling_params else {}
        is_rt = cls is RequestClass.RT
        settings = self.settings
        aim = 1.0 - settings.slo_headroom
        num_computed, num_restore = request.num_computed_tokens, 0
        shared = self._shared_pages(request) if is_running else ()
        num_shared = len(shared)
        # (only preempting BE frees pages: RT views need no holders)
        holders = () if is_rt else tuple(block.ref_cnt for block in shared)
        # A request asking for its prompt's logprobs computes its whole prompt: vLLM reads no
        # cached KV for it, the device's or the tiers' (`skip_reading_prefix_cache`).
        if not is_running and not request.skip_reading_prefix_cache:
            # What admission will find is not computed: pages still in the device's prefix
            # cache (a preempted request's, a shared prefix) and what the KV tiers will load. A
            # follow-up turn whose context is stored costs its new message, not its prompt.
            device = self._device_cached_tokens(request)
            num_shared = self._held_prefix_pages(request, device // self.block_size)
            num_computed = max(num_computed, device)
            if self._stored_prefix_tokens is not None:
                stored = self._stored_prefix_tokens(request)
                num_restore = max(0, stored - num_computed)
                num_computed = max(num_computed, stored)
        return RequestView(
            request_id=request.request_id,
            request_class=cls,
            arrival_s=request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=num_computed,
            # with async scheduling, the token of the step in flight too: the step planned
            # now makes the one after it (and is due a TPOT later); at least one of a step's
            # placeholders is a token (the rest are speculative drafts)
            num_output_tokens=request.num_output_tokens + min(request.num_output_placeholders, 1),
            is_running=is_running,
            # the targets the policy plans to, with the configured headroom kept in reserve
            ttft_slo_s=_slo_s(extra, "ttft_slo_s", settings.rt_ttft_slo_s) * aim if is_rt else None,
            tpot_slo_s=_slo_s(extra, "tpot_slo_s", settings.rt_tpot_slo_s) * aim if is_rt else None,
            priority=request.priority,
            num_preemptions=request.num_preemptions,
            num_restore_tokens=num_restore,
            first_token_s=self._first_token_s.get(request.request_id),
            checkpoint_pages=(self._checkpoint_cost(request) if is_running and not is_rt
                              and self._checkpoint_cost is not None else None),
            # read-only, no per-step copy; none for a waiting request that reads no cached KV
            prefix_page_hashes=() if not is_running and request.skip_reading_prefix_cache
            else request.block_hashes,
            num_shared_pages=num_shared,
            shared_page_holders=holders,
            frees_pages_late=is_running and not self._request_blocks_can_be_freed(request),
        )

    def _held_prefix_pages(self, request: Request, num_pages: int) -> int:
        """Of the first `num_pages` pages of waiting `request`'s device prefix hit, those
        running requests hold (admission takes them without allocating). They lead the hit:
        a request holding a page holds the pages before it (the hashes chain), so a
        bisection finds them."""
        hashes, pool = request.block_hashes, self.kv_cache_manager.block_pool

        def is_held(page: int) -> bool:
            blocks = pool.get_cached_block(hashes[page], [0])
            return blocks is not None and blocks[0].ref_cnt > 0
        return leading_run(min(num_pages, len(hashes)), is_held)

    def _shared_pages(self, request: Request) -> Sequence[KVCacheBlock]:
        """The pages of running `request` another request holds too (a preemption of it does
        not give them back): its leading pages, as for `_held_prefix_pages`."""
        blocks = self.kv_cache_manager.coordinator.get_blocks(request.request_id)[0]
        return blocks[:leading_run(len(blocks), lambda page: blocks[page].ref_cnt > 1)]

    def _device_cached_tokens(self, request: Request) -> int:
        """Prompt tokens of a waiting request in the device's prefix cache: a lookup of its
        page hashes, without vLLM's hit counters (admission counts the real hit).

        vLLM's lookup walks every cached page of the request (0.5 ms per 1,000 pages), and
        this runs per waiting request per step. So the hit is remembered: while the request's
        hashes are the same, the page at the hit's end still cached and the one after it not,
        the hit stands (an estimate; a full lookup every `DEVICE_HIT_REFRESH_STEPS` steps)."""
        hashes = request.block_hashes
        if not self.cache_config.enable_prefix_caching or not hashes:
            return 0
        step = self.stats.num_steps
        memo = self._device_hits.get(request.request_id)
        if memo is not None and self._can_probe_hits and memo[0] == len(hashes) \
                and step - memo[1] < DEVICE_HIT_REFRESH_STEPS:
            num_pages = memo[2] // self.block_size
            max_pages = (request.num_tokens - 1) // self.block_size
            pool = self.kv_cache_manager.block_pool
            if (num_pages == 0 or pool.get_cached_block(hashes[num_pages - 1], [0])) and (
                    num_pages >= min(max_pages, len(hashes))
                    or not pool.get_cached_block(hashes[num_pages], [0])):
                return memo[2]
        num_tokens = self.kv_cache_manager.coordinator.find_longest_cache_hit(
            hashes, request.num_tokens - 1)[1]
        self._device_hits[request.request_id] = (len(hashes), step, num_tokens)
        return num_tokens

    def _budget(self) -> StepBudget:
        return StepBudget(
            now_s=time.time() + self._in_flight_s(),  # the clock of Request.arrival_time
            max_num_seqs=self.max_num_running_reqs,
            max_num_tokens=self.max_num_scheduled_tokens,
            num_free_pages=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_total_pages=self.kv_cache_manager.block_pool.num_gpu_blocks,
            page_tokens=self.page_tokens,
            max_be_step_s=self.settings.be_step_limit_s,
            after_prefill=self._last_step_had_prefill,
            num_pages_next_step=self._deferred_free_pages(),
        )

    def _deferred_free_pages(self) -> int:
        """Pages vLLM's deferred frees return to the free pool once the step in flight is
        processed (those no other request holds)."""
        return sum(1 for _, blocks in self.deferred_frees for block in blocks
                   if block.ref_cnt == 1 and not block.is_null)

    def _in_flight_s(self) -> float:
        """How long until the steps in flight are predicted to end (seconds): with async
        scheduling (a GPU's) the step planned now starts only then. Planned as if it started
        now, a step saw a whole step more of slack, filled it with BE work, and an RT
        token came up to a step late (0.44 s apart at a 0.1 s TPOT; found by a review)."""
        if not self._steps_in_flight:
            return 0.0
        end = self._last_step_done
        for shape, scheduled_s, _ in self._steps_in_flight:
            end = max(end, scheduled_s) + self.cost_model.predict_s(shape)
        return max(0.0, end - time.perf_counter())

    def _apply(self, plan: StepPlan) -> tuple[list[Request], list[Request]]:
        """Apply `plan` to vLLM's queues; returns (running, waiting) requests sitting out."""
        now = time.monotonic()
        for rid in plan.preempt:
            request = self.requests.get(rid)
            if request is not None and request in self.running:
                self.running.remove(request)
                self._preempt_request(request, now)
        if not plan.order and not plan.is_restrictive:
            return [], []
        rank = plan.rank()
        last = len(rank)
        running = sorted(self.running, key=lambda r: rank.get(r.request_id, last))
        if plan.is_restrictive:
            self._queue_order = {r.request_id: i for i, r in enumerate(self.waiting)}
        waiting = sorted(self.waiting, key=lambda r: rank.get(r.request_id, last))
        self.waiting.remove_requests(list(self.waiting))
        if plan.is_restrictive:
            self.running = [r for r in running if r.request_id in rank]
            sat_out = ([r for r in running if r.request_id not in rank],
                       [r for r in waiting if r.request_id not in rank])
            waiting = [r for r in waiting if r.request_id in rank]
            waiting = self._seat_rt(waiting, sat_out, now)
        else:
            self.running, sat_out = running, ([], [])
        for request in waiting:
            self.waiting.add_request(request)
        return sat_out

    def _seat_rt(self, admitted: list[Request],
                 sat_out: tuple[list[Request], list[Request]], now: float) -> list[Request]:
        """The plan's waiting requests that get a seat this step, in order.

        Running requests that sit a step out keep their seats (vLLM's `max_num_seqs`), so the
        plan's waiting requests get only the seats left, in the plan's order. An RT request
        beyond them takes the seat of a BE request sitting out, else of one the plan runs
        (an RT request sitting out on time kept the seat an urgent one needed, while BE work
        ran in the other), which is preempted (RT takes from BE, never the reverse;
        checkpointed with bidirectional blocks). The others sit the step out too: vLLM seats
        in queue order, so one left queued would take the seat an RT request behind it was
        given."""
        sitting_out, waiting_out = sat_out
        free = self.max_num_running_reqs - len(self.running) - len(sitting_out)
        seated = []
        for request in admitted:
            if self._is_blocked(request):  # vLLM skips it: it needs no seat this step
                waiting_out.append(request)
                continue
            if free <= 0 and request_class_of(request) is RequestClass.RT:
                victim = None
                for seats in (sitting_out, self.running):
                    be = [r for r in seats if request_class_of(r) is not RequestClass.RT]
                    if be:
                        victim = min(be, key=lambda r: r.num_computed_tokens)  # least to keep
                        seats.remove(victim)
                        break
                if victim is not None:
                    self.stats.seat_preemptions += 1
                    self._preempt_request(victim, now)
                    self.waiting.remove_request(victim)  # vLLM queued it: it sits out
                    waiting_out.append(victim)
                    free += 1
            if free > 0:
                free -= 1
                seated.append(request)
            else:
                waiting_out.append(request)
        return seated

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """vLLM's last cut of a request's new tokens in `schedule()`, for running and waiting
        requests alike, after the token budget's: here also the policy's chunk for the request
        (`StepPlan.token_limits`). Capping only the step's total, as before, chunked a limited
        request right only when it came last: vLLM fills requests in order, so an RT prefill
        chunk seated before decodes took their tokens and they sat the step out (in a
        40-second `bros` run at 3 turns/s on a 2-core CPU: 62 RT and 27 BE decodes and 301 RT
        prefill chunks planned but not run)."""
        limit = self._token_limits.get(request.request_id)
        if limit is not None and request.num_tokens - num_computed_tokens > 1:
            # (not a decode: its tokens past the one are drafts, or the padding vLLM gives a
            # decode it seats to a uniform speculative size, which it asserts is kept)
            num_new_tokens = min(num_new_tokens, limit)
        # vLLM's cut after the policy's: a chunk must not end within a multi-module drafter's
        # lookahead of the prompt's end (cut after it, the limit could end it there)
        return super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)

    def _count_recomputed(self, output: SchedulerOutput) -> None:
        """Charge each scheduled position below a preempted request's old progress as
        recomputed; positions the prefix cache supplied are skipped and not charged."""
        for rid, num_scheduled in output.num_scheduled_tokens.items():
            lost_upto = self._lost_tokens.get(rid)
            if lost_upto is None:
                continue
            request = self.requests[rid]
            end = request.num_computed_tokens  # already advanced past this step
            start = end - num_scheduled
            redo = max(0, min(end, lost_upto) - start)
            self.stats.recomputed_tokens[request_class_of(request).value] += redo
            if end >= lost_upto:
                del self._lost_tokens[rid]

    def set_policy(self, name: str) -> None:
        """Switch the policy between steps (the cost model and counters carry over). A
        policy that runs on another of vLLM's queue disciplines (`priority` on its priority
        queue, the others on first come first served) gets its queues, with the requests
        waiting in them: vLLM picks victims by the discipline too."""
        self.step_policy = make_policy(name, self.cost_model)
        discipline = SchedulingPolicy(self.step_policy.vllm_scheduling_policy)
        if discipline != self.policy:
            self.policy = discipline
            self.waiting = self._requeued(self.waiting)
            self.kv_holding_waiting = self._requeued(self.kv_holding_waiting)
        logger.info("AntiphonScheduler policy is now %s", name)

    def _requeued(self, queue: Any) -> Any:
        """A queue of the current discipline holding `queue`'s requests (in arrival order,
        where the discipline is first come first served)."""
        fresh = create_request_queue(self.policy)
        for request in sorted(queue, key=lambda r: r.arrival_time):
            fresh.add_request(request)
        return fresh

    def use_cost_model(self, form: str, coefficients: list[float],
                       profiled_mape: float | None) -> None:
        """Predict with a profiled fit from now on (online refits go on from it)."""
        self.cost_model.use(form, coefficients)
        self.stats.cost_model_form = form
        self.stats.cost_model_profiled_mape = profiled_mape
        self.stats.cost_model_mape = None
        logger.info("AntiphonScheduler cost model: %s form, profiled MAPE %s", form,
                    "n/a" if profiled_mape is None else f"{profiled_mape:.1%}")

    def take_recorded_steps(self, record: bool) -> list[list[float]]:
        """The steps measured since the last call, each [*StepShape fields, latency (s)];
        records from now on when `record`, else stops."""
        taken = self._recorded_steps or []
        self._recorded_steps = [] if record else None
        return taken

    def reset_counters(self) -> None:
        """Counters from zero, the bidirectional blocks' too; the cost model's fields stay
        what they are."""
        self.stats = self.stats.reset()
        if self.pages is not None:
            self.pages.layout.reset_counters()

    def antiphon_stats(self) -> dict[str, Any]:
        return self.stats.snapshot(num_waiting=len(self.waiting), num_running=len(self.running),
                                   queues={"waiting": _by_class(self.waiting),
                                           "running": _by_class(self.running)},
                                   policy=self.step_policy.name,
                                   batch_size=getattr(self.step_policy, "batch_size", None),
                                   biblocks=None if self.pages is None else self.pages.stats())


def _by_class(requests: Iterable[Request]) -> dict[str, int]:
    """How many of `requests` are of each class."""
    counts = collections.Counter(map(request_class_of, requests))
    return {c.value: counts[c] for c in RequestClass}


class AntiphonAsyncScheduler(AntiphonScheduler, AsyncScheduler):
    """The same decisions over vLLM's `AsyncScheduler` (MRO: Antiphon, Async, Scheduler)."""
