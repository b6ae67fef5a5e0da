"""Tool calling in chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`):
the request's tool definitions, how the reply is constrained, and how its calls are read back
into `message.tool_calls`, whole or streamed.

`tool_choice`:
- "auto" (the default with tools): the model decides; calls are read from its reply in the
  Hermes format (`engine_ext.tool_calls`), text outside them is the message's content, or
  from a reply that is all JSON of calls of the tools (Llama 3.1's and Mistral's way). With a
  `response_format`, the reply is constrained to a JSON list of calls or to that format.
- "required": the reply is constrained (structured output) to a JSON list of one or more calls
  of the tools given, each matching its function's parameter schema.
- a named function: the reply is constrained to that function's arguments; it streams as
  argument fragments, and ends "stop" as OpenAI's does.
- "none": the tools are not shown to the model.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from antiphon.engine_ext.tool_calls import HermesReader, parse_calls, read_reply
from antiphon.engine_ext.types import ToolSpec
from antiphon.server.schemas import NAMED_SCHEMAS, SCHEMA_VALUES, SchemaObject

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: SchemaObject | None = None
    """A JSON schema of the arguments (an object); none: the function takes no arguments."""

    @field_validator("parameters")
    @classmethod
    def _of_an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError("parameters must be the JSON schema of an object (its arguments)")
        return schema
    strict: StrictBool | None = None
    """Calls always match the schema where the reply is constrained ("required" or a named
    function), strict or not; with "auto" the model's calls are not checked."""


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition

    def spec(self) -> ToolSpec:
        f = self.function
        return ToolSpec(f.name, f.description,
                        None if f.parameters is None else json.dumps(f.parameters))


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    """JSON text, as the model wrote it."""


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation sent."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """How a choice's reply holds tool calls (None on a `Generation`: plain text)."""

    mode: Literal["auto", "required", "function"]
    names: tuple[str, ...]  # the tools offered
    function: str | None = None  # the function named (mode "function")
    parallel: bool = True  # more than one call allowed
    structured: bool = False  # "auto" with a response_format: calls as a JSON list, or content

    @property
    def finish_with_calls(self) -> str:
        """The finish reason of a reply that stopped on its own with calls."""
        return "stop" if self.mode == "function" else "tool_calls"

    def holds_whole(self, start: str) -> bool:
        """A reply that starts (its first character not whitespace) with `start` is read
        whole: it may be calls, known only at its end."""
        if self.mode == "required" or self.structured:
            return start == "["
        return start in ("[", "{")

    def read(self, text: str, ended: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole reply's content and calls (name, arguments as JSON text). A named
        function's reply is its call's arguments, as generated (cut short too). In
        "required", and "auto" with a response_format, calls are a JSON list (a reply cut
        short is content). In "auto", calls are `<tool_call>` blocks, or (as Llama 3.1 and
        Mistral models write them) the whole reply as JSON of calls of the tools. `ended`:
        the reply ended on its own (a last block left open may then be calls)."""
        if self.mode == "function":
            return None, [(self.function or "", text)]
        whole = parse_calls(text, self.names) if self.holds_whole(text.lstrip()[:1]) else None
        content: str | None
        if whole is not None:
            content, calls = None, whole
        elif self.mode == "required" or self.structured:
            return text, []
        else:
            content, calls = read_reply(text, self.names, ended)
        return content, calls if self.parallel else calls[:1]


def reply_message(text: str, finish_reason: str | None,
                  use: ToolUse | None) -> tuple[dict[str, Any], str | None]:
    """A choice's `message` and finish reason, its calls in `tool_calls`."""
    if use is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = use.read(text, ended=finish_reason == "stop")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call_object(name, arguments) for name, arguments in calls]
        if finish_reason == "stop":
            finish_reason = use.finish_with_calls
    return message, finish_reason


