"""Plain data exchanged between the server and an engine: no tensors, no vLLM types."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import sys
from collections.abc import Mapping
from typing import Any


class RequestClass(enum.StrEnum):
    """Latency-critical chat turns (RT) or background document work (BE)."""

    RT = "rt"
    BE = "be"

    @classmethod
    def of_extra_args(cls, extra_args: Mapping[str, Any] | None) -> RequestClass:
        """The class the engine put in a vLLM request's `sampling_params.extra_args`."""
        return cls((extra_args or {}).get("antiphon_class", cls.RT.value))


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: OpenAI's `tools[].function`."""

    name: str
    description: str | None = None
    parameters_json: str | None = None  # JSON text of its arguments' schema (None: none given)

    def to_json(self) -> dict[str, Any]:
        """As OpenAI's `tools[]` entry (what chat templates that know tools take)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters_json is not None:
            function["parameters"] = json.loads(self.parameters_json)
        return {"type": "function", "function": function}


class JsonTooDeep(ValueError):
    """JSON nested deeper than Python's parser walks."""


def strict_json(text: str) -> Any:
    """`text` parsed as JSON as the standard has it and other parsers read it. Python's parser
    also takes `NaN`, `Infinity`, numbers beyond a float's range (`1e999`, an integer of 400
    digits) and unpaired surrogate escapes (`"\\ud800"`): written back (a call's arguments, a
    reply), they made text JavaScript's and Go's parsers refuse, or that no UTF-8 encoder
    takes. Raises ValueError (`JsonTooDeep` where nested deeper than Python walks: its
    RecursionError, no ValueError, went past the callers that take unparseable text as text,
    a model's reply of a thousand "[" among them, and failed the request)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_float_range_int)
    except RecursionError:
        raise JsonTooDeep("nested too deeply") from None
    # Text that came as UTF-8 holds no surrogates: only `\udXXX` escapes make them, so only
    # text with one pays for the re-encoding that finds an unpaired one.
    if _SURROGATE_ESCAPE.search(text):
        json.dumps(value, ensure_ascii=False).encode()  # UnicodeEncodeError, a ValueError
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _float_range_int(text: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(text.lstrip("-")) > limit:
        raise ValueError(f"a number has more than {limit} digits")
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is out of range")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call of a tool by the assistant."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it (the model's, so not always valid)

    def arguments_value(self) -> Any:
        """The arguments as a value where they are JSON text of an object, else the text."""
        try:
            value = strict_json(self.arguments)
        except ValueError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """One message of a conversation as the chat template sees it."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


@dataclasses.dataclass(frozen=True)
class ChatContext:
    """The exact tokens of a conversation up to and including its last reply: the prompt the
    reply was generated from, then the generated tokens (stop tokens left out). Extending it,
    rather than rendering the history's text again, keeps every token the KV was computed for
    (text rendered back does not always tokenise to what the model generated)."""

    num_messages: int  # messages it covers; the last one is the reply
    token_ids: tuple[int, ...]


# The loosest TTFT or TPOT target one request may set (seconds: a day). Past it, planning
# arithmetic with the target (steps before a first token is due) overflowed, and one
# request's `vllm_xargs.ttft_slo_s` of 1e308 stopped the engine (found by a review).
MAX_REQUEST_SLO_S = 86_400.0


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_tokens: int  # output tokens, at most
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    min_tokens: int = 0  # output tokens before EOS or a stop sequence may end it
    json_schema: str | None = None  # JSON text of a schema the reply must match (structured output)
    logprobs: int | None = None  # each output token's log probability, with this many top ones
    prompt_logprobs: int | None = None  # each prompt token's, likewise (its KV is recomputed)
    # The logprob of an end-of-sequence token that ends the reply (its text is not the
    # reply's): a text completion gives it, as vLLM does and scorers of echoes count on.
    stop_token_logprob: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    stop: tuple[str, ...] = ()
    # Tools are offered: a model's <tool_call> tags stay in the text where they are special
    # tokens (`ChatTokenizer.tool_tags_are_special`); dropped, the calls became content
    keep_tool_tags: bool = False
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    ttft_slo_s: float | None = None  # RT targets for this request; None: deployment default
    tpot_slo_s: float | None = None
    request_class: RequestClass = RequestClass.RT
    session_id: str | None = None  # lets the engine keep a session's KV across turns
    cache_salt: str | None = None  # KV is shared only among requests of one salt (a tenant)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """An output token's text and log probability, and the most likely tokens at its place
    (most likely first), as the request asked for (`GenerationParams.logprobs`)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


# The key under which the KV connector hands a finished request's (host, SSD) prompt tokens
# to its last output (vLLM's `kv_transfer_params`).
TIER_TOKENS_KEY = "antiphon_prompt_tokens_from_tiers"


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output of one request since the previous delta."""

    text: str  # detokenised text of the new tokens
    num_new_tokens: int  # tokens generated since the previous delta
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" once finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Of those, loaded from the KV tiers' host arena and from SSD (through it), in the last
    # delta; None where the engine keeps no tiers
    tier_tokens: tuple[int, int] | None = None
    token_ids: tuple[int, ...] = ()  # the new tokens themselves
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked
    # One per prompt token, in the first delta, when the request asked; None for the first
    # token, which nothing precedes.
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    is_healthy: bool
    model: str
    num_unfinished_requests: int = 0  # requests the engine holds (running or waiting)
    detail: str = ""
