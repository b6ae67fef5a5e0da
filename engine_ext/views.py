"""What a scheduling policy sees and decides: plain dataclasses of ids and integers.

The scheduler builds one `RequestView` per running or waiting request and a `StepBudget` for the
step, asks its policy for a `StepPlan`, and applies the plan through vLLM's own mechanism. No
tensors and no vLLM types cross this boundary, so policies run under unit tests and simulators.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from antiphon.engine_ext.types import RequestClass


@dataclasses.dataclass(frozen=True)
class RequestView:
    request_id: str
    request_class: RequestClass
    arrival_s: float  # when the engine received it (seconds, the scheduler's clock)
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV exists on the device (waiting: or in a KV tier)
    num_output_tokens: int  # tokens generated so far
    is_running: bool  # holds KV pages and was scheduled before
    ttft_slo_s: float | None = None  # RT only: first token due this long after arrival
    tpot_slo_s: float | None = None  # RT only: each later token due this much after the last
    priority: int = 0  # lower is more important (vLLM's convention)
    num_preemptions: int = 0
    # Waiting: KV the tiers would load at admission, beyond what the device's prefix cache still
    # holds (BROS's M_cpu: the cost of restoring a checkpointed request); 0 when nothing is
    # stored, e.g. a fresh request or one preempted by recompute.
    num_restore_tokens: int = 0
    # Running, with checkpointing on: device pages a preemption now would copy to the host
    # tier (its newest, not yet written through); None: a preemption recomputes its tokens.
    checkpoint_pages: int | None = None
    # RT: when its first token was produced (seconds, the arrival clock); None before that.
    first_token_s: float | None = None
    # Pages other running requests hold too (a shared system prompt, one document): waiting,
    # the part of its prefix admission takes without allocating; running, what a preemption
    # of it does not give back.
    num_shared_pages: int = 0
    # Running BE: how many requests hold each of its shared pages (vLLM's reference counts,
    # finished requests whose pages the KV connector still saves among them); () where not
    # known (those pages are then never counted freed with the requests that share them).
    shared_page_holders: Sequence[int] = ()
    # Running: its pages come back a step after a preemption, not at once (vLLM defers the
    # free while a step in flight may still write them: an overlapped engine, a GPU's, with a
    # KV connector); a plan that preempts it seats no one on them before the next step.
    frees_pages_late: bool = False
    prefix_page_hashes: Sequence[bytes] = ()
    """Chained hashes of the prompt's full KV pages (vLLM's block hashes): two requests share
    their first k pages exactly when their first k hashes are equal. The scheduler passes
    vLLM's own list, not a copy: read it, never change it."""

    @property
    def is_rt(self) -> bool:
        return self.request_class is RequestClass.RT

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens + max(
            0, self.num_output_tokens - 1)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step would compute for this request (all remaining prefill, or 1)."""
        remaining = self.num_prompt_tokens + self.num_output_tokens - self.num_computed_tokens
        return max(1, remaining)

    @property
    def num_context_tokens(self) -> int:
        """Tokens the next step attends over (context after the step)."""
        return self.num_computed_tokens + self.num_new_tokens

    def deadline_s(self) -> float:
        """When the next token is due (RT only): the first at `arrival + TTFT`, token i after
        it at `first + i * TPOT`, where `first` is when the first token actually came. The
        paper's token-level deadline counts every token from `arrival + TTFT`; measured, that
        went wrong both ways. A turn whose first token came late stayed late for every token
        and outranked every turn that could still be on time, which then came late too (EDF's
        domino effect under overload); and an early first token lent its credit to the
        tokens after it, so streams paced slower than their TPOT. From the first token, a
        stream is judged on its pace, as its TPOT is."""
        assert self.ttft_slo_s is not None and self.tpot_slo_s is not None, "not an RT request"
        first = self.arrival_s + self.ttft_slo_s if self.first_token_s is None \
            else self.first_token_s  # unknown: the paper's form
        return first + self.num_output_tokens * self.tpot_slo_s

    def slack_s(self, now_s: float) -> float:
        """Time left until the next token's deadline (negative once missed)."""
        return self.deadline_s() - now_s

    def due_in_s(self, now_s: float) -> float:
        """The time a step may take before it delays the next token: its slack, or one TPOT
        target where it is late already (a shorter step cannot save it; one of that length
        keeps its stream at its pace). What the policies give BE work around RT tokens."""
        slack = self.slack_s(now_s)
        return slack if slack > 0 else self.tpot_slo_s or 0.0


@dataclasses.dataclass(frozen=True)
class StepBudget:
    now_s: float
    max_num_seqs: int  # engine limit on requests in one step
    max_num_tokens: int  # engine token budget of one step
    num_free_pages: int  # KV pages free now
    page_tokens: int  # tokens per KV page
    num_total_pages: int = 0  # KV pages in the pool; 0: unknown (policies estimate it)
    # The arrival guard: the longest step BE work may make (predicted seconds), so an RT turn
    # arriving during a step waits at most about this long to start. BE prefills are chunked
    # to fit; a step's first request still gets a page's worth of tokens.
    max_be_step_s: float = math.inf
    after_prefill: bool = False  # the step before this one computed prefill tokens
    # Pages that come back at the next step: vLLM defers the free of a request finished or
    # preempted with a step in flight (a GPU's, with the KV connector). A request short of
    # pages these cover waits a step instead of preempting BE work, whose pages would come
    # back no sooner.
    num_pages_next_step: int = 0


@dataclasses.dataclass
class StepPlan:
    """A policy's decision for one step. An empty plan leaves vLLM's behaviour unchanged."""

    order: list[str] = dataclasses.field(default_factory=list)
    """Request ids to schedule this step, most important first (running and waiting)."""
    preempt: list[str] = dataclasses.field(default_factory=list)
    """Running requests to preempt before the step (their pages go to `order`)."""
    is_restrictive: bool = False
    """True: requests not in `order` sit this step out. False: `order` only sets priority."""
    token_limits: dict[str, int] = dataclasses.field(default_factory=dict)
    """Most new tokens a request in `order` may compute this step (a prefill chunk sized to a
    latency budget, or a waiting request's whole remainder as estimated: what the tiers held
    for it may be gone by its admission); ids absent are bounded only by the step's token
    budget."""

    def rank(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.order)}
