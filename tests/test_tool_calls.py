"""Tool calls: the Hermes format written into prompts and read out of replies, whole and
streamed, without a server."""

from __future__ import annotations

import json

import pytest

from antiphon.engine_ext.tool_calls import (
    HermesReader,
    hermes_turns,
    parse_calls,
    read_reply,
    template_call_id,
)
from antiphon.engine_ext.types import ChatTurn, ToolCall, ToolSpec
from antiphon.server.tools import ToolStream, ToolUse, reply_message, reply_schema

WEATHER = ToolSpec("get_weather", "The weather in a city",
                   json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tools_go_into_the_system_message_and_calls_and_results_into_the_turns() -> None:
    turns = [ChatTurn("system", "Be brief."), ChatTurn("user", "Weather in Paris and Rome?"),
             ChatTurn("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                                        ToolCall("c2", "get_weather", "not json"))),
             ChatTurn("tool", "18 C", tool_call_id="c1"),
             ChatTurn("tool", "22 C", tool_call_id="c2"),
             ChatTurn("assistant", "Paris 18 C, Rome 22 C.")]
    system, user, calls, results, reply = hermes_turns(turns, [WEATHER])
    assert system.role == "system" and system.content.startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in system.content and "<tools>" in system.content
    assert user == turns[1]
    assert calls == ChatTurn("assistant", CALL + '\n<tool_call>\n{"name": "get_weather", '
                             '"arguments": "not json"}\n</tool_call>')
    assert results == ChatTurn("user", "<tool_response>\n18 C\n</tool_response>\n"
                               "<tool_response>\n22 C\n</tool_response>")
    assert reply == turns[-1]
    # no tools and no calls: the turns as they are; tools and no system message: one made
    assert hermes_turns(turns[1:2], []) == turns[1:2]
    made, asked = hermes_turns(turns[1:2], [WEATHER])
    assert made.role == "system" and "<tools>" in made.content and asked == turns[1]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Sunny.", "Sunny.", []),
    ("\n\nSunny.\n", "\n\nSunny.\n", []),  # text without calls is kept as it is
    ("", "", []),
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n\nDone.", "Let me look.Done.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    # SmolLM2 writes its calls as a list in one block
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
     "</tool_call>", None, [("a", "{}"), ("b", '{"x": 1}')]),
    # arguments as JSON text of an object, or none, or as Llama 3.1's "parameters"
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("a", '{"x": 1}')]),
    ('<tool_call>{"name": "a", "parameters": null}</tool_call>', None, [("a", "{}")]),
    # not a call: it stays text
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "a", "arguments": "Paris"}</tool_call>',
     '<tool_call>{"name": "a", "arguments": "Paris"}</tool_call>', []),
    ('cut short <tool_call>{"name": "a"', 'cut short <tool_call>{"name": "a"', []),
    ("a < b <tool", "a < b <tool", []),
])
def test_calls_are_read_from_a_reply_whole_and_streamed(
        text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert read_reply(text) == (content, calls)
    for size in (1, 3, 7):  # the same, whatever the pieces
        reader, texts, streamed = HermesReader(), [], []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for event in [e for p in pieces for e in reader.feed(p)] + list(reader.finish()):
            (texts.append if isinstance(event, str) else streamed.extend)(event)
        assert ("".join(texts) or (None if streamed else ""), streamed) == (content, calls)


AUTO = ToolUse("auto", ("get_weather", "now"))


@pytest.mark.parametrize(("use", "text", "content", "calls"), [
    (AUTO, "Sunny.", "Sunny.", []),
    (AUTO, CALL, None, [("get_weather", '{"city": "Paris"}')]),
    # Llama 3.1 answers a call as JSON alone; Mistral as a list (its [TOOL_CALLS] is special)
    (AUTO, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (AUTO, ' [{"name": "now", "arguments": {}}]', None, [("now", "{}")]),
    (AUTO, '{"name": "other", "arguments": {}}', '{"name": "other", "arguments": {}}', []),
    (AUTO, '{"answer": 4}', '{"answer": 4}', []),
    (ToolUse("auto", ("get_weather",), parallel=False), CALL + CALL, None,
     [("get_weather", '{"city": "Paris"}')]),
    # a block calling a tool not offered is text (OpenAI never returns such a call)
    (AUTO, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    # a named function: the reply is its arguments, as generated (cut short too)
    (ToolUse("function", ("get_weather",), "get_weather"), ' {"city": "Os', None,
     [("get_weather", ' {"city": "Os')]),
    (ToolUse("function", ("get_weather",), "get_weather"), "", None, [("get_weather", "")]),
    # required: a list of calls; cut short, or not calls of the tools, it is text
    (ToolUse("required", ("get_weather",)), '[{"name": "get_weather", "arguments": {}}]', None,
     [("get_weather", "{}")]),
    (ToolUse("required", ("get_weather",)), '[{"name": "get_w', '[{"name": "get_w', []),
    (ToolUse("required", ("get_weather",)), "{}", "{}", []),
    (ToolUse("required", ("get_weather",)), CALL, CALL, []),  # not what it is held to
    # auto with a response_format: a list of calls, or the content
    (ToolUse("auto", ("now",), structured=True), '[{"name": "now", "arguments": {}}]', None,
     [("now", "{}")]),
    (ToolUse("auto", ("now",), structured=True), '{"name": "now", "arguments": {}}',
     '{"name": "now", "arguments": {}}', []),
])
def test_each_tool_choice_reads_its_replies_the_same_whole_and_streamed(
        use: ToolUse, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert use.read(text) == (content, calls)
    message, finish = reply_message(text, "stop", use)
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])] == calls
    assert finish == ("tool_calls" if calls and use.mode != "function" else "stop")
    for size in (1, 4):
        stream = ToolStream(use)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])]
        rest, streamed_finish = stream.finish("stop")
        deltas += rest
        assert streamed_finish == finish
        streamed_text = "".join(d.get("content", "") for d in deltas)
        assert (streamed_text or None if calls else streamed_text) == content
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert [e["index"] for e in entries if "id" in e] == list(range(len(calls)))
        arguments: dict[int, str] = {}
        for e in entries:
            arguments[e["index"]] = arguments.get(e["index"], "") + e["function"]["arguments"]
        assert [(entries[[x["index"] for x in entries].index(i)]["function"]["name"], a)
                for i, a in arguments.items()] == calls


