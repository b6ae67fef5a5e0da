"""The step a policy is building: its members, predicted latency, and what is left of the budget.

The step's shape is kept incrementally, so predicting the step with one more request costs one
cost-model call, not a walk over the batch.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

from antiphon.engine_ext.costmodel import CostModel, StepShape
from antiphon.engine_ext.policies.base import admission_pages, freed_pages, held_pages, pages_for
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan

# The most steps ahead a prefill's first token is planned over (`ttft_floor`): a slack of a
# day over a 1 ms step is 8.6e7 of them; a target of 1e308 s overflowed `int`.
MAX_STEPS_AHEAD = 1e9


class StepBatch:
    def __init__(self, budget: StepBudget, cost_model: CostModel) -> None:
        self.ids: list[str] = []  # members, in the order they were seated
        # members computing less than all they could, and every waiting one seated
        self.token_limits: dict[str, int] = {}
        self.page_tokens = budget.page_tokens
        self.max_num_tokens = budget.max_num_tokens
        self.seqs_left = budget.max_num_seqs
        self.tokens_left = budget.max_num_tokens
        self.pages_left = budget.num_free_pages
        self.pages_next_step = budget.num_pages_next_step  # (the victims' start)
        self.is_waiting_for_pages = False  # see `keep_free_pages`
        self.cost_model = cost_model
        self._shape = StepShape(after_prefill=int(budget.after_prefill))  # of the members

    def keep_free_pages(self) -> None:
        """Called once RT requests are planned: where one was left out for pages that come
        back at the next step (`is_waiting_for_pages`, set by `Victims.defer`), the pages
        free now are kept for it. BE work seated after it took them (vLLM gives pages to
        running requests first), it was short again at the next step, another victim was
        preempted, and so on, step after step (in a 250-decode simulation hygen never seated
        the turn in 50 steps). RT requests planned after it may still take them."""
        if self.is_waiting_for_pages:
            self.pages_left = 0

    @property
    def is_full(self) -> bool:
        """No seat or no token left for another request."""
        return self.seqs_left <= 0 or self.tokens_left <= 0

    def time_s(self, num_new_tokens: int = 0, num_context_tokens: int = 0,
               is_prefill: bool | None = None) -> float:
        """Predicted step latency as policies plan with it (seconds, calibrated: see
        `CostModel.planning_s`); with `num_new_tokens` > 0, as if one more request computed
        that many tokens with `num_context_tokens` of context after the step (a prefill,
        unless told, when it computes more than one)."""
        shape = self._shape
        if num_new_tokens > 0:
            shape = shape.plus(num_new_tokens, num_context_tokens, is_prefill)
        return self.cost_model.planning_s(shape)

    def time_with_decodes_s(self, views: Iterable[RequestView]) -> float:
        """Predicted step latency (seconds, as `time_s`) with one more decode token for each
        of `views`."""
        shape = self._shape
        for view in views:
            shape = shape.plus(1, view.num_computed_tokens + 1, False)
        return self.cost_model.planning_s(shape)

    def max_chunk(self, view: RequestView, limit_s: float, num_cached_tokens: int = 0,
                  first_tokens: float = math.inf, min_tokens: int = 0
                  ) -> tuple[int, int, bool]:
        """HyGen's `get_max_prefill`: the most tokens `view` can compute in this step within
        `limit_s` (seconds of predicted step time), the tokens and the pages left, after
        `num_cached_tokens` reused from the prefix cache. Whatever the time, the first request
        of an empty step gets at least `first_tokens` (all it wants by default), so a step
        always makes progress, and a request joining a non-empty step at least `min_tokens`.
        Returns (tokens, new pages they need free: a waiting request's whole sequence's, as
        vLLM admits it, whether pages rather than time or tokens cut the chunk short)."""
        page_tokens = self.page_tokens
        start = view.num_computed_tokens + num_cached_tokens
        held = held_pages(view, page_tokens) + num_cached_tokens // page_tokens
        by_pages = (held + self.pages_left) * page_tokens - start
        wanted = min(view.num_new_tokens - num_cached_tokens, self.tokens_left)
        by_time = self.tokens_within(view, limit_s, wanted, start)
        if by_time < wanted:
            floor = min_tokens if self.ids else first_tokens
            by_time = int(max(by_time, min(wanted, floor)))
        chunk = max(0, min(by_time, by_pages))
        pages = pages_for(start + chunk, page_tokens) - held
        needed = admission_pages(view, pages, page_tokens, num_cached_tokens)
        if needed > self.pages_left:  # a waiting request whose whole sequence does not fit
            return 0, needed, True
        return chunk, needed, by_pages < by_time

    def tokens_within(self, view: RequestView, limit_s: float, wanted: int,
                      start: int | None = None) -> int:
        """The most of `wanted` new tokens `view` can compute, starting after `start` tokens
        (default: its computed ones), with the step's predicted time within `limit_s`."""
        start = view.num_computed_tokens if start is None else start
        if limit_s == math.inf or self.time_s(wanted, start + wanted, view.is_prefill) <= limit_s:
            return wanted
        lo, hi = 0, wanted - 1  # largest chunk within the limit; time grows with it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time_s(mid, start + mid, view.is_prefill) <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, view: RequestView, num_new_tokens: int, num_pages: int,
            num_cached_tokens: int = 0) -> None:
        """Seat `view` computing `num_new_tokens` after `num_cached_tokens` reused from the
        prefix cache; takes the tokens, `num_pages` pages and a seat from what is left. A
        waiting request takes the pages of its whole sequence (`admission_pages`): vLLM runs
        the running requests first, and pages they took refused its admission."""
        num_pages = admission_pages(view, num_pages, self.page_tokens, num_cached_tokens)
        self.ids.append(view.request_id)
        if num_cached_tokens + num_new_tokens < view.num_new_tokens or not view.is_running:
            # (a waiting request's remainder is an estimate: the KV the tiers or the prefix
            # cache were thought to hold may be gone by its admission, and vLLM would then
            # compute what they lacked too, up to the step's whole token budget)
            self.token_limits[view.request_id] = num_new_tokens
        context = view.num_computed_tokens + num_cached_tokens + num_new_tokens
        self._shape = self._shape.plus(num_new_tokens, context, view.is_prefill)
        self.seqs_left -= 1
        self.tokens_left -= num_new_tokens
        self.pages_left -= num_pages


