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
