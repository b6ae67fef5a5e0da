"""What a client is told of a request vLLM failed: that it failed, not the server's internals
(the log has those)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.engine import EngineRequestFailedError
from antiphon.engine_ext.types import GenerationParams
from antiphon.engine_ext.vllm_engine import VllmEngine
from tests.conftest import default_model_or_skip


class FailingLLM:
    """vLLM's AsyncLLM as it fails a request: an internal error, wrapped as vLLM wraps it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async def outputs() -> AsyncIterator[Any]:
            try:
                raise KeyError("/srv/models/secret-path/layer.17")
            except KeyError as cause:
                raise RuntimeError("EngineGenerateError") from cause
            yield None  # (an async generator)
        return outputs()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def test_a_failed_request_tells_the_client_no_internals(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = VllmEngine(EngineConfig(), default_model_or_skip())
    engine._llm = llm = FailingLLM()  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR), pytest.raises(EngineRequestFailedError) as failed:
        async for _ in engine.generate("q_1", [1, 2, 3], GenerationParams(max_tokens=4)):
            pass
    assert "secret-path" not in str(failed.value) and "KeyError" in str(failed.value)
    assert "secret-path" in caplog.text and "q_1" in caplog.text  # the operator's to see
    assert llm.aborted == ["q_1"]


class CapturingLLM:
    """vLLM's AsyncLLM taking a request, which it ends at once: the sampling it was given."""

    def __init__(self) -> None:
        self.sampling: list[Any] = []

    def generate(self, prompt: Any, sampling: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.sampling.append(sampling)

        async def outputs() -> AsyncIterator[Any]:
            return
            yield None  # (an async generator)
        return outputs()

    async def abort(self, request_id: str) -> None:
        pass


async def test_special_tokens_stay_in_the_text_while_tools_are_offered_where_tags_are_them(
        ) -> None:
    """A model whose <tool_call> tags are special tokens: vLLM drops those from the text
    unless told not to, and the calls read as content. Other models' special tokens are
    dropped all the same (kept, Mistral's [TOOL_CALLS] came with its calls, read as text)."""
    engine = VllmEngine(EngineConfig(), default_model_or_skip())
    engine.load_tokenizer()
    assert engine.tokenizer.tool_tags_are_special is False  # (SmolLM2's are plain text)
    engine._llm = llm = CapturingLLM()  # type: ignore[assignment]
    for special in (False, True):
        engine.tokenizer.tool_tags_are_special = special
        for keep in (False, True):
            params = GenerationParams(max_tokens=4, keep_tool_tags=keep)
            async for _ in engine.generate(f"q_{special}_{keep}", [1, 2, 3], params):
                pass
    assert [s.skip_special_tokens for s in llm.sampling] == [True, True, True, False]
