"""BROS priority packing (Algorithm 1) with TCP-like adaptive batch size.

Each step:
1. RT requests (running and waiting) in ascending slack to their next token deadline
   (`RequestView.deadline_s`), prefills too long to make their TTFT even alone last.
   The step must finish within the smallest slack, `T_res`, so the most urgent RT token is
   on time.
2. Add RT requests while the batch is under `B_curr`, the token budget and memory allow, and the
   predicted step time stays within `T_res`; an RT prefill that does not fit is chunked (to what
   fits, but no less than it needs to meet its TTFT: `rt_prefill_chunk`) instead of waiting. An
   RT request short of pages takes them from running BE requests (cheapest to redo first),
   never the other way round; a waiting one that still cannot get its pages keeps every
   waiting request behind it from starting.
3. Add BE requests under the same limits: running first, then preempted ones, then those
   not yet started, each of the two with the least KV to restore from the host tier first
   (the paper's M_cpu), then in arrival order. (The paper orders all BE requests by M_cpu: a
   restored request, whose M_cpu is never 0, then waited behind every fresh one, and the
   batch runner keeps fresh items waiting until a job runs out of them.) They may only use
   free pages. A BE
   prefill that does not fit the time limit is cut to the chunk that does. With no RT request
   in the system the limit is the arrival guard
   (`StepBudget.max_be_step_s`, not in the paper): without it one step could prefill several
   whole documents, and a turn arriving meanwhile would wait for all of them.
4. `B_curr` doubles after a step with no RT at risk and falls back to its base as soon as the
   time limit turns a request away.

Requests not chosen sit the step out and keep their pages (BROS's pending queue).
"""

from __future__ import annotations

from collections.abc import Sequence

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.policies.base import (
    Policy,
    admission_pages,
    new_pages,
    tokens_within_pages,
)
from antiphon.engine_ext.policies.stepbatch import (
    StepBatch,
    Victims,
    preempt,
    prefill_alone_s,
    ttft_floor,
)
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan

MIN_RT_PREFILL_CHUNK = 16  # tokens a late RT prefill computes at least, per step


def be_time_s(rts: Sequence[RequestView], now: float) -> float:
    """The step time RT tokens leave BE work: the smallest `due_in_s` among them (a late
    token was left out, and BE work then filled the step to the next slack, a TTFT's 0.7 s
    say, while the late stream waited)."""
    return min((v.due_in_s(now) for v in rts), default=float("inf"))


def residual_time_s(rts: Sequence[RequestView], now: float) -> float:
    """`T_res`, the time RT packing fills: `be_time_s`, but never below the smallest TPOT
    target (the step time an on-time stream needs); without this, one urgent request would
    limit every step to itself and starve the other RT requests. BE work gets `be_time_s`
    alone: with the floor, it filled the step past an on-time token due sooner."""
    if not rts:
        return float("inf")
    return max(be_time_s(rts, now), min(v.tpot_slo_s or 0.0 for v in rts))


def rt_prefill_chunk(view: RequestView, batch: StepBatch, limit_s: float, now: float) -> int:
    """The prefill chunk an RT request computes in a step that cannot take all of it within
    `limit_s`: what fits, but at least what it needs to still meet its TTFT (`ttft_floor`);
    where it cannot, at least `MIN_RT_PREFILL_CHUNK` tokens, so it moves. (The paper stops
    adding RT requests at the first that does not fit: a turn arriving while others decode
    would then wait for every one of them to finish.)"""
    wanted = min(view.num_new_tokens, batch.tokens_left)
    floor = ttft_floor(view, batch, limit_s, now) or MIN_RT_PREFILL_CHUNK
    return min(wanted, max(batch.tokens_within(view, limit_s, wanted), floor))


