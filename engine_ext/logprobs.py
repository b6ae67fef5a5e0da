"""vLLM's logprobs as `TokenLogprob`s, clamped as vLLM's own server clamps them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from antiphon.engine_ext.types import GenerationParams, TokenLogprob

# The lowest logprob reported, as vLLM's own server clamps them: structured output masks
# tokens, whose logprob is then -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0


def token_logprobs(completion: Any, params: GenerationParams,
                   finished: bool) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token logprobs (token id -> Logprob, the sampled token's among them) as
    `TokenLogprob`s: the sampled token's, and the `params.logprobs` most likely, by rank.
    The end-of-turn token that stopped the reply is left out, as it is from the reply's text
    (and from OpenAI's chat logprobs), unless `params.stop_token_logprob`."""
    top = params.logprobs
    if top is None or not completion.logprobs:
        return ()
    token_ids, logprobs = list(completion.token_ids), list(completion.logprobs)
    if (finished and completion.finish_reason == "stop" and not params.stop_token_logprob
            and not isinstance(completion.stop_reason, str) and token_ids):
        token_ids, logprobs = token_ids[:-1], logprobs[:-1]  # EOS or a stop token
    return tuple(ranked(candidates, token_id, top)
                 for token_id, candidates in zip(token_ids, logprobs, strict=True))


def prompt_logprobs(out: Any, top: int | None) -> tuple[TokenLogprob | None, ...]:
    """vLLM's prompt logprobs (None, then token id -> Logprob for each later prompt token) as
    `TokenLogprob`s; () when the request asked for none or they came in an earlier output."""
    if top is None or not out.prompt_logprobs:
        return ()
    return tuple(None if candidates is None else ranked(candidates, token_id, top)
                 for token_id, candidates in zip(out.prompt_token_ids, out.prompt_logprobs,
                                                 strict=True))


def ranked(candidates: Mapping[int, Any], token_id: int, top: int) -> TokenLogprob:
    """`token_id`'s logprob among vLLM's `candidates`, with the `top` likeliest by rank."""
    chosen = candidates[token_id]
    by_rank = sorted((c for c in candidates.values() if c.rank is not None and c.rank <= top),
                     key=lambda c: c.rank)
    return TokenLogprob(chosen.decoded_token or "", max(float(chosen.logprob), MIN_LOGPROB),
                        tuple((c.decoded_token or "", max(float(c.logprob), MIN_LOGPROB))
                              for c in by_rank))
