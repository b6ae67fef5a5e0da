"""The real default model on vLLM's CPU backend, through Antiphon's engine wrapper."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import pytest

from antiphon.engine_ext.engine import EngineRequestError, EngineRequestFailedError
from antiphon.engine_ext.types import ChatTurn, GenerationParams, ToolSpec
from antiphon.engine_ext.vllm_engine import VllmEngine
from antiphon.server.tools import ToolUse, reply_schema

pytestmark = pytest.mark.engine

QUESTION = [ChatTurn("user", "What is the capital of France? Answer in one word.")]


async def generate_text(engine: VllmEngine, request_id: str, turns: list[ChatTurn],
                        max_tokens: int = 24) -> tuple[str, str | None]:
    text, reason = "", None
    async for delta in engine.generate(request_id, engine.render_chat(turns),
                                       GenerationParams(max_tokens=max_tokens)):
        text += delta.text
        reason = delta.finish_reason or reason
    return text, reason


async def test_chat_template_comes_from_the_model(engine: VllmEngine) -> None:
    ids = engine.render_chat(QUESTION)
    text = engine.tokenizer.hf.decode(ids)
    assert "<|im_start|>user\nWhat is the capital of France?" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


async def test_greedy_answer_is_paris_and_deterministic(engine: VllmEngine) -> None:
    first, reason = await generate_text(engine, "paris-1", QUESTION)
    second, _ = await generate_text(engine, "paris-2", QUESTION)
    assert "Paris" in first and reason == "stop"
    assert first == second


async def test_logprobs_of_a_greedy_reply(engine: VllmEngine) -> None:
    """Each output token's log probability and its 3 most likely alternatives (OpenAI's
    logprobs / top_logprobs): greedy, the chosen token is as likely as the most likely one,
    and the tokens' texts are the reply's (the end-of-turn token left out, as from the text)."""
    text, logprobs = "", []
    async for delta in engine.generate("lp-1", engine.render_chat(QUESTION),
                                       GenerationParams(max_tokens=8, logprobs=3)):
        text += delta.text
        assert len(delta.logprobs) == len(delta.token_ids) - (delta.finish_reason == "stop")
        logprobs += delta.logprobs
    assert "Paris" in text and logprobs
    assert "".join(t.token for t in logprobs) == text
    for t in logprobs:
        assert len(t.top) == 3 and t.logprob <= 0
        assert t.logprob == t.top[0][1]  # the most likely (ties in bfloat16 are common)
        assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
    async for delta in engine.generate("lp-2", engine.render_chat(QUESTION),
                                       GenerationParams(max_tokens=4)):
        assert delta.logprobs == ()  # not asked for
    n_tokens, n_logprobs, reason = 0, 0, None  # a text completion's: the EOS token's too
    async for delta in engine.generate("lp-3", engine.render_chat(QUESTION), GenerationParams(
            max_tokens=24, logprobs=0, stop_token_logprob=True)):
        n_tokens, n_logprobs = n_tokens + len(delta.token_ids), n_logprobs + len(delta.logprobs)
        reason = delta.finish_reason or reason
    assert reason == "stop" and n_logprobs == n_tokens


async def test_prompt_logprobs_score_a_reply_as_its_generation_did(
        engine: VllmEngine) -> None:
    """Prompt logprobs (what an echo with logprobs returns, and lm-evaluation-harness scores a
    continuation by): a greedy reply, scored as part of a prompt, gets the log probabilities
    its generation gave each token, and each is the likeliest. A prompt the prefix cache
    holds is computed afresh (vLLM skips reading the cache), so every token has its logprob
    the second time too; the first token has none."""
    prompt = engine.render_chat(QUESTION)
    reply: list[int] = []
    generated: list[float] = []
    async for delta in engine.generate("score-0", prompt,
                                       GenerationParams(max_tokens=6, logprobs=0)):
        reply += delta.token_ids[:len(delta.logprobs)]  # an EOS has no logprob
        generated += [t.logprob for t in delta.logprobs]
    assert len(reply) >= 3

    for attempt in range(2):
        scored: tuple = ()
        async for delta in engine.generate(f"score-{attempt + 1}", prompt + reply,
                                           GenerationParams(max_tokens=1, prompt_logprobs=1)):
            scored += delta.prompt_logprobs
        assert len(scored) == len(prompt) + len(reply) and scored[0] is None
        assert all(t is not None for t in scored[1:])
        of_reply = scored[len(prompt):]
        assert "".join(t.token for t in of_reply) == engine.decode(reply)
        for t, expected in zip(of_reply, generated, strict=True):
            assert t.logprob == pytest.approx(expected, abs=1e-3)
            assert t.logprob == t.top[0][1]  # greedy: the likeliest


async def test_logit_bias_bans_and_forces_tokens(engine: VllmEngine) -> None:
    """OpenAI's logit_bias on vLLM's sampler: -100 on the greedy reply's first token makes
    the reply start otherwise, and +100 on another token makes it the first."""
    async def first_tokens(request_id: str, bias: tuple[tuple[int, float], ...]
                           ) -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for delta in engine.generate(request_id, engine.render_chat(QUESTION),
                                           GenerationParams(max_tokens=3, logit_bias=bias)):
            tokens += delta.token_ids
        return tokens

    greedy = await first_tokens("bias-0", ())
    assert await first_tokens("bias-1", ()) == greedy  # ("The capital of": greedy)
    banned = await first_tokens("bias-ban", ((greedy[0], -100.0),))
    assert banned[0] != greedy[0]
    london = engine.tokenizer.hf.encode("London", add_special_tokens=False)[0]
    forced = await first_tokens("bias-force", ((london, 100.0),))
    assert forced[0] == london != greedy[0]
    assert engine.vocab_size is not None and london < engine.vocab_size


async def test_follow_up_uses_the_conversation(engine: VllmEngine) -> None:
    answer, _ = await generate_text(engine, "ctx-1", QUESTION)
    turns = [*QUESTION, ChatTurn("assistant", answer),
             ChatTurn("user", "What is the population of that city, roughly?")]
    follow_up, _ = await generate_text(engine, "ctx-2", turns, max_tokens=48)
    assert "Paris" in follow_up


async def test_closing_the_stream_aborts_and_frees_the_request(engine: VllmEngine) -> None:
    stream = engine.generate("abort-me", engine.render_chat(
        [ChatTurn("user", "Write a very long essay about the sea.")]),
        GenerationParams(max_tokens=1000))
    async with aclosing(stream):
        async for delta in stream:
            if delta.num_new_tokens:
                break
    for _ in range(100):
        if (await engine.health()).num_unfinished_requests == 0:
            break
        await asyncio.sleep(0.05)
    health = await engine.health()
    assert health.is_healthy and health.num_unfinished_requests == 0


async def test_prompt_over_the_context_is_refused(engine: VllmEngine) -> None:
    with pytest.raises(EngineRequestError):
        async for _ in engine.generate("too-long", [1] * 3000, GenerationParams(max_tokens=4)):
            pass


async def test_a_json_schema_constrains_the_reply_beside_free_replies(
        engine: VllmEngine) -> None:
    """Structured output under Antiphon's scheduler: a request waiting for its grammar and
    requests beside it all finish; the constrained replies parse and match the schema."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "sure"],
              "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                             "sure": {"type": "boolean"}}}
    prompt = engine.render_chat(QUESTION)

    async def run(request_id: str, json_schema: str | None) -> str:
        text, reason = "", None
        async for delta in engine.generate(request_id, prompt, GenerationParams(
                max_tokens=40, json_schema=json_schema)):
            text += delta.text
            reason = delta.finish_reason
        return text if reason == "stop" else f"{text} (cut short: {reason})"

    replies = await asyncio.gather(*(run(f"json-{i}", json.dumps(schema) if i % 2 else None)
                                     for i in range(4)))
    for constrained in replies[1::2]:
        reply = json.loads(constrained)
        assert set(reply) == {"city", "sure"} and reply["city"] in ("Paris", "Lyon", "Nice")
        assert isinstance(reply["sure"], bool)
    assert all(replies[0::2])
    any_object = await run("json-object", '{"type": "object"}')  # may outgrow max_tokens
    assert any_object.lstrip().startswith("{"), any_object
    with pytest.raises(EngineRequestError, match="Grammar error"):
        await run("json-bad", json.dumps({"type": "nonsense"}))
    # A schema vLLM accepts whose grammar then allows no token: vLLM ends the request with
    # finish reason "error", which passed for an (empty) reply; it is the request's fault
    # (a 400), not the engine's (a batch item ran it again and again)
    with pytest.raises(EngineRequestError, match="cannot follow the response_format schema"):
        await run("json-none", json.dumps({"$ref": "#"}))


