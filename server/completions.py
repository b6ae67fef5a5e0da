"""OpenAI chat-completion requests: the request model, its translation into a `Generation`, and
the `chat.completion` response object. Shared by `/v1/chat/completions` and the Batch API."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from antiphon.engine_ext.types import MAX_REQUEST_SLO_S, ChatTurn, RequestClass, ToolCall
from antiphon.server.chat import ChatService, Generation, total_usage
from antiphon.server.errors import ApiError, ErrorCode, over_limit
from antiphon.server.protocol import ID_PATTERN, Sampling, StrictBool, StrictInt, ToolOffer
from antiphon.server.tools import (
    MessageToolCall,
    reply_message,
)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    """Required, and not blank, except in an assistant message (clients send "" or null) and
    a tool's result (which may be empty)."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant's calls of tools (an empty list, which vLLM's replies carry and OpenAI
    refuses, is none)."""
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """A tool's result: the call it answers (one of an earlier assistant message's)."""

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> OpenAIMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has it")
        return self

    def turn(self) -> ChatTurn:
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                      for c in self.tool_calls or ())
        return ChatTurn("system" if self.role == "developer" else self.role, self.text(),
                        calls, self.tool_call_id)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)  # (as vLLM's server joins them)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an option not taken is refused, not dropped
    include_usage: StrictBool | None = False  # (null: the default, as every field's)
    continuous_usage_stats: Literal[False] | None = False
    """vLLM's usage in every chunk: not implemented (true is refused)."""
    include_obfuscation: Literal[False] | None = False
    """OpenAI's random padding of each chunk (the `openai` client offers it): not implemented
    (true is refused)."""


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    """As OpenAI and vLLM: `stream_options` only with `stream`."""
    if options is not None and not stream:
        raise ValueError("stream_options is only allowed with stream set to true")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default `max_logprobs`

# OpenAI parameters this server does not implement, each with the values that ask for nothing
# it would ignore: any other value is refused rather than silently dropped.
UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),  # use tools
    "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "echo": (None, False), "best_of": (None, 1),
}
# OpenAI parameters that change nothing a reply holds (bookkeeping and routing on OpenAI's
# side): accepted and not used, but held to OpenAI's types (null: unset).
_TEXT = TypeAdapter(str | None)
IGNORED_PARAMETERS: dict[str, TypeAdapter[Any]] = {
    "user": _TEXT, "safety_identifier": _TEXT, "prompt_cache_key": _TEXT,
    "service_tier": _TEXT, "prompt_cache_retention": _TEXT,
    "store": TypeAdapter(StrictBool | None),
    "metadata": TypeAdapter(Annotated[dict[Annotated[str, Field(max_length=64)],
                                           Annotated[str, Field(max_length=512)]],
                                      Field(max_length=16)] | None),
}


class ChatCompletionRequest(ToolOffer):
    """OpenAI's chat-completion request, with vLLM's sampling extensions (`Sampling`, and
    `ignore_eos`). A parameter the server does not know is refused, as OpenAI refuses one;
    `null` means the default, as in OpenAI's API."""

    model_config = ConfigDict(extra="allow")  # checked by `_refuse_unsupported`
    model: str
    messages: Annotated[list[OpenAIMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    """Choices to generate (`--max-choices` at most; 1 in a session turn)."""
    ignore_eos: StrictBool | None = None
    """vLLM's extension: generate exactly max_tokens (benchmarks)."""
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    vllm_xargs: dict[str, Any] | None = None
    """Antiphon reads `request_class` ("rt" or "be"), `ttft_slo_s`, `tpot_slo_s` and
    `session_id` here."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, set(cls.model_fields), UNSUPPORTED_PARAMETERS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        check_stream_options(self.stream, self.stream_options)
        return self

    def sampling(self) -> dict[str, Any]:
        given = super().sampling()
        if self.ignore_eos is not None:
            given["ignore_eos"] = self.ignore_eos
        if self.logprobs:
            given["logprobs"] = self.top_logprobs or 0
        return given

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field `requested_max_tokens` comes from, for errors about it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"



def refuse_unsupported(data: Any, known: set[str],
                       unsupported: dict[str, tuple[Any, ...]]) -> Any:
    """A request body's check before its fields are read: a parameter of `unsupported` with
    other than a neutral value, or one neither `known` nor ignored (`IGNORED_PARAMETERS`),
    is refused (ValueError) rather than silently dropped."""
    if isinstance(data, dict):
        for name, neutral in unsupported.items():
            if name in data and not any(_same(data[name], v) for v in neutral):
                raise ValueError(f"{name} is not supported by this server")
        unknown = sorted(set(data) - known - set(unsupported) - set(IGNORED_PARAMETERS))
        if unknown:
            raise ValueError(f"unrecognized request argument: {', '.join(unknown)}")
        for name, adapter in IGNORED_PARAMETERS.items():
            if name in data:
                try:
                    adapter.validate_python(data[name], strict=True)
                except ValidationError as e:
                    raise ValueError(f"{name}: {e.errors()[0]['msg']}") from None
    return data


def _same(value: Any, neutral: Any) -> bool:
    """`value` equals `neutral` as JSON sees it (0 and 0.0 alike, false and 0 not)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def require_served_model(chat: ChatService, model: str) -> None:
    """Raises `model_not_found` unless `model` names the model this server serves (its name
    or an alias)."""
    if model not in chat.model_names:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} is not served here; "
                       f"this server serves {chat.engine.model_name!r}")


