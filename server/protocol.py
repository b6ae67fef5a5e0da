"""Websocket chat protocol (`/v1/ws`): typed JSON messages with one decode and one encode.

Client to server::

    {"type": "session.open", "session_id": null | str, "title": str?, "system": str?,
     "request_id": str?}
    # `system`: a new session's system message, which the model sees first at every turn
    {"type": "session.list", "before": str?}
    {"type": "session.rename", "session_id": str, "title": str, "request_id": str?}
    {"type": "session.delete", "session_id": str, "request_id": str?}
    # a session frame's `request_id` is named by the frame answering it, or by its error
    {"type": "message", "session_id": str, "content": str, "request_id": str?,
     "max_tokens": int?, <sampling>}
    {"type": "regenerate", "session_id": str, "request_id": str?, "max_tokens": int?,
     <sampling>}  # answer the last user message again (see `Regenerate`)
    {"type": "tool_results", "session_id": str, "results": [{"tool_call_id": str,
     "content": str}, ...], "request_id": str?, "max_tokens": int?, <sampling>}
     # one result for each call of the session's last reply, then its next reply
    <sampling>: as a chat completion's (`Sampling`, `ToolOffer`): "temperature", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stop", "seed", "response_format", "logit_bias", and the tools the model
    may call: "tools", "tool_choice", "parallel_tool_calls" (given with each turn, as in the
    OpenAI API); each optional (an unset temperature is the server's --default-temperature,
    else the model's)
    {"type": "typing", "session_id": str, "priority": int (-100 to 100, as an advisory's;
     optional)}
    {"type": "cancel", "request_id": str}

Server to client::

    {"type": "session", "session": {...}, "messages": [...], "replying": bool,
     "request_id": str?}
    # `replying`: a turn of the session is running (from another connection, or the REST
    # API): its last message is being answered, and the session is busy until it is done
    {"type": "sessions", "sessions": [...], "has_more": bool, "before": str | null,
     "next_before": str | null}  # most recent first, up to a limit; `next_before` pages on
    {"type": "session.renamed", "session": {...}, "request_id": str?}
    {"type": "session.deleted", "session_id": str, "request_id": str?}
    {"type": "accepted", "request_id": str, "session_id": str, "prompt_tokens": int}
    {"type": "token", "request_id": str, "session_id": str, "text": str}
    {"type": "done", "request_id": str, "session_id": str, "finish_reason": str, "text": str,
     "usage": {...}, "timings": {"ttft_s": float, "tpot_s": float | null, "total_s": float},
     "context_start": int,  # the first message the model still sees (0: all of them)
     "tool_calls": [{"id": str, "type": "function", "function": {"name": str,
     "arguments": str}}, ...]?}  # a reply that called tools (finish_reason "tool_calls";
     # "stop" for a function named by tool_choice): `token` frames and `text` carry its
     # content only; the session's next turn is the calls' `tool_results`
    {"type": "error", "code": str, "message": str, "request_id": str | null}
    # a turn's error after its `accepted`: its user message stays (regenerate answers it),
    # except with code "bad_message": the engine refused the request, and the message is
    # taken back as if it had never been sent
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from antiphon.engine_ext.types import JsonTooDeep, ToolSpec, strict_json
from antiphon.server.errors import ApiError, ErrorCode, bad_message
from antiphon.server.schemas import MAX_SCHEMA_LENGTH_BOUNDS, SchemaObject, length_bounds
from antiphon.server.tools import (
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
    ToolUse,
    opened,
    reply_schema,
)

# Ids are opaque tokens chosen by the server or the client; restricting their alphabet keeps them
# safe to log and to use as keys.
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
# Numbers and flags as JSON has them: "5" is not 5, and true is not 1.
StrictInt = Annotated[int, Field(strict=True)]
MAX_ADVISORY_PRIORITY = 100  # an advisory's priority is from minus this to this
# Higher goes first: its prefetch runs ahead of (and takes the host room of) those of lower
# priority. Null, as Symphony's agents send it: 0.
AdvisoryPriority = Annotated[StrictInt, Field(ge=-MAX_ADVISORY_PRIORITY,
                                              le=MAX_ADVISORY_PRIORITY)] | None
StrictFloat = Annotated[float, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
SEED_RANGE = (-(2**63), 2**64 - 1)  # what the engine's samplers take
StopText = Annotated[str, Field(min_length=1)]
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]




class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is refused, never dropped
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    """As OpenAI's: letters, digits, underscores and dashes."""
    description: str | None = None
    json_schema: SchemaObject | None = Field(None, alias="schema")
    """None (as OpenAI allows): any JSON object."""
    strict: StrictBool | None = None
    """Replies always match the schema (decoding is constrained), strict or not."""


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def schema_text(self) -> str | None:
        """The schema replies must match, as JSON text (None for plain text)."""
        if self.type == "json_object" or (
                self.json_schema is not None and self.json_schema.json_schema is None):
            return '{"type": "object"}'
        if self.json_schema is not None:
            return json.dumps(opened(self.json_schema.json_schema))
        return None