OPEN_CALL = "Checking.\n" + CALL.removesuffix("</tool_call>")  # a last block left open


@pytest.mark.parametrize(("finish_reason", "content", "calls", "finish"), [
    # ended on its own (EOS right after the call, or a client's stop "</tool_call>"): a call
    ("stop", "Checking.", [("get_weather", '{"city": "Paris"}')], "tool_calls"),
    # cut short: its JSON may be cut too, so it stays text
    ("length", OPEN_CALL, [], "length"),
])
def test_a_last_block_left_open_is_a_call_where_the_reply_ended_on_its_own(
        finish_reason: str, content: str, calls: list[tuple[str, str]], finish: str) -> None:
    message, given_finish = reply_message(OPEN_CALL, finish_reason, AUTO)
    assert (message["content"], given_finish) == (content, finish)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])] == calls
    for size in (1, 5):
        stream = ToolStream(AUTO)
        deltas = [d for i in range(0, len(OPEN_CALL), size)
                  for d in stream.feed(OPEN_CALL[i:i + size])]
        rest, streamed_finish = stream.finish(finish_reason)
        deltas += rest
        assert streamed_finish == finish
        assert "".join(d.get("content", "") for d in deltas) == content
        assert [(e["function"]["name"], e["function"]["arguments"])
                for d in deltas for e in d.get("tool_calls", [])] == calls


def test_a_reply_message_holds_calls_with_ids() -> None:
    message, finish = reply_message("Checking. " + CALL, "stop", AUTO)
    assert message["content"] == "Checking." and finish == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert reply_message(CALL, "stop", None) == ({"role": "assistant", "content": CALL}, "stop")
    assert reply_message(CALL, "length", AUTO)[1] == "length"