def completion_turns(chat: ChatService, body: ChatCompletionRequest) -> list[ChatTurn]:
    """The request's conversation, after every check that needs no tokenizer (model, message
    count and size, max_tokens, stop sequences, logit_bias, `vllm_xargs`); raises
    `ApiError`."""
    require_served_model(chat, body.model)
    limits = chat.config
    if len(body.messages) > limits.max_messages:
        raise over_limit(f"{len(body.messages)} messages; the limit is {limits.max_messages}",
                         "messages")
    check_request(chat, body, body.requested_max_tokens, body.vllm_xargs or {},
                  max_tokens_param=body.max_tokens_param)
    chat.check_choices(body.num_choices)
    if body.num_choices > 1 and (body.vllm_xargs or {}).get("session_id") is not None:
        raise ApiError(ErrorCode.BAD_MESSAGE, "n must be 1 in a session turn: the session "
                       "keeps one reply per turn")
    chat.check_tools(len(body.tools or ()))
    turns: list[ChatTurn] = []
    unanswered: list[str] = []  # the calls of the last assistant message, not yet answered
    caller = 0  # that message's index
    for index, m in enumerate(body.messages):
        turn = m.turn()
        # Empty messages are allowed, as OpenAI and vLLM allow them (clients send an empty
        # system prompt when none is set); a websocket turn's message may not be empty.
        chat.check_content(turn.content, may_be_empty=True)
        if turn.tool_call_id is not None:
            if turn.tool_call_id not in unanswered:
                raise ApiError(ErrorCode.BAD_MESSAGE, f"tool message answers "
                               f"{turn.tool_call_id[:64]!r}, which the assistant message "
                               "before it did not call, or which it answered already",
                               param=f"messages.{index}.tool_call_id")
            unanswered.remove(turn.tool_call_id)
        else:
            _check_all_answered(unanswered, caller)
            unanswered, caller = _calls_of(turn, index, chat), index
        turns.append(turn)
    _check_all_answered(unanswered, caller)
    return turns


def _calls_of(turn: ChatTurn, index: int, chat: ChatService) -> list[str]:
    """The ids of the calls message `index` (`turn`) makes; raises `ApiError` for an empty
    list of calls or two calls of one id, as OpenAI does (results are matched by id)."""
    ids = [call.id for call in turn.tool_calls]
    for call in turn.tool_calls:
        chat.check_content(call.arguments, may_be_empty=True)
    if len(set(ids)) != len(ids):
        raise ApiError(ErrorCode.BAD_MESSAGE, "two tool calls of one assistant message have "
                       "the same id", param=f"messages.{index}.tool_calls")
    return ids


def _check_all_answered(unanswered: Sequence[str], caller: int) -> None:
    """Raises `ApiError` unless each of the calls `unanswered` of message `caller` has its tool
    message."""
    if unanswered:
        raise ApiError(ErrorCode.BAD_MESSAGE, "an assistant message with tool_calls must be "
                       "followed by a tool message answering each call; "
                       f"{', '.join(repr(i[:64]) for i in unanswered[:8])} got none",
                       param=f"messages.{caller}.tool_calls")


# What `vllm_xargs` may hold here (vLLM passes its keys on to custom logits processors,
# which Antiphon's engine has none of).
VLLM_XARGS = frozenset({"session_id", "request_class", "ttft_slo_s", "tpot_slo_s"})