class Sampling(BaseModel):
    """How a reply is sampled, in OpenAI's terms with vLLM's extensions: what a chat
    completion and a websocket turn both take. Unset (None) is the server's default, then the
    model's (`ChatService.prepare`)."""

    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    """0 (which OpenAI takes, and vLLM does not): the likeliest token alone, as top_k 1."""
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31 - 1)] | None = None
    """vLLM's: sample from the k likeliest tokens; 0 or -1 for all (bounded: past 2**64,
    vLLM's request encoding failed, a 500; past the vocabulary, k is all of it)."""
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0.0)] | None = None
    """vLLM's: above 1 discourages tokens already in the prompt or output."""
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    """vLLM's: output tokens generated before EOS or a stop sequence may end the reply."""
    stop: StopText | list[StopText] | None = None
    """At most the server's `max_stop_sequences`, each non-empty and at most
    `max_stop_chars` long."""
    seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100.0, le=100.0)]] | None = None
    """OpenAI's: added to the logits of the tokens named (by id, as text) before sampling;
    -100 bans a token, 100 all but forces it. At most the server's `max_logit_bias_tokens`."""

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not re.fullmatch(r"0|[1-9][0-9]{0,9}", key):
                raise ValueError(f"keys must be token ids (decimal integers as text, as in "
                                 f'{{"50256": -100}}), not {key[:20]!r}')
        return bias

    @model_validator(mode="after")
    def _schema_compiles(self) -> Sampling:
        if not isinstance(self, ToolOffer):  # (which checks once its tools are consistent)
            self._check_schema_bounds()
        return self

    def _check_schema_bounds(self) -> None:
        schema = self.sampling().get("json_schema")  # what the engine compiles, if anything
        bounds = 0 if schema is None else length_bounds(json.loads(schema))
        if bounds > MAX_SCHEMA_LENGTH_BOUNDS:
            raise ValueError(f"the schema the reply is held to (response_format, tools) bounds "
                             f"the length of {bounds} strings; at most "
                             f"{MAX_SCHEMA_LENGTH_BOUNDS} may be (each costs the engine's "
                             "grammar compiler up to seconds)")

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters set, as `GenerationParams` fields (the rest keep their
        defaults)."""
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_tokens", "seed")}
        if self.top_k is not None:
            given["top_k"] = max(self.top_k, 0)  # -1 and 0 both mean every token
        if self.top_p == 0:
            given["top_p"], given["top_k"] = None, 1
        given["stop"] = self.stop_sequences
        if self.response_format is not None:
            given["json_schema"] = self.response_format.schema_text()
        if self.logit_bias:
            given["logit_bias"] = tuple(sorted((int(t), b) for t, b in self.logit_bias.items()))
        return {name: value for name, value in given.items() if value is not None}


class ToolOffer(Sampling):
    """The tools a request offers the model (OpenAI's `tools`, `tool_choice`,
    `parallel_tool_calls`; see `server/tools.py`): what a chat completion and a websocket turn
    both take."""

    tools: list[ToolDefinition] | None = None
    """Functions the model may call (`--max-tools` at most, names unique)."""
    tool_choice: ToolChoice | None = None
    """"auto" with tools (the default), "none", "required", or a function named."""
    parallel_tool_calls: StrictBool | None = None
    """False: one call at most (default true)."""

    @model_validator(mode="after")
    def _tools_consistent(self) -> ToolOffer:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools must have different names")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice other than none or auto needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one "
                             "of the tools")
        self._check_schema_bounds()
        return self

    def tool_use(self) -> ToolUse | None:
        """How the reply holds tool calls; None where it holds none (no tools, or
        tool_choice "none")."""
        choice = self.tool_choice or "auto"
        if not self.tools or choice == "none":
            return None
        names = tuple(t.function.name for t in self.tools)
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            return ToolUse("function", names, choice.function.name, parallel)
        if choice == "required":
            return ToolUse("required", names, None, parallel)
        structured = self.response_format is not None and self.response_format.type != "text"
        return ToolUse("auto", names, None, parallel, structured)

    def tool_specs(self) -> list[ToolSpec]:
        """The tools the model is shown (none where tool_choice is "none")."""
        if self.tool_use() is None:
            return []
        return [t.spec() for t in self.tools or ()]

    def sampling(self) -> dict[str, Any]:
        given = super().sampling()
        use = self.tool_use()
        if use is not None:  # the tools' schema, over (or around) the response_format's
            schema = reply_schema(use, self.tool_specs(), given.pop("json_schema", None))
            if schema is not None:
                given["json_schema"] = schema
            given["keep_tool_tags"] = True  # (the calls' tags may be special tokens)
        return given


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Answered(_Msg):
    request_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    """Client-chosen, named by the frame that answers this one, or by its error (which
    session a `session` frame opened, when several opens are in flight)."""


class SessionOpen(_Answered):
    type: Literal["session.open"]
    session_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    """Existing session to resume; null opens a new one."""
    title: Annotated[str, Field(max_length=200)] | None = None
    system: str | None = None
    """A new session's system message, which the model sees before the conversation
    (`--max-content-chars` at most, as a message)."""


class SessionList(_Msg):
    type: Literal["session.list"]
    before: Annotated[str, Field(max_length=200)] | None = None
    """A listing's `next_before`: the page after it; null lists the most recent."""