def call_object(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolStream:
    """One streamed choice's deltas: its text pieces in, `delta` objects out, the same
    content and calls as `ToolUse.read` gives the whole reply. Calls come as `tool_calls`
    entries: a `<tool_call>` block's when it closes, a named function's arguments fragment
    by fragment, and those of a reply read whole (`ToolUse.holds_whole`) at its end."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.num_calls = 0
        self.content: list[str] = []  # the content pieces given out so far
        self.calls: list[dict[str, Any]] = []  # the whole calls given out so far (no index)
        self._reader = HermesReader(names=use.names)
        self._held: list[str] = []  # the reply so far, while it may be read whole
        self._whole: bool | None = None  # read whole (None: not known yet)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        return self._given(self._feed(piece))

    def _feed(self, piece: str) -> list[dict[str, Any]]:
        if self.use.mode == "function":
            if self.num_calls == 0:
                return [self._delta([(self.use.function or "", piece)])]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]
        if self._whole is None:
            self._held.append(piece)
            start = "".join(self._held).lstrip()[:1]
            if not start:
                return []
            self._whole = self.use.holds_whole(start)
            if self._whole:
                return []
            piece = "".join(self._held)
        if self._whole:
            self._held.append(piece)
            return []
        if self.use.structured or self.use.mode == "required":  # no <tool_call> blocks
            return [{"content": piece}]
        return [d for d in map(self._delta, self._reader.feed(piece)) if d]

    def finish(self, finish_reason: str | None,
               cut: bool = False) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back, and the choice's finish reason. `cut`: the reply was cut
        short (cancelled): what is held back, a call still open or a reply still to be read
        whole, is dropped, not given out as content; the reply is what was given out
        (`content`, `calls`)."""
        if cut and self.use.mode != "function":
            return [], finish_reason
        if self.use.mode == "function":
            deltas = [] if self.num_calls else [self._delta([(self.use.function or "", "")])]
        elif self._whole is False:
            deltas = [self._delta(e) for e in self._reader.finish(finish_reason == "stop")]
        else:
            content, calls = self.use.read("".join(self._held), ended=finish_reason == "stop")
            deltas = [{"content": content} if content else {}, self._delta(calls)]
        if self.num_calls and finish_reason == "stop":
            finish_reason = self.use.finish_with_calls
        return self._given([d for d in deltas if d]), finish_reason

    def _given(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for delta in deltas:
            if delta.get("content"):
                self.content.append(delta["content"])
            self.calls.extend({k: v for k, v in c.items() if k != "index"}
                              for c in delta.get("tool_calls", ()) if "id" in c)
        return deltas

    def _delta(self, event: str | Sequence[tuple[str, str]]) -> dict[str, Any]:
        if isinstance(event, str):
            return {"content": event}
        entries = []
        for name, arguments in event:
            if self.num_calls and not self.use.parallel:
                break
            entries.append({"index": self.num_calls, **call_object(name, arguments)})
            self.num_calls += 1
        return {"tool_calls": entries} if entries else {}


def reply_schema(use: ToolUse, tools: Sequence[ToolSpec],
                 content_schema: str | None) -> str | None:
    """The JSON schema (text) a reply is held to: a named function's arguments; a list of
    calls of `tools` ("required"); either that or `content_schema` (the response_format's,
    in "auto"); None where "auto" replies are free."""
    if use.mode == "function":
        return json.dumps(opened(next(_arguments(t) for t in tools if t.name == use.function)))
    if use.mode == "auto" and content_schema is None:
        return None
    # Each schema goes under $defs, its references rebased there: references that reach
    # through a list (anyOf's) are beyond xgrammar.
    defs = {f"tool_{i}": _rebased(_arguments(t), f"#/$defs/tool_{i}")
            for i, t in enumerate(tools)}
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [{
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
    } for i, t in enumerate(tools)]}}
    if not use.parallel:
        calls["maxItems"] = 1
    if use.mode == "required":
        return json.dumps({**calls, "$defs": defs})
    assert content_schema is not None
    defs["content"] = _rebased(json.loads(content_schema), "#/$defs/content")
    return json.dumps({"anyOf": [calls, {"$ref": "#/$defs/content"}], "$defs": defs})


def _arguments(tool: ToolSpec) -> dict[str, Any]:
    """A tool's arguments' schema: an object's, whether or not its parameters say so."""
    schema: dict[str, Any] = ({"properties": {}} if tool.parameters_json is None
                              else json.loads(tool.parameters_json))
    return {"type": "object", **schema}


_OPEN_OBJECT = frozenset({"properties", "additionalProperties", "patternProperties",
                          "unevaluatedProperties"})


def opened(schema: Any) -> Any:
    """`schema` with its objects that name no properties open to any, as JSON Schema means
    them (`_rebased`): held as given, a named tool's `$ref` to such an object, or a
    response_format's, let the reply fill it with `{}` alone."""
    return _rebased(schema, "#")


def _rebased(schema: Any, base: str) -> Any:
    """`schema`, to be reached from `base` through a `$ref`: its references to its own root
    ("#...") made relative to `base`, and its objects that name no properties open to any
    (xgrammar, strict by default, lets such an object be `{}` alone when it is reached
    through a `$ref`, where it lets any object be inline)."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in SCHEMA_VALUES:
            out[key] = value
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(v, base) for name, v in value.items()}
        else:
            out[key] = _rebased(value, base)
    kinds = out.get("type")
    is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    if is_object and not _OPEN_OBJECT & out.keys():
        out["additionalProperties"] = True
    return out