def ttft_floor(view: RequestView, batch: StepBatch, limit_s: float, now_s: float) -> int:
    """The prefill tokens RT `view` must compute in this step to still meet its TTFT, with
    the steps before its first token is due `limit_s` long: its whole remaining prompt
    spread over them (at most what the step's tokens allow). 0 when even the whole of it
    alone would come too late: then nothing this step does saves the TTFT. (Spread was
    what one step's tokens allowed: a 6,000-token prompt got 256 tokens a step of the 750
    it needed, and missed a TTFT it could make.)"""
    wanted = min(view.num_new_tokens, batch.tokens_left)
    if wanted <= 0:
        return 0
    # (this step with what is seated in it, the rest alone: judged alone, a prompt late by
    # the decodes seated before it was forced in whole, and every stream with it)
    first_s = batch.time_s(wanted, view.num_computed_tokens + wanted, is_prefill=True)
    slack = view.slack_s(now_s)
    if first_s + prefill_alone_s(batch.cost_model, view, batch.max_num_tokens, wanted) > slack:
        return 0
    steps_left = max(1, int(min(slack / max(limit_s, 1e-3), MAX_STEPS_AHEAD)) - 1)
    return min(wanted, -(-view.num_new_tokens // steps_left))


def prefill_alone_s(cost_model: CostModel, view: RequestView, max_num_tokens: int,
                    done: int = 0) -> float:
    """Predicted time (seconds, as `CostModel.planning_s`) of `view`'s remaining prefill,
    after its first `done` tokens, run alone, a step per `max_num_tokens` (a step's token
    budget) of it."""
    total, context = 0.0, view.num_computed_tokens + done
    left = view.num_new_tokens - done
    while left > 0:
        chunk = min(left, max(1, max_num_tokens))
        context += chunk
        left -= chunk
        total += cost_model.planning_s(StepShape().plus(chunk, context, is_prefill=True))
    return total


class Victims:
    """Running BE requests whose pages RT requests may take, in the order they are taken.

    A page that only victims hold (one document's batch items) frees when the last of them
    goes: counted once, then (without it, a turn that needed those pages waited while the
    items holding them ran on). Only where all its holders are victims (`shared_page_holders`:
    a finished request whose pages are being saved holds one too), and none of the pages RT
    requests in `kept` hold or, waiting, will reuse (freed, a turn's admission would have to
    take back the prefix it counted as held): those are not counted freed, shared or not."""

    def __init__(self, views: Iterable[RequestView], page_tokens: int,
                 kept: Iterable[RequestView] = (), pages_next_step: int = 0) -> None:
        """`pages_next_step`: pages that come back at the next step whoever is preempted
        (`StepBudget.num_pages_next_step`)."""
        self._stack = list(views)[::-1]  # pop() takes the next victim
        held = {h for v in kept for h in _shared_hashes(v)}
        holders: dict[bytes, int] = {}  # of each page only victims share: its holders
        victims: collections.Counter[bytes] = collections.Counter()
        for view in self._stack:
            # (a page with no hash is left out: never counted freed)
            for h, num_holders in zip(view.prefix_page_hashes, view.shared_page_holders,
                                      strict=False):
                holders[h] = num_holders
                victims[h] += 1
        # pages shared only among victims: how many victims still hold each
        self._holders = {h: n for h, n in victims.items()
                         if n == holders[h] and h not in held}
        # pages a victim holds alone that a waiting turn in `kept` counts as held: preempted,
        # they go to the prefix cache, and its admission takes them from the free pages
        self._kept_pages: dict[str, int] = {}
        if held:
            for view in reversed(self._stack):  # in the order they are taken
                kept_hashes = _alone_and_kept(view, held, page_tokens)
                if kept_hashes:
                    self._kept_pages[view.request_id] = len(kept_hashes)
                    held -= kept_hashes  # two victims' copies of a page: the turn takes one
        self.num_pages = sum(freed_pages(v, page_tokens) for v in self._stack) + len(
            self._holders) - sum(self._kept_pages.values())
        # pages that come back only at the next step: those given, those of the victims taken
        # that free late (`frees_pages_late`), and the pages shared among victims one of which,
        # taken, lets go of them late
        self.pages_next_step = pages_next_step
        self.num_taken_late = 0  # victims taken whose pages come back at the next step
        self._late_shared: set[bytes] = set()

    def __bool__(self) -> bool:
        return bool(self._stack)

    def take_one(self, batch: StepBatch, plan: StepPlan) -> None:
        """Preempt the next victim: its pages go to `batch` (or, where they come back late,
        to `pages_next_step`), its id to `plan.preempt`."""
        view = self._stack.pop()
        own = preempt(view, batch, plan, self._kept_pages.get(view.request_id, 0))
        shared_now = shared_late = 0
        for h in view.prefix_page_hashes[:len(view.shared_page_holders)]:
            if h in self._holders:
                if view.frees_pages_late:
                    self._late_shared.add(h)
                self._holders[h] -= 1
                if not self._holders[h]:  # its last holder: the page frees
                    del self._holders[h]
                    if h in self._late_shared:  # (when the last reference to it goes)
                        shared_late += 1
                    else:
                        shared_now += 1
        batch.pages_left += shared_now
        self.pages_next_step += shared_late + (own if view.frees_pages_late else 0)
        self.num_taken_late += view.frees_pages_late or shared_late > 0
        self.num_pages -= own + shared_now + shared_late

    def take_until(self, num_pages: int, batch: StepBatch, plan: StepPlan) -> bool:
        """Take victims until `batch` has `num_pages` free, or will have at the next step;
        whether it has them now (False also where the victims run out first; `defer`)."""
        while num_pages > batch.pages_left + self.pages_next_step and self._stack:
            self.take_one(batch, plan)
        if num_pages <= batch.pages_left:
            return True
        self.defer(num_pages, batch)
        return False

    def defer(self, num_pages: int, batch: StepBatch) -> None:
        """A request is left out for want of `num_pages`: where it has them at the next step,
        once pages coming back late are back, `batch` waits for pages
        (`StepBatch.keep_free_pages`)."""
        if num_pages <= batch.pages_left + self.pages_next_step:
            batch.is_waiting_for_pages = True


def _shared_hashes(view: RequestView) -> Sequence[bytes]:
    """The page hashes of the pages `view` shares with running requests: running, its leading
    ones others hold too; waiting, the prefix it will take from them."""
    return view.prefix_page_hashes[:view.num_shared_pages]


def _alone_and_kept(view: RequestView, kept: set[bytes], page_tokens: int) -> set[bytes]:
    """The hashes in `kept` of the pages running `view` has computed and holds alone: after
    the ones it shares, up to its computed ones (its hashes cover its whole prompt)."""
    computed = view.prefix_page_hashes[:view.num_computed_tokens // page_tokens]
    return {h for h in computed[view.num_shared_pages:] if h in kept}


def preempt(view: RequestView, batch: StepBatch, plan: StepPlan, num_kept_pages: int = 0
            ) -> int:
    """Preempt running `view` before the step: its id goes to `plan.preempt`, the pages no
    other request holds back to `batch` (counting the shared ones, the plan seated work on
    pages still held), less `num_kept_pages` a waiting turn will take back from the prefix
    cache; none where they come back only at the next step (`frees_pages_late`). Returns
    the pages freed, now or then."""
    freed = freed_pages(view, batch.page_tokens) - num_kept_pages
    plan.preempt.append(view.request_id)
    if not view.frees_pages_late:
        batch.pages_left += freed
    return freed
