"""A streaming reply whose write fails lets go of what it holds at once (server/http.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.background import BackgroundTask

from antiphon.server.http import ClosingStreamingResponse


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_failed_write_closes_the_stream_and_runs_its_release(spec_version: str) -> None:
    # Starlette neither closes the body's generator nor runs the background task when a send
    # raises: the reply's generation and its slot of the key's limit stayed held until the
    # garbage collector found the generator.
    events: list[str] = []

    async def body() -> AsyncIterator[str]:
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            events.append("generator closed")

    async def release() -> None:
        events.append("released")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if len(sent) == 3:
            raise RuntimeError("the transport is closed")
        sent.append(message)

    async def receive() -> dict[str, Any]:  # the client stays: no disconnect comes
        await asyncio.Event().wait()
        return {}

    response = ClosingStreamingResponse(body(), media_type="text/event-stream",
                                        background=BackgroundTask(release))
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    with pytest.raises(RuntimeError, match="closed"):
        await response(scope, receive, send)  # type: ignore[arg-type]
    assert events == ["generator closed", "released"]
