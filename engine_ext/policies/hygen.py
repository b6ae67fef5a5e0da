"""HyGen two-phase SLO-aware scheduling (Algorithms 1 and 3), with prefix-sharing maximisation.

Each step has one latency budget `L`: a profiled `latency_budget_s`, or else the tightest TPOT SLO
among RT requests times `budget_fraction` (no RT request: no time limit). The cost model
predicts the step as it grows.
1. Online phase (Algorithm 1), RT requests in arrival order: running decodes join while the step
   stays within `L` (a late one past it, not in the paper); then prefills (running, then
   waiting) each get the largest chunk within `L`, the token budget and memory
   (`get_max_prefill`), but at least the chunk that still meets its TTFT (`ttft_floor`, not
   in the paper). An RT request short of pages takes them from
   running BE requests, least important (highest `priority`) and newest first. A prefill that
   gets no chunk ends the phase. Prefill chunks are sized to `L` less what the running BE
   decodes will cost (not in the paper; the TTFT floor is not cut): a decode costs about a
   millisecond, its pages are held whether it runs or not, and a BE request that sits out a
   step holds them one step longer. Measured at 3 turns/s on a 2-core CPU, RT prefills that
   filled `L` left 28% of steps with every BE decode sitting out.
2. Offline phase (Algorithm 3), on what is left of `L` (and of the least time a seated RT
   token is due in, not in the paper): running BE requests in arrival order,
   decodes before prefills (not in the paper: a prefill chunk fills the budget, and decodes
   after it would sit out holding their pages), then waiting BE requests, each taken either
   from the depth-first order of the prefix tree over their page hashes (prefix-sharing
   requests back to back) or, against starvation, oldest first; a share `utility` of picks
   comes from the tree. BE requests only use free pages. A request that gets no chunk ends the
   phase. The phase also keeps the step within the arrival guard `StepBudget.max_be_step_s`
   (not in the paper), so with no RT request present a step is not unbounded and a turn
   arriving meanwhile waits at most that long to start.
The first request of a step always gets its chunk, and while a step is empty a request that gets
none is skipped rather than ending a phase, so the engine never idles when something fits.
Requests not chosen sit the step out and keep their pages; prefill chunks cut short are returned
as `token_limits`. The paper draws tree or freshness at random with probability `utility`; here
the draw is a deterministic running quota (a tree pick whenever tree picks so far are below
`utility` times all picks), kept across steps, so the share is exact and plans reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.policies.base import Policy, admission_pages, new_pages
from antiphon.engine_ext.policies.prefix import ResidentPrefixes, dfs_order
from antiphon.engine_ext.policies.stepbatch import StepBatch, Victims, ttft_floor
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan


class HygenPolicy(Policy):
    name = "hygen"

    def __init__(self, cost_model: CostModel, latency_budget_s: float | None = None,
                 budget_fraction: float = 1.0, utility: float = 0.8,
                 min_prefill_tokens: int = 16) -> None:
        super().__init__(cost_model)
        self._resident = ResidentPrefixes()  # pages the running requests hold, kept across steps
        if not 0.0 <= utility <= 1.0:
            raise ValueError(f"utility must be within [0, 1], got {utility}")
        if budget_fraction <= 0 or (latency_budget_s is not None and latency_budget_s <= 0):
            raise ValueError("budget_fraction and latency_budget_s must be positive")
        self.latency_budget_s = latency_budget_s  # seconds per step; None: from the TPOT SLO
        self.budget_fraction = budget_fraction
        self.utility = utility  # share of waiting BE picks taken from the prefix tree
        self.min_prefill_tokens = min_prefill_tokens  # the oldest RT prefill's progress a step
        self._num_picks = 0  # waiting BE requests seated so far, across steps
        self._num_tree_picks = 0  # of them, taken from the prefix tree

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        rts = sorted((v for v in views if v.is_rt), key=lambda v: v.arrival_s)
        bes = sorted((v for v in views if not v.is_rt), key=lambda v: v.arrival_s)
        limit_s = self.step_budget_s(rts)
        batch = StepBatch(budget, self.cost_model)
        plan = StepPlan(is_restrictive=True)
        # Running BE requests RT may take pages from: the least important, newest first.
        victims = Victims(sorted((v for v in bes if v.is_running),
                                 key=lambda v: (v.priority, v.arrival_s), reverse=True),
                          budget.page_tokens, kept=rts, pages_next_step=batch.pages_next_step)
        be_decodes = [v for v in bes if v.is_running and not v.is_prefill]
        is_rt_short = self._online_phase(rts, batch, limit_s, victims, plan, budget.now_s,
                                         be_decodes)
        batch.keep_free_pages()
        preempted = set(plan.preempt)
        running_bes = [v for v in bes if v.is_running and v.request_id not in preempted]
        # No BE request starts on the pages a waiting RT turn waits for (not in the paper:
        # fresh items took each page as it freed while the turns queued behind it waited).
        can_pages_free = any(v.is_running for v in views)
        # Nor on the pages BE requests preempted for RT ones leave over (not in the paper):
        # a fresh one took them, with 1 token of prefill, and the preempted ones resumed
        # short of them.
        waiting_bes = [] if is_rt_short and can_pages_free else [
            v for v in bes if not v.is_running and (v.num_preemptions or not plan.preempt)]
        # (not the requests preempted for RT ones: their pages go back to the pool)
        resident = self._resident.update(
            [v for v in views if v.request_id not in preempted], budget.page_tokens)
        # BE work also keeps the step within the arrival guard, so a turn arriving meanwhile
        # does not wait behind a long document prefill; and within the least time a seated
        # RT token is due in (not in the paper, whose L is fixed): after a step ran over, BE
        # chunks stretched every step after it back to L, and the streams never caught up
        # (150 of 150 tokens late over 30 steps in a review's simulation). RT takes step time
        # from BE, never the reverse.
        seated = set(batch.ids)
        rt_due_s = min((v.due_in_s(budget.now_s) for v in rts if v.request_id in seated),
                       default=math.inf)
        self._offline_phase(running_bes, waiting_bes, batch,
                            min(limit_s, budget.max_be_step_s, rt_due_s), resident)
        plan.order = batch.ids
        plan.token_limits = batch.token_limits
        return plan

    def step_budget_s(self, rts: Sequence[RequestView]) -> float:
        """The step's latency budget `L` (seconds; infinite with no RT request to protect)."""
        if self.latency_budget_s is not None:
            return self.latency_budget_s
        tpots = [v.tpot_slo_s for v in rts if v.tpot_slo_s is not None]
        return self.budget_fraction * min(tpots) if tpots else math.inf

    def _online_phase(self, rts: list[RequestView], batch: StepBatch, limit_s: float,
                      victims: Victims, plan: StepPlan, now_s: float,
                      be_decodes: list[RequestView]) -> bool:
        """Algorithm 1 over RT requests; appends taken BE pages' owners to `plan.preempt`.
        Returns whether a waiting one was left out for want of pages."""
        page_tokens = batch.page_tokens
        for view in (v for v in rts if v.is_running and not v.is_prefill):
            if batch.is_full:
                return False
            if batch.ids and batch.time_s(1, view.num_computed_tokens + 1, False) > limit_s \
                    and view.slack_s(now_s) > 0:
                continue  # it can wait a step
            # A decode already late goes in past `L` (not in the paper): a long context's
            # decode that never fit beside the streams before it waited for all of them to
            # finish, while shorter BE decodes took the time it could not.
            pages = new_pages(view, 1, page_tokens)
            if victims.take_until(pages, batch, plan):
                batch.add(view, 1, pages)
        # (a request whose pages come only at the next step keeps waiting ones off the free
        # pages it counts on: they took them, and it waited again, step after step)
        prefills = [v for v in rts if v.is_running and v.is_prefill]
        prefills += [v for v in rts if not v.is_running]
        step_s = limit_s  # a step lasts about L whatever share BE decodes take of it
        reserve_s, marginal_s = 0.0, {}
        if be_decodes and prefills:  # (each decode's share, found once: walked again at
            # every victim taken, a long turn under memory pressure cost 30 ms a step)
            base_s = batch.time_s()
            reserve_s = max(0.0, batch.time_with_decodes_s(be_decodes) - base_s)
            marginal_s = {v.request_id: batch.time_with_decodes_s((v,)) - base_s
                          for v in be_decodes}

        # What the decodes' shares count more than once (a decode step's fixed cost, in each
        # share and once in their sum): each one's part, taken off what a preemption frees.
        shared_s = 0.0 if len(marginal_s) < 2 else max(
            0.0, (sum(marginal_s.values()) - reserve_s) / (len(marginal_s) - 1))

        def prefill_limit_s() -> float:
            """L less the time the running BE decodes still to come take: not those
            preempted for RT pages meanwhile (their reserve, kept, went to a BE request
            not yet started, and the turn's chunk stayed cut short)."""
            gone = [marginal_s[rid] for rid in plan.preempt if rid in marginal_s]
            if len(gone) == len(marginal_s):
                return step_s
            return step_s - max(0.0, reserve_s - sum(gone) + shared_s * len(gone))

        is_short = False
        is_oldest = True  # no prefill seated yet: the oldest that can run is this one
        for view in prefills:
            if batch.is_full:
                return is_short
            if (victims.num_taken_late or batch.is_waiting_for_pages) and not view.is_running:
                return True  # (one waits for pages that come next step: no later turn takes
                # the free ones it counts on)
            # Where decodes fill the budget (on a slow machine a step's fixed cost nearly fills
            # the TPOT target), every RT prefill would wait for the decodes to finish: the
            # oldest one still advances `min_prefill_tokens` a step. And each gets at least the
            # chunk that still meets its TTFT (`ttft_floor`, not in the paper), past `L` if it
            # must: measured at 3 turns/s on a 2-core CPU, bursts of 16-19 turns in 2 s missed
            # their TTFT by up to 0.5 s while every stream held its TPOT with room to spare.
            on_time = ttft_floor(view, batch, step_s, now_s)
            floor = max(self.min_prefill_tokens if is_oldest else 0, on_time)
            # One already too late for its TTFT takes the whole of L: BE decodes kept their
            # time, it advanced `min_prefill_tokens` a step while they ran at full speed (a
            # 6,000-token turn beside 12 of them: its first token at 33 s, against 1.6 s
            # alone; found by a review). RT takes step time from BE, never the reverse.
            limit_of = prefill_limit_s if on_time else (lambda: step_s)
            # Alone in the step it takes the whole of what it wants only where no BE decode
            # would sit that step out (Algorithm 1's get_max_prefill cuts it to the budget: a
            # 4,000-token turn beside 40 BE decodes made a 0.52 s step they all sat out,
            # holding their pages; found by a review).
            first = floor if be_decodes else math.inf
            chunk, pages, is_short_of_pages = batch.max_chunk(view, limit_of(), first_tokens=first,
                                                              min_tokens=floor)
            needed = admission_pages(view, pages, batch.page_tokens)
            # vLLM admits a waiting request only where its whole sequence fits: where it would
            # not even with every BE request preempted, none is, and it waits for pages
            admissible = needed <= batch.pages_left + victims.num_pages
            while admissible and (is_short_of_pages or needed > batch.pages_left) and victims \
                    and (not victims.pages_next_step
                         or needed > batch.pages_left + victims.pages_next_step):
                victims.take_one(batch, plan)
                chunk, pages, is_short_of_pages = batch.max_chunk(view, limit_of(),
                                                                  first_tokens=first,
                                                                  min_tokens=floor)
                needed = admission_pages(view, pages, batch.page_tokens)
            if needed > batch.pages_left:
                chunk = 0
                is_short = is_short or not view.is_running
                victims.defer(needed, batch)
            if chunk > 0:
                batch.add(view, chunk, pages)
            elif batch.ids:
                return is_short  # an empty step looks further, so the engine never idles
            # One that could not have its pages even with every BE request preempted passes
            # the oldest's tokens on: the next turn, alone in the step, got none, and a BE
            # decode was preempted for it, for an empty step (found by a property test).
            is_oldest = is_oldest and not admissible
        return is_short

    def _offline_phase(self, running: list[RequestView], waiting: list[RequestView],
                       batch: StepBatch, limit_s: float, resident: ResidentPrefixes) -> None:
        """Algorithm 3 over BE requests: running ones first, then prefix tree and freshness."""
        for view in sorted(running, key=lambda v: v.is_prefill):  # stable: decodes first
            if batch.is_full:
                return
            if view.is_prefill:
                chunk, pages, _ = batch.max_chunk(view, limit_s, first_tokens=batch.page_tokens)
                if chunk > 0:
                    batch.add(view, chunk, pages)
                elif batch.ids:
                    break
                continue
            if batch.ids and batch.time_s(1, view.num_computed_tokens + 1, False) > limit_s:
                break
            pages = new_pages(view, 1, batch.page_tokens)
            if pages <= batch.pages_left:
                batch.add(view, 1, pages)
        tree, fresh = dfs_order(waiting), waiting  # Tp and Tf of Algorithm 3
        taken: set[str] = set()
        i_tree = i_fresh = 0
        while not batch.is_full and len(taken) < len(waiting):
            is_from_tree = self._num_tree_picks < self.utility * (self._num_picks + 1)
            if is_from_tree:
                while tree[i_tree].request_id in taken:
                    i_tree += 1
                view = tree[i_tree]
            else:
                while fresh[i_fresh].request_id in taken:
                    i_fresh += 1
                view = fresh[i_fresh]
            taken.add(view.request_id)
            cached = resident.num_cached_tokens(view)
            chunk, pages, _ = batch.max_chunk(view, limit_s, cached,
                                             first_tokens=batch.page_tokens)
            if chunk <= 0:
                if batch.ids:
                    return
                continue  # not a pick: an empty step looks further
            batch.add(view, chunk, pages, num_cached_tokens=cached)
            self._num_picks += 1
            self._num_tree_picks += is_from_tree
