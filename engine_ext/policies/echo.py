"""Echo: BE work chosen by (benefit - punishment) / time of the step (sections 3 to 5).

Benefit is the tokens a step processes (Eq. 1). Punishment is the KV of evicted BE requests,
which must be computed again (Eq. 2: a victim's `num_computed_tokens`), plus
`late_token_penalty` benefit tokens for each RT token whose deadline the step's predicted
latency overruns (Eq. 3's SLO constraint, made a price). Each step:
1. RT requests, running then waiting, in arrival order (Echo keeps online work FCFS), running
   decodes before prefills. An RT prefill computes the chunk that keeps the step within the
   batch SLO (Eq. 3: the least time any RT request seated before it is due in), but at least
   the chunk that still meets its own TTFT (`ttft_floor`), and the oldest at least
   `min_prefill_tokens` (one arriving turn, seated whole, made every stream late: 0.55 s at
   3,000 tokens on a 2-core CPU; found by a review). An RT request short of pages evicts the
   running BE request whose eviction costs least (Eq. 4 with nothing else changed: the
   fewest computed tokens to redo).
2. Running BE requests (the last batch, Echo's starting point) stay in the step, best marginal
   (benefit - punishment) / time first, while that net is positive; those that would push an
   RT token late sit the step out keeping their pages ("evict to fit tight SLOs").
3. Waiting BE requests are added the same way, preempted ones first (not in the paper: ranked
   with fresh ones, a resumed decode starved). Prompt pages that running requests hold count
   as benefit at no time (KV-aware batching, Fig. 4b). They only take free pages beyond a burst
   headroom left for arriving RT requests (4.2): the larger of `headroom_fraction` of the pool
   and the RT pages predicted as mean + `burst_sigmas` standard deviations of those observed
   over the last `window_steps` steps (5.3), less the pages RT holds now. The paper takes two
   standard deviations because an RT burst that evicts BE requests makes them recompute
   their KV. Where evictions are checkpointed (bidirectional blocks: running BE views carry
   `checkpoint_pages`), an eviction costs a copy to the host tier instead, and the reserve
   is `checkpointed_burst_sigmas` (default 0: the mean). Measured at 3 turns/s on a 2-core
   CPU, two standard deviations left 28 of 64 pages free on average and kept 58% of fcfs's
   BE throughput; the mean kept 90%, with RT TTFT attainment still 1.0 and no BE token
   recomputed (docs/benchmarks.md).
4. The time headroom beside the memory one (not in the paper): BE work keeps each step within
   the arrival guard `StepBudget.max_be_step_s`, a BE prefill cut to the chunk that fits, so a
   turn arriving during the step waits at most that long to start. A prefill's chunk also
   keeps every seated RT token on time (cut to the least time one is due in): priced whole,
   one that would have made a token late got nothing, where a smaller chunk fitted.
Echo rescans every candidate after each addition; here candidates are ranked once by their own
marginal ratio, as a request's marginal time in a linear cost model does not depend on the
batch: O(n log n) per step instead of O(n^2). Requests not chosen keep their pages.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.policies.base import (
    Policy,
    admission_pages,
    new_pages,
    pages_for,
    tokens_within_pages,
)
from antiphon.engine_ext.policies.prefix import ResidentPrefixes
from antiphon.engine_ext.policies.stepbatch import StepBatch, Victims, ttft_floor
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan


class EchoPolicy(Policy):
    name = "echo"

    def __init__(self, cost_model: CostModel, headroom_fraction: float = 0.1,
                 burst_sigmas: float = 2.0, window_steps: int = 4096,
                 late_token_penalty: float = 1e6,
                 checkpointed_burst_sigmas: float = 0.0, min_prefill_tokens: int = 16) -> None:
        super().__init__(cost_model)
        self._resident = ResidentPrefixes()  # pages the running requests hold, kept across steps
        if not 0.0 <= headroom_fraction < 1.0 or burst_sigmas < 0 or window_steps < 1 \
                or checkpointed_burst_sigmas < 0:
            raise ValueError("need 0 <= headroom_fraction < 1, burst_sigmas >= 0, "
                             "checkpointed_burst_sigmas >= 0, window_steps >= 1")
        self.headroom_fraction = headroom_fraction  # of the KV pool, kept for RT bursts
        self.burst_sigmas = burst_sigmas  # where an evicted BE request recomputes
        self.checkpointed_burst_sigmas = checkpointed_burst_sigmas  # where it is checkpointed
        # Whether evictions are checkpointed, as the last running BE request showed (the
        # engine's setting: it does not change while the policy runs).
        self._evictions_checkpointed = False
        self.late_token_penalty = late_token_penalty  # benefit tokens one late RT token costs
        self.min_prefill_tokens = min_prefill_tokens  # the oldest RT prefill's progress a step
        self._rt_pages: collections.deque[int] = collections.deque(maxlen=window_steps)
        self._rt_pages_sum = 0  # of the window, for its mean (pages)
        self._rt_pages_sum_sq = 0  # of the window, for its variance (pages^2)

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        reserve = self.headroom_pages(views, budget)
        rts = sorted((v for v in views if v.is_rt),
                     key=lambda v: (not v.is_running, v.is_prefill, v.arrival_s))
        bes = sorted((v for v in views if not v.is_rt), key=lambda v: v.arrival_s)
        batch = StepBatch(budget, self.cost_model)
        plan = StepPlan(is_restrictive=True)
        is_rt_short = self._add_rt(rts, bes, batch, plan, budget.now_s)
        batch.keep_free_pages()
        seated = set(batch.ids)
        # `due_in_s`: a token already late carried no punishment, and BE work stretched its
        # step without limit (to 1 s in a review).
        rt_slacks = sorted(v.due_in_s(budget.now_s) for v in rts if v.request_id in seated)
        evicted = set(plan.preempt)
        # (not the requests evicted for RT ones: their pages go back to the pool)
        resident = self._resident.update(
            [v for v in views if v.request_id not in evicted], budget.page_tokens)
        running = [v for v in bes if v.is_running and v.request_id not in evicted]
        self._add_be(running, batch, rt_slacks, resident, 0, budget.max_be_step_s)
        # Preempted requests before those not yet started: ranked together by benefit per
        # second, a resumed decode (a token a step) came last, and waited for as long as a
        # batch had fresh items to start. One short of pages keeps the fresh ones off the
        # pages it waits for while running requests can free them (they took each page as it
        # freed, and a request resuming with its whole context never got in).
        can_pages_free = any(v.is_running for v in views)
        # Nor do they start on the pages a waiting RT turn waits for (not in the paper: fresh
        # items took each page as it freed while the turns queued behind it by FCFS waited).
        for resuming in () if is_rt_short and can_pages_free else (True, False):
            waiting = [v for v in bes if not v.is_running and (v.num_preemptions > 0) == resuming]
            is_short = self._add_be(waiting, batch, rt_slacks, resident, reserve,
                                    budget.max_be_step_s)
            if resuming and is_short and can_pages_free:
                break
        plan.order = batch.ids
        plan.token_limits = batch.token_limits
        return plan

    def headroom_pages(self, views: Sequence[RequestView], budget: StepBudget) -> int:
        """Free pages BE admissions leave for arriving RT requests; records the pages RT
        requests hold now into the window the burst prediction is taken over."""
        page_tokens = budget.page_tokens
        held = rt_held = 0
        # Pages RT requests share (a system prompt) count once: counted per turn, 4 to 8
        # turns over a 60-page prompt kept BE work off 359 pages for a 28-page burst (found by
        # a review). Without their hashes, the most any request shares is the least they can
        # be.
        shared: set[bytes] = set()
        most_shared = 0
        for view in views:
            if view.is_running:
                pages = pages_for(view.num_computed_tokens, page_tokens)
                held += pages
                if view.is_rt:
                    rt_held += max(0, pages - view.num_shared_pages)
                    shared.update(view.prefix_page_hashes[:view.num_shared_pages])
                    most_shared = max(most_shared, view.num_shared_pages)
                else:
                    self._evictions_checkpointed = view.checkpoint_pages is not None
        rt_held += max(len(shared), most_shared)
        total = budget.num_total_pages or budget.num_free_pages + held
        if len(self._rt_pages) == self._rt_pages.maxlen:
            oldest = self._rt_pages[0]
            self._rt_pages_sum -= oldest
            self._rt_pages_sum_sq -= oldest * oldest
        self._rt_pages.append(rt_held)
        self._rt_pages_sum += rt_held
        self._rt_pages_sum_sq += rt_held * rt_held
        n = len(self._rt_pages)
        mean = self._rt_pages_sum / n
        std = math.sqrt(max(0.0, self._rt_pages_sum_sq / n - mean * mean))
        sigmas = (self.checkpointed_burst_sigmas if self._evictions_checkpointed
                  else self.burst_sigmas)
        burst = math.ceil(mean + sigmas * std) - rt_held
        return min(total, max(0, math.ceil(self.headroom_fraction * total), burst))

    def _add_rt(self, rts: list[RequestView], bes: list[RequestView], batch: StepBatch,
                plan: StepPlan, now_s: float) -> bool:
        """Step 1: RT requests in FCFS order, decodes first, a prefill's chunk within the
        batch SLO (`_rt_chunk`), evicting the cheapest running BE for pages. Returns whether
        a waiting one was left out for want of pages."""
        victims = Victims(sorted((v for v in bes if v.is_running),
                                 key=lambda v: v.num_computed_tokens), batch.page_tokens,
                          kept=rts, pages_next_step=batch.pages_next_step)
        is_short = is_deferred = False
        due_in_s = math.inf  # the least time an RT request seated so far is due in
        num_prefills = 0
        for view in rts:
            if batch.is_full:
                return is_short
            if is_deferred and not view.is_running:
                continue  # one ahead waits for pages the next step brings: none takes them
            new = min(view.num_new_tokens, batch.tokens_left)
            if view.is_prefill:
                new = self._rt_chunk(view, new, batch, due_in_s, now_s, num_prefills == 0)
                num_prefills += 1
            pages = new_pages(view, new, batch.page_tokens)
            # vLLM admits a waiting request only where its whole sequence fits
            needed = admission_pages(view, pages, batch.page_tokens)
            available = batch.pages_left + victims.num_pages
            if needed > available and view.is_running and view.is_prefill:
                # a running prefill computes the chunk the pages allow (left out, it waited
                # while BE work that needed no new page ran every step)
                new = tokens_within_pages(view, new, available, batch.page_tokens)
                pages = needed = new_pages(view, new, batch.page_tokens)
            if new <= 0 or needed > available:  # evicting all BE would not do
                is_short = is_short or (new > 0 and not view.is_running)
                if not view.is_running and batch.ids:
                    return is_short  # FCFS: a waiting RT request that cannot start holds
                continue  # those behind
            if victims.take_until(needed, batch, plan):
                batch.add(view, new, pages)
                due_in_s = min(due_in_s, view.due_in_s(now_s))
                continue
            is_short = is_deferred = True  # its pages come at the next step
        return is_short

    def _rt_chunk(self, view: RequestView, wanted: int, batch: StepBatch, due_in_s: float,
                  now_s: float, is_oldest: bool) -> int:
        """The tokens of RT prefill `view` (of `wanted`) the step takes: within `due_in_s`
        (the batch SLO of the RT requests seated before it), but at least its TTFT floor
        over steps of one TPOT target, and the oldest prefill `min_prefill_tokens`."""
        if due_in_s == math.inf:
            return wanted
        within = batch.tokens_within(view, due_in_s, wanted)
        if within >= wanted:
            return wanted
        floor = ttft_floor(view, batch, view.tpot_slo_s or due_in_s, now_s)
        if is_oldest:
            floor = max(floor, self.min_prefill_tokens)
        return max(within, min(wanted, floor))

    def _add_be(self, candidates: list[RequestView], batch: StepBatch, rt_slacks: list[float],
                resident: ResidentPrefixes, reserve: int, limit_s: float) -> bool:
        """Steps 2 and 3: add `candidates` best marginal (benefit - punishment) / time first
        while the net is positive, leaving `reserve` pages free (unless the step is empty), a
        prefill cut to the chunk that keeps the step within `limit_s` (the arrival guard).
        Returns whether one of them was left out for want of pages."""
        base_s = batch.time_s()
        is_short = False
        ranked = []
        for view in candidates:
            cached = resident.num_cached_tokens(view)
            new = min(view.num_new_tokens - cached, batch.tokens_left)
            if new <= 0:
                continue
            time_s = batch.time_s(new, view.num_computed_tokens + cached + new, view.is_prefill)
            net = new + cached - self._punishment(rt_slacks, base_s, time_s)
            rate = net / (time_s - base_s) if time_s > base_s else math.copysign(math.inf, net)
            ranked.append((-rate, view.arrival_s, view.request_id, view, cached))
        ranked.sort(key=lambda r: r[:3])
        for _, _, _, view, cached in ranked:
            if batch.is_full:
                return is_short
            # A prefill within the least time a seated RT token is due in that the step does
            # not overrun already: the chunk that fits (a decode, which cannot be cut, is
            # priced below; past every due time, as with streams behind their pace, tokens
            # already late are not punished, and the chunk is the arrival guard's: cut to
            # the least of them, BE prefills got nothing while RT was overloaded)
            fits_s = limit_s
            if rt_slacks and view.is_prefill:
                ahead = bisect.bisect_right(rt_slacks, batch.time_s())
                if ahead < len(rt_slacks):
                    fits_s = min(limit_s, rt_slacks[ahead])
            new, pages, is_short_of_pages = batch.max_chunk(view, fits_s, cached,
                                                            first_tokens=batch.page_tokens)
            room = batch.pages_left - (reserve if batch.ids else 0)
            if is_short_of_pages or pages > room:
                is_short = is_short or new > 0 or is_short_of_pages
                # (but a running prefill computes the chunk the pages allow: left out whole,
                # a step of only such requests was empty, and vLLM's own step preempted one)
                if not (view.is_running and new > 0 and pages <= room):
                    continue
            if new <= 0:
                continue
            if rt_slacks:  # else nothing is punished: the net is the tokens, positive
                before_s = batch.time_s()
                end = view.num_computed_tokens + cached + new
                after_s = batch.time_s(new, end, view.is_prefill)
                if new + cached - self._punishment(rt_slacks, before_s, after_s) <= 0:
                    continue
            batch.add(view, new, pages, num_cached_tokens=cached)
        return is_short

    def _punishment(self, rt_slacks: list[float], before_s: float, after_s: float) -> float:
        """Benefit tokens lost to RT tokens a step growing from `before_s` to `after_s`
        (seconds) newly makes late (RT slacks sorted, seconds)."""
        newly_late = (bisect.bisect_left(rt_slacks, after_s)
                      - bisect.bisect_left(rt_slacks, before_s))
        return self.late_token_penalty * newly_late if newly_late > 0 else 0.0