class BrosPolicy(Policy):
    name = "bros"
    # Block preemption: an RT request short of pages takes them from running BE requests.
    # Without it (the paper's ablation), a running request short of pages is preempted itself.
    block_preemption = True

    def __init__(self, cost_model: CostModel, base_batch_size: int = 32) -> None:
        super().__init__(cost_model)
        # B_base: the paper starts at 128 on GPUs. At 8, measured on a 2-core CPU, a turn
        # beyond the eighth decoding stream skipped steps and missed its TPOT.
        self.base_batch_size = base_batch_size
        self.batch_size = base_batch_size  # B_curr
        # `_misses_ttft`'s verdict on each RT prefill, judged when first planned (judged on its
        # remainder, a long prompt went to the back, then, its rest short enough, came first
        # by its long-missed deadline and took whole steps from the streams; found by a review)
        self._ttft_verdicts: dict[str, bool] = {}

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        now = budget.now_s
        known = self._ttft_verdicts
        # (a prompt's, while it is one: a stream's first token has come, late or not)
        verdicts = {v.request_id: known[v.request_id] if v.request_id in known
                    else self._misses_ttft(v, budget) for v in views
                    if v.is_rt and v.is_prefill and v.num_output_tokens == 0}
        self._ttft_verdicts = verdicts  # (the others' go)
        rts = sorted((v for v in views if v.is_rt),
                     key=lambda v: (verdicts.get(v.request_id, False), v.slack_s(now)))
        bes = sorted((v for v in views if not v.is_rt), key=lambda v: (
            not v.is_running, v.num_preemptions == 0, v.num_restore_tokens, v.arrival_s))
        cap = min(self.batch_size, budget.max_num_seqs)
        batch = StepBatch(budget, self.cost_model)
        plan = StepPlan(is_restrictive=True)
        # Running BE requests whose pages an RT request may take, cheapest first: fewest pages
        # to checkpoint (bidirectional blocks), then fewest tokens to redo or reload.
        victims = Victims(sorted((v for v in bes if v.is_running),
                                 key=lambda v: (v.checkpoint_pages or 0, v.num_computed_tokens))
                          if self.block_preemption else (), budget.page_tokens, kept=rts,
                          pages_next_step=batch.pages_next_step)
        time_limit = residual_time_s(rts, now)
        is_at_risk = is_admission_blocked = is_deferred = False
        # Pages come back only from running requests: with none, a turn short of pages waits in
        # vain, and holding back the requests behind it would stall the engine.
        can_pages_free = any(v.is_running for v in views)

        for view in rts:
            if len(batch.ids) >= cap or batch.tokens_left <= 0:
                break
            new = min(view.num_new_tokens, batch.tokens_left)
            context = view.num_computed_tokens + new
            # The first of the step too, where it is a prefill and other RT requests wait on
            # the step (Algorithm 1 compares every candidate with T_res): seated whole, a turn
            # come to the front of the slack order made the step 0.5 s, and every stream
            # skipped it (found by a review). Alone, it takes what it will.
            limited = bool(batch.ids) or (view.is_prefill and len(rts) > 1)
            if limited and batch.time_s(new, context, view.is_prefill) > time_limit:
                is_at_risk = True
                if view.is_prefill:
                    new = rt_prefill_chunk(view, batch, time_limit, now)
                elif view.slack_s(now) > 0:
                    # It waits a step; the RT requests behind it in slack order may still fit
                    # (the paper stops here, and BE work then took the time they could use).
                    continue
                # else a decode already late goes in past the limit (not in the paper): left
                # out, its next token would come a whole step later still. Late decodes come
                # first in slack order, so no on-time token is in the batch yet. Measured with
                # RT only on a 2-core CPU, where 16 decoding streams cannot make a 0.1 s TPOT:
                # cutting the batch to the limit made each stream skip every other step and
                # cost 36% of throughput.
            pages = new_pages(view, new, budget.page_tokens)
            if not view.is_running and is_admission_blocked:
                continue
            needed = admission_pages(view, pages, budget.page_tokens)
            if needed > batch.pages_left + victims.num_pages and self.block_preemption \
                    and view.is_running and view.is_prefill:
                # A running prefill computes the chunk the pages allow (not in the paper):
                # left out, it waited while BE work that needed no new page ran every step.
                new = tokens_within_pages(view, new, batch.pages_left + victims.num_pages,
                                          budget.page_tokens)
                pages = needed = new_pages(view, new, budget.page_tokens)
            if new <= 0 or needed > batch.pages_left + victims.num_pages:
                if not self.block_preemption and view.is_running:
                    preempt(view, batch, plan)
                    continue
                # Preempting all BE would not do. A running RT request may still fit; a waiting
                # one behind this one may not take the pages it waits for (not in the paper):
                # under memory pressure, turns that need few pages (a fresh prompt) would take
                # each page as it frees, and a follow-up needing its whole context never get in
                # (measured at 16 chat users on a 13-page pool: 9 s p99 TTFT).
                is_admission_blocked = is_admission_blocked or (
                    not view.is_running and can_pages_free)
                continue
            if victims.take_until(needed, batch, plan):
                batch.add(view, new, pages)
            else:  # its pages come at the next step: nothing waiting may take the free ones
                is_admission_blocked = is_deferred = True

        batch.keep_free_pages()
        be_time = be_time_s(rts, now)
        be_limit = min(be_time, budget.max_be_step_s)
        is_slack_limited = be_time <= budget.max_be_step_s
        is_at_risk = self._add_be(bes, batch, plan, cap, be_limit, is_slack_limited,
                                  is_admission_blocked, can_pages_free) or is_at_risk
        # A waiting BE request may not start on the pages a waiting RT turn needs, unless the
        # step would be empty without it (not in the paper): an empty step makes no progress,
        # and in the ablation without block preemption it followed when the running BE request
        # the turn waited on preempted itself, short of pages.
        if is_admission_blocked and not batch.ids and not is_deferred:
            is_at_risk = self._add_be(bes, batch, plan, cap, be_limit, is_slack_limited,
                                      False, can_pages_free) or is_at_risk

        self._adapt_batch_size(is_at_risk, budget.max_num_seqs)
        plan.order = batch.ids
        plan.token_limits = batch.token_limits
        return plan

    def _add_be(self, bes: Sequence[RequestView], batch: StepBatch, plan: StepPlan, cap: int,
                be_limit: float, is_slack_limited: bool, is_admission_blocked: bool,
                can_pages_free: bool) -> bool:
        """BE requests in order, running first, each its largest chunk within `be_limit` (an
        RT token's slack where `is_slack_limited`, else the arrival guard); returns whether
        the slack cut a chunk (the step is at risk). A preempted request short of pages keeps
        those not yet started from the pages it waits for while running ones can free them
        (under memory pressure fresh batch items took each page as it freed, and a request
        resuming with its whole context never got in)."""
        is_at_risk = False
        preempted = set(plan.preempt)
        is_resume_waiting = False
        for view in bes:
            if view.request_id in preempted or (not view.is_running and (
                    is_admission_blocked or (is_resume_waiting and not view.num_preemptions)
                    or (preempted and not view.num_preemptions))):
                # nor may a BE request start on the pages a waiting RT turn needs, nor a fresh
                # one on those the BE requests preempted for RT ones leave over (they would
                # resume short of them)
                continue
            if len(batch.ids) >= cap or batch.tokens_left <= 0:
                break
            chunk, pages, is_short_of_pages = batch.max_chunk(view, be_limit,
                                                              first_tokens=batch.page_tokens)
            if is_short_of_pages:
                if not self.block_preemption and view.is_running:
                    preempt(view, batch, plan)
                elif view.is_running and chunk > 0:
                    # a running prefill computes the chunk the pages allow (left out whole, a
                    # step of only such requests was empty, and vLLM's own step preempted one)
                    batch.add(view, chunk, pages)
                elif not view.is_running and view.num_preemptions:
                    is_resume_waiting = is_resume_waiting or can_pages_free
                continue  # a smaller BE request may still fit
            if chunk < min(view.num_new_tokens, batch.tokens_left):
                # cut by time: by an RT token's slack (at risk), else by the arrival guard
                is_at_risk = is_at_risk or is_slack_limited
                if chunk <= 0:
                    break
            batch.add(view, chunk, pages)
        return is_at_risk

    def _misses_ttft(self, view: RequestView, budget: StepBudget) -> bool:
        """A prefill too long to make its TTFT target even run alone the moment it arrived. It
        comes after the other RT requests (not in the paper): earliest deadline first would put
        it ahead of all of them, and a prompt that cannot make its TTFT anyway would make the
        turns behind it miss theirs too. A turn that is late only because it waited keeps its
        place by deadline: sending every late turn to the back served newer turns first, and
        under sustained load the oldest waited longest (9 s p99 TTFT at 16 chat users, 1 s
        median). A stream preempted by recompute, prefilling its prompt and output again, is
        past its first token: judged on its next token's deadline, not sent to the back
        (fresh turns went first, and it got 16 tokens a step of a 3,000-token context)."""
        if not view.is_prefill or view.ttft_slo_s is None or view.num_output_tokens > 0:
            return False
        # (all its steps: judged by its first chunk alone, a prompt of several steps' tokens
        # kept its place, and took every step's tokens from the turns behind it)
        return prefill_alone_s(self.cost_model, view, budget.max_num_tokens) > view.ttft_slo_s

    def _adapt_batch_size(self, is_at_risk: bool, max_num_seqs: int) -> None:
        if is_at_risk:
            self.batch_size = self.base_batch_size
        else:
            self.batch_size = min(self.batch_size * 2, max_num_seqs)


class BrosNoBlockPreemptionPolicy(BrosPolicy):
    """BROS scheduling without its memory management: the paper's "No Bi-cache" ablation
    (section 7.4.1), which "simply perform[s] recomputation for requests failing to acquire
    cache blocks". An RT request takes no pages from BE requests; a running request, RT or BE,
    that cannot get the pages its step needs is preempted and recomputes, as in stock vLLM;
    a waiting one waits for pages to free. The baseline BROS measured bidirectional blocks
    against (1.23 and 1.63 times the TTFT and TPOT attainment)."""

    name = "bros_no_block_preemption"
    block_preemption = False
