"""The policy interface: request views and a step budget in, a step plan out."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan


class Policy(abc.ABC):
    name: str
    vllm_scheduling_policy = "fcfs"  # the vLLM queue discipline the policy runs on top of
    # Running RT requests go ahead of BE ones in vLLM's queue after every step (vLLM's own
    # preemption takes from the tail, and running requests get the step's tokens in order);
    # the stock baselines keep vLLM's order.
    is_rt_first = True

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    @abc.abstractmethod
    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        """Decide one step. Pure: reads the views, returns a plan, changes nothing else."""


def pages_for(num_tokens: int, page_tokens: int) -> int:
    return -(-num_tokens // page_tokens)


def held_pages(view: RequestView, page_tokens: int) -> int:
    """KV pages of `view`'s computed tokens it need not allocate: all of them for a running
    request, the ones running requests hold for a waiting one (counted as new, a turn over a
    shared system prompt preempted BE work for pages it did not need)."""
    if view.is_running:
        return pages_for(view.num_computed_tokens, page_tokens)
    return view.num_shared_pages


def freed_pages(view: RequestView, page_tokens: int) -> int:
    """KV pages a preemption of running `view` gives back: those no other request holds."""
    return pages_for(view.num_computed_tokens, page_tokens) - view.num_shared_pages


def new_pages(view: RequestView, num_new_tokens: int, page_tokens: int) -> int:
    """KV pages `view` must allocate to compute `num_new_tokens` more tokens."""
    return (pages_for(view.num_computed_tokens + num_new_tokens, page_tokens)
            - held_pages(view, page_tokens))


def tokens_within_pages(view: RequestView, num_new_tokens: int, num_pages: int,
                        page_tokens: int) -> int:
    """The most of `num_new_tokens` running `view` can compute with `num_pages` new pages."""
    fit = (held_pages(view, page_tokens) + num_pages) * page_tokens - view.num_computed_tokens
    return max(0, min(num_new_tokens, fit))


def admission_pages(view: RequestView, pages: int, page_tokens: int,
                    num_cached_tokens: int = 0) -> int:
    """Free pages vLLM needs to run `view` with a chunk of `pages` new pages (after
    `num_cached_tokens` reused from pages running requests hold): a waiting request is
    admitted only where its whole sequence fits (`scheduler_reserve_full_isl`, on by
    default), not its first chunk alone; a running one needs its chunk's."""
    if view.is_running:
        return pages
    held = held_pages(view, page_tokens) + num_cached_tokens // page_tokens
    end = view.num_computed_tokens + view.num_new_tokens
    return max(pages, pages_for(end, page_tokens) - held)
