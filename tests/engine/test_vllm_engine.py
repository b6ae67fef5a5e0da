"""The real default model on vLLM's CPU backend, through Antiphon's engine wrapper."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from antiphon.engine_ext.engine import EngineRequestError, VllmEngine
from antiphon.engine_ext.types import ChatTurn, GenerationParams

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
    text = engine._tokenizer.decode(ids)
    assert "<|im_start|>user\nWhat is the capital of France?" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


async def test_greedy_answer_is_paris_and_deterministic(engine: VllmEngine) -> None:
    first, reason = await generate_text(engine, "paris-1", QUESTION)
    second, _ = await generate_text(engine, "paris-2", QUESTION)
    assert "Paris" in first and reason == "stop"
    assert first == second


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
