"""A completion's choices run side by side: several (`n`, or a text completion's several
prompts) are one request to the client and one engine request each.

`stream_choices` merges their text as it comes, for a streamed response, a whole response and
a batch item alike; its first failure aborts every other choice, and so does closing it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from antiphon.server.chat import ChatService, Generation
from antiphon.server.errors import ApiError, ErrorCode

# What `stream_choices` yields: (choice's position, a text piece), (position, None) when that
# choice is finished, or None for a pause of `ping_every_s`.
ChoiceEvent = tuple[int, str | None] | None


async def stream_choices(chat: ChatService, gens: Sequence[Generation], api: str,
                         ping_every_s: float | None = None
                         ) -> AsyncGenerator[ChoiceEvent, None]:
    """Run `gens` on the engine together, yielding each one's text pieces as they come, in
    the order they come, and each one's end; with `ping_every_s`, also a None each time that
    many seconds pass with neither. Each next piece is awaited in a task of its own, so a
    pause does not cancel it."""
    streams: list[AsyncGenerator[str, None]] = [chat.stream(g, api) for g in gens]
    waiting = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    # A shutdown's drain that ends before these do cuts a client's request short, with an
    # error it can read (uvicorn would soon drop the connection mid-response). Batch items
    # were stopped before the drain, and run again after the restart.
    cut = None if api == "batch" else asyncio.ensure_future(chat.cut_short.wait())
    try:
        while waiting:
            done, _ = await asyncio.wait([*waiting, *([cut] if cut else [])],
                                         timeout=ping_every_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if cut in done:
                raise ApiError(ErrorCode.SHUTTING_DOWN, "the server shut down before this "
                               "reply ended (--drain-timeout-s): it was cut short")
            ready = sorted((p for p in waiting if p in done), key=waiting.__getitem__)
            if not ready:
                yield None
                continue
            for next_piece in ready:
                i = waiting.pop(next_piece)
                try:
                    piece = next_piece.result()  # raises the choice's ApiError
                except StopAsyncIteration:
                    yield i, None
                    continue
                waiting[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, piece
    finally:
        if cut is not None:
            cut.cancel()
        for next_piece in waiting:  # each generation is aborted inside its task
            next_piece.cancel()
        for next_piece in waiting:
            with contextlib.suppress(BaseException):
                await next_piece
        for stream in streams:
            with contextlib.suppress(BaseException):
                await stream.aclose()


async def run_choices(chat: ChatService, gens: Sequence[Generation], api: str) -> None:
    """Run `gens` to their ends (`stream_choices`, the text kept in each generation)."""
    async with contextlib.aclosing(stream_choices(chat, gens, api)) as events:
        async for _ in events:
            pass