class SessionRename(_Answered):
    type: Literal["session.rename"]
    session_id: Annotated[str, Field(pattern=ID_PATTERN)]
    title: Annotated[str, Field(min_length=1, max_length=200)]


class SessionDelete(_Answered):
    type: Literal["session.delete"]
    session_id: Annotated[str, Field(pattern=ID_PATTERN)]
    """Deletes the session and its messages (and erases its KV); refused with `session_busy`
    while a reply of it is streaming."""


class TurnRequest(_Msg, ToolOffer):
    """What every request for a reply carries: its session, ids, how it is sampled, and the
    tools the model may call."""

    session_id: Annotated[str, Field(pattern=ID_PATTERN)]
    request_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    """Client-chosen id for correlating replies; the server assigns one when absent."""
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class ChatMessage(TurnRequest):
    type: Literal["message"]
    content: str
    """The user's message; its size limit is the server's `max_content_chars`."""


class Regenerate(TurnRequest):
    """Answer the session's last user message again. The new reply replaces the last one
    when it is committed (a regenerate stopped before its first token keeps the old reply);
    a message left without a reply (the server crashed or the engine failed while answering
    it) gets its first."""

    type: Literal["regenerate"]


class ToolResult(_Msg):
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)]
    """The call it answers: one of the session's last reply's `tool_calls`."""
    content: str
    """What the tool returned (its size limit is the server's `max_content_chars`)."""