async def test_parameters_vllm_refuses_are_the_callers_error(engine: VllmEngine) -> None:
    with pytest.raises(EngineRequestError, match="stop"):
        async for _ in engine.generate("empty-stop", engine.render_chat(QUESTION),
                                       GenerationParams(max_tokens=4, stop=("",))):
            pass


async def test_a_request_that_fails_on_its_way_in_is_aborted(engine: VllmEngine) -> None:
    """A seed past 64 bits fails in vLLM after the request is registered but before the
    engine core has it (the API refuses such seeds first; the engine must not rely on that):
    the request fails alone, and nothing stays unfinished."""
    with pytest.raises(EngineRequestFailedError):
        async for _ in engine.generate("huge-seed", engine.render_chat(QUESTION),
                                       GenerationParams(max_tokens=4, seed=2**70)):
            pass
    health = await engine.health()
    assert health.is_healthy and health.num_unfinished_requests == 0
    text, _ = await generate_text(engine, "after-failure", QUESTION)
    assert "Paris" in text


async def test_a_required_tool_call_names_a_tool_offered_and_matches_its_schema(
        engine: VllmEngine) -> None:
    """SmolLM2's template knows no tools: they are written in the Hermes format, and
    "required" holds the reply to a list of one call of them (structured output)."""
    weather = ToolSpec("get_weather", "Current weather in a city", json.dumps({
        "type": "object", "required": ["city", "unit"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 40},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}))
    tools = [weather, ToolSpec("get_time", "Current time", None)]
    use = ToolUse("required", ("get_weather", "get_time"), parallel=False)
    prompt = engine.render_chat([ChatTurn("user", "What is the weather in Paris?")], tools=tools)
    assert "<tools>" in engine.decode(prompt) and '"name": "get_weather"' in engine.decode(prompt)
    text, reason = "", None
    async for delta in engine.generate("tool-required", prompt, GenerationParams(
            max_tokens=80, json_schema=reply_schema(use, tools, None))):
        text += delta.text
        reason = delta.finish_reason
    assert reason == "stop"
    content, calls = use.read(text)
    assert content is None and len(calls) == 1, text
    name, arguments = calls[0]
    assert name in ("get_weather", "get_time")
    if name == "get_weather":
        assert set(json.loads(arguments)) == {"city", "unit"}
