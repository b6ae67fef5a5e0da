"""Tool calls: the Hermes format written into prompts and read out of replies, whole and
streamed, without a server."""

from __future__ import annotations

import json

import pytest

from antiphon.engine_ext.tool_calls import HermesReader, hermes_turns, read_reply
from antiphon.engine_ext.types import ChatTurn, ToolCall, ToolSpec
from antiphon.server.tools import ToolStream, ToolUse, calls_schema, reply_message

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
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), "Let me look.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    # SmolLM2 writes its calls as a list in one block
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
     "</tool_call>", None, [("a", "{}"), ("b", '{"x": 1}')]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
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
        assert ("".join(texts).strip() or None, streamed) == (content, calls)
        assert not any("<tool_call" in t and "</tool_call>" not in t and content is None
                       for t in texts)


def test_a_reply_message_holds_the_calls_and_says_so_in_its_finish_reason() -> None:
    auto = ToolUse("auto")
    message, finish = reply_message(CALL, "stop", auto)
    assert message["content"] is None and finish == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reply_message("Sunny.", "stop", auto) == (
        {"role": "assistant", "content": "Sunny."}, "stop")
    assert reply_message(CALL, "stop", None)[0] == {"role": "assistant", "content": CALL}
    # one call at most where parallel calls are off
    two = CALL + CALL.replace("Paris", "Rome")
    assert len(reply_message(two, "stop", ToolUse("auto", parallel=False))[0]["tool_calls"]) == 1
    # a named function: the reply is its arguments; finish "stop", as OpenAI's
    named = ToolUse("function", "get_weather")
    message, finish = reply_message(' {"city": "Oslo"}', "stop", named)
    assert finish == "stop" and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # required: a list of calls; cut short, or not a list of calls, it is text
    required = ToolUse("required")
    message, finish = reply_message('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                                    "stop", required)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reply_message('[{"name": "get_w', "length", required) == (
        {"role": "assistant", "content": '[{"name": "get_w'}, "length")
    assert reply_message("{}", "stop", required)[0] == {"role": "assistant", "content": "{}"}


def test_a_stream_gives_each_call_when_it_is_whole_and_named_arguments_as_they_come() -> None:
    stream = ToolStream(ToolUse("auto"))
    deltas = [d for piece in ["Let me ", "look.", " <tool", "_call>\n{", '"name": "get_weather", ',
                              '"arguments": {}}\n</tool_call>'] for d in stream.feed(piece)]
    rest, finish = stream.finish("stop")
    assert [d.get("content") for d in deltas[:2]] == ["Let me", " look."]
    (entry,) = deltas[2]["tool_calls"]
    assert entry["index"] == 0 and entry["function"] == {"name": "get_weather",
                                                         "arguments": "{}"}
    assert rest == [] and finish == "tool_calls"

    named = ToolStream(ToolUse("function", "get_weather"))
    first, second = named.feed('{"city"'), named.feed(': "Oslo"}')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}]
    assert named.finish("stop") == ([], "stop")

    required = ToolStream(ToolUse("required"))
    assert required.feed('[{"name": "get_weather", ') == []
    assert required.feed('"arguments": {"city": "Oslo"}}]') == []
    (delta,), finish = required.finish("stop")
    assert delta["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert finish == "tool_calls"


def test_required_calls_are_held_to_a_list_of_the_tools() -> None:
    other = ToolSpec("now")
    schema = json.loads(calls_schema([WEATHER, other], parallel=False))
    assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 1)
    weather, now = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"const": "get_weather"}
    assert weather["properties"]["arguments"]["required"] == ["city"]
    assert now["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert "maxItems" not in json.loads(calls_schema([WEATHER], parallel=True))


NATIVE_TEMPLATE = (  # a template that knows tools, as Qwen 2.5's and Llama 3.1's do
    "{% if tools %}<|im_start|>system\nTOOLS{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% if m.tool_call_id %}ANSWERS "
    "{{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_models_template_renders_tools_where_it_knows_them() -> None:
    """SmolLM2's template knows no tools, so they are written in the Hermes format; a template
    that knows them gets them, and the calls (arguments as an object), as it expects."""
    from antiphon.engine_ext.config import EngineConfig
    from antiphon.engine_ext.engine import VllmEngine
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
    native._tokenizer.chat_template = NATIVE_TEMPLATE
    assert native.decode(native.render_chat(turns, tools=[WEATHER])) == (
        "<|im_start|>system\nTOOLS get_weather<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\nCALL get_weather {"city": "Paris"}<|im_end|>\n'
        "<|im_start|>tool\n18 CANSWERS c1<|im_end|>\n<|im_start|>assistant\n")