def test_constrained_replies_are_held_to_the_tools_schemas() -> None:
    """Each tool's schema sits under $defs with its references rebased there, as xgrammar
    (vLLM's first structured-output back end) resolves no reference through a list."""
    xgrammar = pytest.importorskip("xgrammar")
    nested = ToolSpec("q", None, json.dumps({
        "type": "object", "required": ["home"],
        "properties": {"home": {"$ref": "#/$defs/Addr"}},
        "$defs": {"Addr": {"type": "object", "required": ["street"],
                           "properties": {"street": {"type": "string"}}}}}))
    other = ToolSpec("now")
    tools = [WEATHER, nested, other]
    names = tuple(t.name for t in tools)
    stop = 95  # after the 95 printable characters
    info = xgrammar.TokenizerInfo([chr(i) for i in range(32, 127)] + ["</s>"],
                                  stop_token_ids=[stop])
    compiler = xgrammar.GrammarCompiler(info)

    def accepts(schema: str, text: str) -> bool:
        """The whole of `text` matches (the reply may end after it)."""
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(schema))
        return bool(matcher.accept_string(text) and matcher.accept_token(stop))

    one = reply_schema(ToolUse("required", names, parallel=False), tools, None)
    assert one is not None and json.loads(one)["maxItems"] == 1
    assert accepts(one, '[{"name": "q", "arguments": {"home": {"street": "a"}}}]')
    assert not accepts(one, '[{"name": "q", "arguments": {"home": {"street": 1}}}]')
    assert not accepts(one, '[{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]')
    assert not accepts(one, '[{"name": "get_time", "arguments": {}}]')
    content = json.dumps({"type": "object", "required": ["answer"],
                          "properties": {"answer": {"type": "integer"}}})
    either = reply_schema(ToolUse("auto", names, structured=True), tools, content)
    assert either is not None and accepts(either, '{"answer": 4}')
    assert accepts(either, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert not accepts(either, '{"answer": "four"}')
    named = reply_schema(ToolUse("function", names, "q"), tools, None)
    assert named is not None and accepts(named, '{"home": {"street": "a"}}')
    assert reply_schema(AUTO, tools, None) is None
    # objects that name no properties take any, reached through $defs as inline (xgrammar
    # would hold them to {}): free-form arguments, a free-form field, json_object's content
    free = ToolSpec("run", None, json.dumps({"properties": {"o": {"type": "object"}}}))
    bare = ToolSpec("go", None, "{}")
    both = reply_schema(ToolUse("required", ("run", "go")), [free, bare], None)
    assert both is not None
    assert accepts(both, '[{"name": "run", "arguments": {"o": {"x": 1}}}, '
                         '{"name": "go", "arguments": {"y": [2]}}]')
    assert not accepts(both, '[{"name": "go", "arguments": "x"}]')  # still an object
    anything = reply_schema(ToolUse("auto", ("go",), structured=True), [bare],
                            '{"type": "object"}')
    assert anything is not None and accepts(anything, '{"answer": 4}')
    # a property may be called like a keyword; its schema's references are rebased too
    keyword = ToolSpec("k", None, json.dumps({
        "properties": {"enum": {"$ref": "#/$defs/E"}}, "required": ["enum"],
        "$defs": {"E": {"enum": ["a", "b"]}}}))
    keyed = reply_schema(ToolUse("required", ("k",)), [keyword], None)
    assert keyed is not None and accepts(keyed, '[{"name": "k", "arguments": {"enum": "a"}}]')
    assert not accepts(keyed, '[{"name": "k", "arguments": {"enum": "c"}}]')


def test_an_object_reached_by_reference_is_open_whichever_way_the_reply_is_held() -> None:
    # A named tool_choice, and a response_format sent without tools, held the reply to the
    # schema as given, where xgrammar lets an object that names no properties, reached
    # through a $ref, be {} alone; "required" opened it (found by a review).
    xgrammar = pytest.importorskip("xgrammar")
    from antiphon.server.completions import ChatCompletionRequest

    params = {"type": "object", "$defs": {"Opts": {"type": "object"}},
              "properties": {"opts": {"$ref": "#/$defs/Opts"}}, "required": ["opts"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    messages = [{"role": "user", "content": "x"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": params}}
    filled = '{"opts": {"verbose": true}}'

    def schema(**fields: object) -> str:
        request = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, **fields})
        return request.sampling()["json_schema"]

    def accepts(schema_text: str, text: str) -> bool:
        info = xgrammar.TokenizerInfo([chr(i) for i in range(32, 127)] + ["</s>"],
                                      stop_token_ids=[95])
        compiled = xgrammar.GrammarCompiler(info).compile_json_schema(schema_text)
        matcher = xgrammar.GrammarMatcher(compiled)
        return bool(matcher.accept_string(text) and matcher.accept_token(95))

    named = schema(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert accepts(named, filled) and accepts(named, '{"opts": {}}')
    assert not accepts(named, '{"opts": 1}')
    assert accepts(schema(tools=[tool], tool_choice="required"),
                   f'[{{"name": "f", "arguments": {filled}}}]')
    assert accepts(schema(response_format=response_format), filled)
    assert accepts(schema(tools=[tool], response_format=response_format), filled)


def test_call_ids_are_given_to_templates_as_nine_letters_and_digits() -> None:
    ids = {template_call_id(f"call_{i}") for i in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert template_call_id("call_1") == template_call_id("call_1")


NATIVE_TEMPLATE = (  # a template that knows tools, as Qwen 2.5's and Llama 3.1's do
    "{% if tools %}<|im_start|>system\nTOOLS{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% if m.tool_call_id %}ANSWERS "
    "{{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_models_template_renders_tools_where_it_knows_them() -> None:
    """SmolLM2's template knows no tools, so they are written in the Hermes format; a template
    that knows them gets them, and the calls (arguments as an object), as it expects."""
    from antiphon.engine_ext.config import EngineConfig
    from antiphon.engine_ext.engine import EngineRequestError
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from tests.conftest import default_model_or_skip

    turns = [ChatTurn("user", "Weather in Paris?"),
             ChatTurn("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
             ChatTurn("tool", "18 C", tool_call_id="c1")]
    smol = VllmEngine(EngineConfig(), default_model_or_skip())
    smol.load_tokenizer()
    text = smol.decode(smol.render_chat(turns, tools=[WEATHER]))
    assert "<tools>" in text and CALL in text and "<tool_response>\n18 C" in text
    assert text == smol.decode(smol.render_chat(hermes_turns(turns, [WEATHER])))

    native = VllmEngine(EngineConfig(), default_model_or_skip())
    native.load_tokenizer()
    native.tokenizer.hf.chat_template = NATIVE_TEMPLATE
    call_id = template_call_id("c1")
    assert native.decode(native.render_chat(turns, tools=[WEATHER])) == (
        "<|im_start|>system\nTOOLS get_weather<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f'<|im_start|>assistant\nCALL {call_id} get_weather {{"city": "Paris"}}<|im_end|>\n'
        f"<|im_start|>tool\n18 CANSWERS {call_id}<|im_end|>\n<|im_start|>assistant\n")
    # a template's own refusal is the request's fault
    strict = VllmEngine(EngineConfig(), default_model_or_skip())
    strict.load_tokenizer()
    strict.tokenizer.hf.chat_template = (
        "{% if tools %}{{ raise_exception('one tool call at a time') }}{% endif %}"
        + NATIVE_TEMPLATE)
    with pytest.raises(EngineRequestError, match="refused the conversation: one tool call"):
        strict.render_chat(turns, tools=[WEATHER])
    # a filter given what it cannot take (arguments that are not an object, to `items`)
    strict.tokenizer.hf.chat_template = NATIVE_TEMPLATE.replace(
        "c.function.arguments | tojson", "c.function.arguments | items | list")
    cut_short = [turns[0], ChatTurn("assistant", "", (ToolCall("c1", "get_weather", '{"ci'),))]
    with pytest.raises(EngineRequestError, match="refused the conversation"):
        strict.render_chat(cut_short, tools=[WEATHER])


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"x": NaN}}',
                                  '{"name": "f", "arguments": {"x": 1e999}}',
                                  '{"name": "f", "arguments": "{\\"x\\": -Infinity}"}',
                                  '{"name": "f", "arguments": {"x": 1' + '0' * 400 + '}}',
                                  '{"name": "f", "arguments": {"x": "\\ud800"}}'])
def test_a_call_whose_arguments_are_not_standard_json_stays_text(body: str) -> None:
    """Python's parser takes NaN, Infinity, 1e999 and integers past a float's range; written
    back as a call's arguments they made text that JavaScript's JSON.parse and the Go and Java
    parsers refuse. It also takes an unpaired surrogate escape, which no UTF-8 encoder takes:
    the reply failed with an internal error."""
    assert parse_calls(body) is None
    text = f"<tool_call>\n{body}\n</tool_call>"
    use = ToolUse("auto", ("f",))
    message, finish = reply_message(text, "stop", use)
    assert "tool_calls" not in message and message["content"] == text and finish == "stop"
    assert ToolCall("c1", "f", '{"x": NaN}').arguments_value() == '{"x": NaN}'
    assert parse_calls('{"name": "f", "arguments": {"x": 1.5e3, "n": 10}}') == [
        ("f", '{"x": 1500.0, "n": 10}')]
    assert parse_calls('{"name": "f", "arguments": {"x": "\\ud83d\\ude00"}}') == [
        ("f", '{"x": "\U0001f600"}')]  # a surrogate pair is one character
