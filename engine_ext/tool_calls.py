"""Tool calls in a conversation, in the Hermes format: how the tools and the calls are written
into a prompt for a model whose chat template knows no tools, and how calls are read back out
of a reply.

The format (NousResearch's Hermes, also Qwen 2.5's and SmolLM2's) puts the tools' signatures
in the system message and has the model answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (SmolLM2 writes a JSON list of calls in one block: read too). A tool's
result goes back as a user message holding `<tool_response>` blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from antiphon.engine_ext.types import ChatTurn, ToolCall, ToolSpec, strict_json

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools:\n<tools>\n{tools}\n</tools>\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags as "
    'follows:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def hermes_turns(turns: Sequence[ChatTurn], tools: Sequence[ToolSpec]) -> list[ChatTurn]:
    """`turns` as plain (role, content) turns in the Hermes format, for a template that knows
    no tools: the tools' signatures added to the system message (one made when there is
    none), each assistant's calls written as `<tool_call>` blocks after its text, and each run
    of tool results one user message of `<tool_response>` blocks."""
    out: list[ChatTurn] = []
    results: list[str] = []

    def flush_results() -> None:
        if results:
            out.append(ChatTurn("user", "\n".join(results)))
            results.clear()

    for turn in turns:
        if turn.role == "tool":
            results.append(f"<tool_response>\n{turn.content}\n</tool_response>")
            continue
        flush_results()
        if turn.tool_calls:
            blocks = [f"{CALL_OPEN}\n{call_json(c)}\n{CALL_CLOSE}" for c in turn.tool_calls]
            out.append(ChatTurn(turn.role, "\n".join([turn.content, *blocks] if turn.content
                                                     else blocks)))
        else:
            out.append(turn)
    flush_results()
    if tools:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.to_json()) for t in tools))
        if out and out[0].role == "system":
            out[0] = ChatTurn("system", f"{out[0].content}\n\n{listing}")
        else:
            out.insert(0, ChatTurn("system", listing))
    return out


def call_json(call: ToolCall) -> str:
    """A call as the model writes it: the arguments as an object where they are JSON text of
    one, else as the text given."""
    return json.dumps({"name": call.name, "arguments": call.arguments_value()},
                      ensure_ascii=False)


@dataclasses.dataclass
class HermesReader:
    """Reads a reply as it streams: the text outside `<tool_call>` blocks, and the calls of
    the blocks. A block that does not hold a call stays text, and so does one the reply leaves
    open, unless the reply ended on its own (`finish`). Whitespace next to a call is dropped; other text is kept as it is. Text that may be
    the start of a block, and whitespace, are held back until it is known what they are: the
    events are the same however the reply is cut into pieces."""

    names: Collection[str] | None = None  # the tools offered: a block calling another is text
    _buffer: str = ""
    _inside: bool = False  # the buffer starts with an open block
    _gap: str = ""  # the whitespace before the open block (text again if the block is)
    _after_call: bool = False  # the last event was a call: whitespace next is dropped

    def feed(self, piece: str) -> Iterator[str | list[tuple[str, str]]]:
        """The reply's next piece in; out, in order: text (str) and each block's calls (a list
        of (name, arguments as JSON text))."""
        self._buffer += piece
        while True:
            if self._inside:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return
                end += len(CALL_CLOSE)
                block, self._buffer = self._buffer[:end], self._buffer[end:]
                calls = parse_calls(block[len(CALL_OPEN):-len(CALL_CLOSE)], self.names)
                if calls is None:
                    yield from self._text(self._gap + block)
                else:
                    self._after_call = True
                    yield calls
                self._inside, self._gap = False, ""
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                head = self._buffer[:start].rstrip()
                yield from self._text(head)
                self._gap = self._buffer[len(head):start]
                self._buffer, self._inside = self._buffer[start:], True
                continue
            head = self._buffer[:len(self._buffer) - _open_prefix_length(self._buffer)].rstrip()
            yield from self._text(head)
            self._buffer = self._buffer[len(head):]
            return

    def finish(self, ended: bool = True) -> Iterator[str | list[tuple[str, str]]]:
        """The reply ended: what is held back, as text, but for a last block left open that
        holds calls where the reply `ended` on its own (finish reason "stop": a model that
        ends its turn right after the call, or a client's stop string "</tool_call>"; as
        vLLM's Hermes parser reads it). A reply cut short keeps it as text."""
        calls = (parse_calls(self._buffer[len(CALL_OPEN):], self.names)
                 if self._inside and ended else None)
        rest = (self._gap if self._inside else "") + self._buffer
        self._buffer, self._inside, self._gap = "", False, ""
        if calls is not None:
            self._after_call = True
            yield calls
        else:
            yield from self._text(rest)

    def _text(self, text: str) -> Iterator[str]:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            yield text


def read_reply(text: str, names: Collection[str] | None = None, ended: bool = True,
               ) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole reply's text and calls (of `names` only, where given); the text is None where
    the reply holds calls and nothing else. `ended`: the reply ended on its own
    (`HermesReader.finish`)."""
    reader = HermesReader(names=names)
    texts: list[str] = []
    calls: list[tuple[str, str]] = []
    for event in [*reader.feed(text), *reader.finish(ended)]:
        if isinstance(event, str):
            texts.append(event)
        else:
            calls.extend(event)
    content = "".join(texts)
    return (content or None) if calls else content, calls


def parse_calls(body: str, names: Collection[str] | None = None) -> list[tuple[str, str]] | None:
    """The calls in `body`, JSON of a call or a list of them, each as (name, arguments as JSON
    text of an object); None where it is not (and where a name is not one of `names`, when
    given). A call is `{"name": ..., "arguments": {...}}`; "parameters" (Llama 3.1's word) is
    read as "arguments", and arguments may be JSON text of an object (as OpenAI gives them)."""
    try:
        value = strict_json(body)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]
                and (names is None or item["name"] in names)):
            return None
        arguments = item.get("arguments", item.get("parameters"))
        if isinstance(arguments, str):
            try:
                arguments = strict_json(arguments)
            except ValueError:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _open_prefix_length(text: str) -> int:
    """Length of the longest end of `text` that begins `<tool_call>`."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def tool_message(turn: ChatTurn) -> dict[str, Any]:
    """A turn as a chat template that knows tools takes it (Hugging Face's convention:
    arguments as an object where they are JSON text of one). Call ids become 9 letters and
    digits, the same for a call and its result: some templates (Mistral's) refuse others,
    and the rest only pair them."""
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": template_call_id(c.id), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_value()}}
            for c in turn.tool_calls]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = template_call_id(turn.tool_call_id)
    return message


def template_call_id(call_id: str) -> str:
    """A call id as 9 letters and digits, derived from it (so a prompt renders the same each
    time, and its KV is reused)."""
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8])
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[(number // 62**i) % 62] for i in range(9))