def check_request(chat: ChatService, body: Sampling, max_tokens: int | None,
                  xargs: dict[str, Any], max_tokens_param: str = "max_tokens") -> None:
    """The checks a chat and a text completion share, none needing a tokenizer: max_tokens
    (sent as `max_tokens_param`), `vllm_xargs` (class and targets), stop sequences,
    logit_bias. Raises `ApiError`."""
    chat.check_max_tokens(max_tokens, max_tokens_param)
    unknown = sorted(set(xargs) - VLLM_XARGS)
    if unknown:  # a misspelt session_id would run as a plain request, without its session
        raise ApiError(ErrorCode.BAD_MESSAGE, f"vllm_xargs has keys this server does not know: "
                       f"{', '.join(repr(k[:64]) for k in unknown[:5])}; it takes "
                       f"{', '.join(sorted(VLLM_XARGS))}", param="vllm_xargs")
    request_class_xarg(xargs)
    slo_overrides(chat, xargs)
    chat.check_stop(body.stop_sequences)
    chat.check_logit_bias(body.sampling().get("logit_bias", ()))


def session_xarg(body: ChatCompletionRequest) -> str | None:
    """The session `vllm_xargs.session_id` names (checked for form, not existence)."""
    session_id = (body.vllm_xargs or {}).get("session_id")
    if session_id is not None and not (
            isinstance(session_id, str) and re.fullmatch(ID_PATTERN, session_id)):
        raise ApiError(ErrorCode.BAD_MESSAGE, "vllm_xargs.session_id must be a session id "
                       "(1 to 64 letters, digits or _.:-)")
    return session_id


def prepare_completion(chat: ChatService, body: ChatCompletionRequest, owner: str,
                       request_class: RequestClass | None = None,
                       session_id: str | None = None) -> list[Generation]:
    """The generations of `owner`'s for `body`, one per choice, in `session_id` where given;
    their class is `request_class`, else the one `vllm_xargs` names, else the owner's (RT but
    for a best-effort key). Raises `ApiError` and changes nothing on bad input."""
    turns = completion_turns(chat, body)
    if request_class is None:
        request_class = request_class_xarg(body.vllm_xargs or {})
    gen = chat.prepare(
        secrets.token_hex(12), turns, body.requested_max_tokens, request_class, session_id,
        owner=owner, tools=body.tool_specs(),
        **body.sampling(), **slo_overrides(chat, body.vllm_xargs or {}))
    gen.tool_use = body.tool_use()
    return gen.with_choices(body.num_choices)


def request_class_xarg(xargs: dict[str, Any]) -> RequestClass | None:
    """The class `vllm_xargs.request_class` names (None where it names none)."""
    if "request_class" not in xargs:
        return None
    try:
        return RequestClass(xargs["request_class"])
    except ValueError:
        raise ApiError(ErrorCode.BAD_MESSAGE,
                       "vllm_xargs.request_class must be 'rt' or 'be'") from None


def slo_overrides(chat: ChatService, xargs: dict[str, Any]) -> dict[str, Any]:
    """Per-request TTFT/TPOT targets from `vllm_xargs` (seconds, finite), no tighter than
    `--min-request-slo-frac` of the deployment's: a tighter target takes step time from every
    other request, so one client could otherwise shrink everyone's batches."""
    out: dict[str, Any] = {}
    frac = chat.config.min_request_slo_frac
    for key, deployment_s in zip(("ttft_slo_s", "tpot_slo_s"), chat.rt_slo_s, strict=True):
        if key in xargs:
            value = xargs[key]
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 < value <= MAX_REQUEST_SLO_S):
                raise ApiError(ErrorCode.BAD_MESSAGE, f"vllm_xargs.{key} must be a positive "
                               f"number of seconds, at most {MAX_REQUEST_SLO_S:g}")
            if value < frac * deployment_s:
                raise ApiError(ErrorCode.BAD_MESSAGE, (
                    f"vllm_xargs.{key} {value:g} is tighter than this server allows: at least "
                    f"{frac * deployment_s:g} s ({frac:g} of the deployment's {deployment_s:g} "
                    "s; --min-request-slo-frac)"))
            out[key] = float(value)
    return out


def completion_object(gens: Sequence[Generation], model: str) -> dict[str, Any]:
    """The non-streaming `chat.completion` response of a request's finished choices."""
    return {
        "id": "chatcmpl-" + gens[0].request_id, "object": "chat.completion",
        "created": gens[0].created, "model": model,
        "choices": [_choice(g) for g in gens],
        "usage": total_usage(gens),
    }


def _choice(gen: Generation) -> dict[str, Any]:
    message, finish_reason = reply_message(gen.text, gen.finish_reason, gen.tool_use)
    return {"index": gen.index, "message": message, "logprobs": gen.logprobs(),
            "finish_reason": finish_reason}
