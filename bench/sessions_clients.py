"""The two chat clients of `antiphon bench sessions`: one simulated user's conversation on one
server, timed at the client.

`OpenAIChat` drives stock vLLM's `/v1/chat/completions` and keeps the history itself, as any
OpenAI client must; `WsChat` drives Antiphon's `/v1/ws`, where the server keeps the history in
the session and the client sends only the new message (and `typing` advisories).
"""

from __future__ import annotations

import dataclasses
import json
import time
from types import TracebackType
from typing import Any, Protocol

import httpx


@dataclasses.dataclass(frozen=True)
class TurnResult:
    ttft_s: float  # message sent to first token, at the client
    # mean gap between the reply's text frames after the first, at the client; None where
    # fewer than two came (no gap to time)
    tpot_s: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV the server did not compute for this turn
    text: str  # the reply, which the simulated user reads before typing the next message
    # Of the cached tokens, those Antiphon's KV tiers loaded: (host arena, SSD); None where
    # the server does not say (stock vLLM)
    tier_tokens: tuple[int, int] | None = None
    # how much later than its think time the turn was sent (`run_user`; the client's TTFT
    # counts from the send): a held event loop, or a turn held back, shows here
    send_lag_s: float = 0.0


class ChatClient(Protocol):
    """One simulated user's conversation: `async with` opens it, `turn` runs one chat turn."""

    async def __aenter__(self) -> ChatClient: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None: ...

    async def turn(self, message: str) -> TurnResult:
        """Send `message` as the next user turn and wait for the whole reply."""
        ...

    async def typing(self) -> None:
        """Tell the server that the user started typing the next message."""
        ...


def _timed(sent: float, first: float | None, last: float | None, end: float,
           completion_tokens: int, finish_reason: str | None) -> tuple[float, float | None]:
    """(TTFT, TPOT) in seconds from the client's clock readings of one turn: TPOT is the
    time from the first text frame to the last over the tokens between them. A reply that
    ended on its own ("stop") ended on a token with no text (the end-of-sequence token, or a
    stop string's), counted in the server's completion tokens: over all of them, it had a
    gap too many ([a, EOS]: a TPOT of 0). Not over the frames: a server merges tokens into
    one frame when the client falls behind, and the TPOT of frames came out high (both found
    by reviews). None where there is no gap to time."""
    gaps = completion_tokens - 1 - (finish_reason == "stop")
    return (first or end) - sent, (None if first is None or last is None or gaps < 1
                                   else (last - first) / gaps)


class OpenAIChat:
    """A conversation over `/v1/chat/completions` (SSE, usage in the last chunk)."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_tokens: int) -> None:
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.history: list[dict[str, str]] = []

    async def __aenter__(self) -> OpenAIChat:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        return None

    async def turn(self, message: str) -> TurnResult:
        self.history.append({"role": "user", "content": message})
        body = {"model": self.model, "messages": self.history, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = last = None
        pieces: list[str] = []  # the reply's text frames
        usage: dict[str, Any] = {}
        finish_reason = None
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if chunk.get("choices"):
                    finish_reason = chunk["choices"][0].get("finish_reason") or finish_reason
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    pieces.append(chunk["choices"][0]["delta"]["content"])
        end = time.perf_counter()
        text = "".join(pieces)
        self.history.append({"role": "assistant", "content": text})
        ttft, tpot = _timed(sent, first, last, end, usage["completion_tokens"], finish_reason)
        details = usage.get("prompt_tokens_details") or {}
        return TurnResult(ttft, tpot, usage["prompt_tokens"], usage["completion_tokens"],
                          int(details.get("cached_tokens") or 0), text)

    async def typing(self) -> None:
        """Stock vLLM has no advisory API: nothing to send."""


class WsChat:
    """A conversation as one session on its own `/v1/ws` connection."""

    def __init__(self, ws_url: str, max_tokens: int) -> None:
        self.ws_url = ws_url
        self.max_tokens = max_tokens
        self.session_id = ""
        self._ws: Any = None

    async def __aenter__(self) -> WsChat:
        from websockets.asyncio.client import connect

        self._ws = await connect(self.ws_url, max_size=None)
        await self._send(type="session.open")
        self.session_id = (await self._recv("session"))["session"]["session_id"]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._ws.close()

    async def turn(self, message: str) -> TurnResult:
        sent = time.perf_counter()
        await self._send(type="message", session_id=self.session_id, content=message,
                         max_tokens=self.max_tokens, temperature=0.0)
        first = last = None
        while (frame := await self._recv()).get("type") != "done":
            if frame["type"] == "token" and frame.get("text"):  # (an EOS's is empty)
                last = time.perf_counter()
                first = first or last
        usage = frame["usage"]
        ttft, tpot = _timed(sent, first, last, time.perf_counter(), usage["completion_tokens"],
                            frame.get("finish_reason"))
        tiers = usage.get("tier_prompt_tokens")
        return TurnResult(ttft, tpot, usage["prompt_tokens"], usage["completion_tokens"],
                          usage["cached_prompt_tokens"], frame["text"],
                          None if tiers is None else (tiers["host"], tiers["ssd"]))

    async def typing(self) -> None:
        await self._send(type="typing", session_id=self.session_id)

    async def _send(self, **msg: Any) -> None:
        await self._ws.send(json.dumps(msg))

    async def _recv(self, kind: str | None = None) -> dict[str, Any]:
        """The next frame (of type `kind` when given); an `error` frame raises."""
        frame: dict[str, Any] = json.loads(await self._ws.recv())
        if frame["type"] == "error" or (kind is not None and frame["type"] != kind):
            raise RuntimeError(f"unexpected frame from {self.ws_url}: {frame}")
        return frame
