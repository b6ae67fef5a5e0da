"""`StepShape`: the composition of one engine step, as the cost model's forms read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Per-phase totals of the requests in one step. A request's context is the tokens it
    attends over, counted after the step (its new tokens included):

        |<------------ context c ------------>|
        |  computed before the step  | new n  |
    """

    num_prefill_requests: int = 0  # Np
    num_prefill_tokens: int = 0  # Sp: new tokens of prefill requests
    prefill_attention_area: int = 0  # sum of n * c over prefill requests (l^2 for a prompt)
    num_decode_requests: int = 0  # Nd
    num_decode_tokens: int = 0  # new tokens of decode requests (Nd without speculation)
    decode_attention_area: int = 0  # sum of n * c over decode requests
    decode_context_tokens: int = 0  # Sd: sum of c over decode requests
    max_decode_context: int = 0  # the longest decode request's c
    # 1 when the step before this one computed prefill tokens: the decode step right after a
    # prefill runs slower than the ones after it (see costforms' bros_after)
    after_prefill: int = 0
    # KV pages the tiering connector copies in the step (loads, saves, checkpoints), counted
    # once per layer; known when vLLM has scheduled the step, not while a policy plans it
    # (see CostModel's copy terms)
    page_copies: int = 0

    @classmethod
    def of(cls, requests: Iterable[tuple[int, int] | tuple[int, int, bool]]) -> StepShape:
        """From (new tokens, context tokens[, is prefill]) per request (see `plus`)."""
        shape = cls()
        for request in requests:
            shape = shape.plus(*request)
        return shape

    def plus(self, num_new_tokens: int, num_context_tokens: int,
             is_prefill: bool | None = None) -> StepShape:
        """This step with one more request; unless told, a request computing more than one
        token is a prefill (or a recompute after preemption, which costs the same)."""
        if is_prefill is None:
            is_prefill = num_new_tokens > 1
        area = num_new_tokens * num_context_tokens
        # Built field by field: policies call this several times per candidate per step, and
        # `dataclasses.replace` took 5 us of the 7 a call cost (echo's plan over 16 views).
        if is_prefill:
            return StepShape(
                self.num_prefill_requests + 1, self.num_prefill_tokens + num_new_tokens,
                self.prefill_attention_area + area, self.num_decode_requests,
                self.num_decode_tokens, self.decode_attention_area,
                self.decode_context_tokens, self.max_decode_context, self.after_prefill,
                self.page_copies)
        return StepShape(
            self.num_prefill_requests, self.num_prefill_tokens, self.prefill_attention_area,
            self.num_decode_requests + 1, self.num_decode_tokens + num_new_tokens,
            self.decode_attention_area + area, self.decode_context_tokens + num_context_tokens,
            max(self.max_decode_context, num_context_tokens), self.after_prefill,
            self.page_copies)

    @property
    def num_requests(self) -> int:
        return self.num_prefill_requests + self.num_decode_requests

    @property
    def num_new_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def to_list(self) -> list[int]:
        """The fields in order (a compact form for messages and JSON)."""
        return list(dataclasses.astuple(self))

    @classmethod
    def from_list(cls, values: Iterable[float]) -> StepShape:
        return cls(*(int(v) for v in values))
