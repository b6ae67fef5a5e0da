"""Tool calling in chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`):
the request's tool definitions, how the reply is constrained, and how its calls are read back
into `message.tool_calls`, whole or streamed.

`tool_choice`:
- "auto" (the default with tools): the model decides; calls are read from its reply in the
  Hermes format (`engine_ext.tool_calls`), text outside them is the message's content.
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

from pydantic import BaseModel, ConfigDict, Field

from antiphon.engine_ext.tool_calls import HermesReader, read_reply
from antiphon.engine_ext.types import ToolSpec

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); none: the function takes no arguments."""
    strict: bool | None = None
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
    function: str | None = None  # the function named (mode "function")
    parallel: bool = True  # more than one call allowed

    @property
    def finish_with_calls(self) -> str:
        """The finish reason of a reply that stopped on its own with calls."""
        return "stop" if self.mode == "function" else "tool_calls"

    def read(self, text: str, finished: bool) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole reply's content and calls (name, arguments as JSON text); a constrained
        reply cut short (`finished` false) is content."""
        if self.mode == "auto":
            content, calls = read_reply(text)
            return content, calls if self.parallel else calls[:1]
        if not finished:
            return text, []
        if self.mode == "function":
            assert self.function is not None
            return None, [(self.function, text.strip())]
        try:  # the constraint makes a list of calls; a reply that is not one stays text
            calls = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                     for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
        return (None, calls) if calls else (text, [])


def reply_message(text: str, finish_reason: str | None,
                  use: ToolUse | None) -> tuple[dict[str, Any], str | None]:
    """A choice's `message` and finish reason, its calls in `tool_calls`."""
    if use is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = use.read(text, finish_reason == "stop")
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
    """One streamed choice's deltas: its text pieces in, `delta` objects out, calls as
    `tool_calls` entries (auto: each whole when its block closes; a named function: its
    arguments fragment by fragment; required: all at the end)."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.num_calls = 0
        self._reader = HermesReader()
        self._held: list[str] = []  # a "required" reply, read at its end

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self.use.mode == "function":
            if self.num_calls == 0:
                self.num_calls = 1
                first = call_object(self.use.function or "", piece)
                return [{"tool_calls": [{"index": 0, **first}]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]
        if self.use.mode == "required":
            self._held.append(piece)
            return []
        return [d for d in map(self._delta, self._reader.feed(piece)) if d]

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back, and the choice's finish reason."""
        if self.use.mode == "required":
            content, calls = self.use.read("".join(self._held), finish_reason == "stop")
            deltas = [self._delta(calls) if calls else {"content": content}]
        else:
            deltas = [self._delta(event) for event in self._reader.finish()]
        if self.num_calls and finish_reason == "stop":
            finish_reason = self.use.finish_with_calls
        return [d for d in deltas if d], finish_reason

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


def calls_schema(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """The JSON schema of a "required" reply: a list of calls, each of one of `tools`."""
    items = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": _arguments_schema(t)},
        "required": ["name", "arguments"]} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def arguments_schema(tool: ToolSpec) -> str:
    """The JSON schema of a named function's reply: its arguments."""
    return json.dumps(_arguments_schema(tool))


def _arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    if tool.parameters_json is None:
        return {"type": "object", "properties": {}}
    schema: dict[str, Any] = json.loads(tool.parameters_json)
    return schema
