"""A small helper over the real `websockets` client for protocol tests."""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.client import ClientConnection


async def send(ws: ClientConnection, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


async def recv(ws: ClientConnection, timeout: float = 30.0) -> dict[str, Any]:
    import asyncio

    return json.loads(await asyncio.wait_for(ws.recv(), timeout))  # type: ignore[no-any-return]


async def recv_until(ws: ClientConnection, kind: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """All frames up to and including the first of type `kind`."""
    frames = []
    while True:
        frame = await recv(ws, timeout)
        frames.append(frame)
        if frame["type"] == kind:
            return frames


async def open_session(ws: ClientConnection, session_id: str | None = None,
                       **extra: Any) -> dict[str, Any]:
    await send(ws, type="session.open", session_id=session_id, **extra)
    frame = await recv(ws)
    assert frame["type"] == "session", frame
    return frame


async def chat(ws: ClientConnection, session_id: str, content: str, **extra: Any) -> dict[str, Any]:
    """Send a message and return {"accepted", "tokens", "done"} frames."""
    await send(ws, type="message", session_id=session_id, content=content, **extra)
    frames = await recv_until(ws, "done")
    errors = [f for f in frames if f["type"] == "error"]
    assert not errors, errors
    return {"accepted": frames[0], "tokens": [f for f in frames if f["type"] == "token"],
            "done": frames[-1]}