class ToolResults(TurnRequest):
    """The results of the tools the session's last reply called, one for each of its calls,
    and a request for the reply that reads them (as OpenAI's `tool` messages)."""

    type: Literal["tool_results"]
    results: Annotated[list[ToolResult], Field(min_length=1)]


class Typing(_Msg):
    type: Literal["typing"]
    session_id: Annotated[str, Field(pattern=ID_PATTERN)]
    priority: AdvisoryPriority = None  # the advisory's (`POST /v1/advisory`)


class Cancel(_Msg):
    type: Literal["cancel"]
    request_id: Annotated[str, Field(pattern=ID_PATTERN)]


ClientMessage = Annotated[
    SessionOpen | SessionList | SessionRename | SessionDelete | ChatMessage | Regenerate
    | ToolResults | Typing | Cancel,
    Field(discriminator="type"),
]
_client_adapter: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
CLIENT_TYPES = ("session.open", "session.list", "session.rename", "session.delete", "message",
                "regenerate", "tool_results", "typing", "cancel")


def parse_json(raw: str | bytes, what: str = "message") -> Any:
    """Strict JSON as the APIs take it: no NaN or Infinity, nesting Python can walk, and every
    string valid Unicode (a `\\ud800` escape decodes to an unpaired surrogate, which nothing
    downstream can encode). Raises `bad_json` naming `what`."""
    try:
        if isinstance(raw, bytes):  # UTF-8 only: json.loads would also guess UTF-16 and 32
            raw = raw.decode("utf-8-sig")
        data = strict_json(raw)
    except JsonTooDeep:
        raise ApiError(ErrorCode.BAD_JSON, f"{what} is nested too deeply") from None
    except UnicodeEncodeError:
        raise ApiError(ErrorCode.BAD_JSON, f"{what} has a string that is not valid Unicode "
                       "(an unpaired surrogate escape)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the number checks
        raise ApiError(ErrorCode.BAD_JSON, f"{what} is not valid JSON: {exc}") from None
    return data


_REQUEST_ID = re.compile(ID_PATTERN.strip("^$"))
_REQUEST_ID_FIELD = re.compile(r'"request_id"\s*:\s*"(' + _REQUEST_ID.pattern + ')"')


def find_request_id(raw: str | bytes, *, parse: bool = True) -> str | None:
    """The request id of a frame that did not decode (too large, not JSON, invalid), so its
    error can still name the request a client waits on: a JSON object's own `request_id`
    (one nested in its tools or schema is another's), else, where it is no JSON or too large
    to `parse`, the one its text seems to carry."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if parse:
        try:
            data = strict_json(text)
        except ValueError:
            pass
        else:
            own = data.get("request_id") if isinstance(data, dict) else None
            return own if isinstance(own, str) and _REQUEST_ID.fullmatch(own) else None
    match = _REQUEST_ID_FIELD.search(text)
    return match.group(1) if match else None


def decode_client_message(raw: str | bytes) -> ClientMessage:
    """Parse one client frame; raises `ApiError` with a typed code on any defect."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise ApiError(ErrorCode.BAD_MESSAGE, "message must be a JSON object")
    kind = data.get("type")
    if kind not in CLIENT_TYPES:
        raise ApiError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {kind!r}; expected one of {', '.join(CLIENT_TYPES)}",
        )
    try:
        return _client_adapter.validate_python(data)
    except ValidationError as exc:
        raise bad_message(exc.errors(), prefix=f"{kind}: ", skip_loc=1,
                          default_loc="message") from None


def encode(kind: str, **fields: Any) -> str:
    """Encode one server-to-client message."""
    return json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))


def error_frame(err: ApiError, request_id: str | None = None) -> str:
    return encode("error", code=err.code.value, message=err.message, request_id=request_id)
