"""OpenAI-compatible `/v1/chat/completions` and `/v1/completions` (streaming SSE and not), and
`/v1/models`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from antiphon.server.chat import Generation
from antiphon.server.completions import (
    ChatCompletionRequest,
    completion_object,
    prepare_completion,
    require_served_model,
    session_xarg,
)
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, unexpected_error
from antiphon.server.http import authorize, read_model
from antiphon.server.limits import Slot
from antiphon.server.text_completions import (
    DetokenizeRequest,
    TextCompletionRequest,
    TokenizeRequest,
    detokenize,
    prepare_text_completion,
    text_choice,
    text_completion_object,
    tokenize,
)

router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the reply


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    return {"object": "list", "data": [_model_object(ctx, name) for name in ctx.chat.model_names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    require_served_model(ctx.chat, model_id)
    return _model_object(ctx, model_id)


def _model_object(ctx: AppContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": ctx.started_at,
            "owned_by": "antiphon", "max_model_len": ctx.engine.max_model_len}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    """A chat completion. With `vllm_xargs.session_id` (one of the caller's sessions) the
    request runs as a turn of that session: the client still sends the whole conversation,
    and the server keeps the exchange's exact tokens as the session's context, which an
    advisory for the session (`POST /v1/advisory`) brings forward before its next call."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    ctx.chat.check_open()
    body = await read_model(request, ChatCompletionRequest)
    session_id = session_xarg(body)
    if session_id is not None:
        await ctx.turns.get(owner, session_id)
    gen = prepare_completion(ctx.chat, body, owner, session_id=session_id)
    slot = ctx.inflight_per_key.take(owner)
    if session_id is not None:
        try:
            ctx.turns.claim(session_id, gen.request_id)
        except ApiError:
            slot.release()
            raise
    return await _respond(request, gen, slot, body)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    """A legacy text completion: the prompt as given, without the chat template."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    ctx.chat.check_open()
    body = await read_model(request, TextCompletionRequest)
    gen = prepare_text_completion(ctx.chat, body, owner)
    slot = ctx.inflight_per_key.take(owner)
    return await _respond(request, gen, slot, body)


@router.post("/tokenize")
async def tokenize_route(request: Request) -> dict[str, Any]:
    """vLLM's `/tokenize`: the token ids the served model gives a prompt or a conversation
    (`vllm bench serve` checks its own tokenizer against it)."""
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    return tokenize(ctx.chat, await read_model(request, TokenizeRequest))


@router.post("/detokenize")
async def detokenize_route(request: Request) -> dict[str, Any]:
    """vLLM's `/detokenize`: the text of token ids."""
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    return detokenize(ctx.chat, await read_model(request, DetokenizeRequest))


async def _respond(request: Request, gen: Generation, slot: Slot,
                   body: ChatCompletionRequest | TextCompletionRequest) -> Response:
    """Run `body`'s prepared completion holding `slot`: as a stream of chunks, or to its end
    and then its response object (499 if the client left first)."""
    ctx: AppContext = request.app.state.ctx
    is_text = isinstance(body, TextCompletionRequest)
    completion_id = ("cmpl-" if is_text else "chatcmpl-") + gen.request_id
    release = BackgroundTask(_release, ctx, gen, slot)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # The release also runs after the stream: a client gone before its first chunk
        # leaves the stream never started, so its own `finally` never runs.
        return StreamingResponse(
            _sse(ctx, gen, completion_id, body.model, include_usage, slot, is_text=is_text),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            background=release)
    try:
        if not await _complete_unless_gone(ctx, gen, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await release()
    respond = text_completion_object if is_text else completion_object
    return JSONResponse(respond(gen, body.model))


async def _release(ctx: AppContext, gen: Generation, slot: Slot) -> None:
    """The completion is over: its session claim and its slot of the key's limit go back
    (async: a sync task would run off the loop; safe to run twice)."""
    slot.release()
    if gen.params.session_id is not None:
        ctx.turns.release(gen.params.session_id, gen.request_id)


async def _complete_unless_gone(ctx: AppContext, gen: Generation, request: Request) -> bool:
    """Run `gen` to its end and keep the exchange; False, with the generation aborted, if the
    client disconnected first."""
    async def run() -> None:
        async with aclosing(ctx.chat.stream(gen, api="openai")) as pieces:
            async for _ in pieces:
                pass
        await ctx.turns.record_exchange(gen)

    async def disconnected() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(run()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return False
    work.result()  # raises the generation's ApiError
    return True


async def _with_pings(pieces: AsyncIterator[str], every_s: float
                      ) -> AsyncGenerator[str | None, None]:
    """`pieces`, with a None each time `every_s` seconds pass without one (the stream sends an
    SSE comment then). The next piece is awaited in a task of its own, so a wait that times
    out does not cancel it; the task ends before this does."""
    next_piece = asyncio.ensure_future(anext(pieces))
    try:
        while True:
            done, _ = await asyncio.wait({next_piece}, timeout=every_s)
            if not done:
                yield None
                continue
            try:
                piece = next_piece.result()
            except StopAsyncIteration:
                return
            yield piece
            next_piece = asyncio.ensure_future(anext(pieces))
    finally:
        if not next_piece.done():
            next_piece.cancel()  # the generation is aborted inside it (a client gone)
        with contextlib.suppress(BaseException):
            await next_piece


async def _sse(ctx: AppContext, gen: Generation, completion_id: str, model: str,
               include_usage: bool, slot: Slot, is_text: bool = False) -> AsyncIterator[str]:
    """The stream of a chat completion's chunks, or with `is_text` a text completion's. A
    chat stream opens with the assistant's role when its first token is there, as vLLM's and
    OpenAI's do: a client timing its first chunk times the first token."""
    created = int(time.time())

    sent_logprobs = 0  # output tokens whose logprobs went out
    opened = is_text  # the role chunk went out (a text completion has none)

    def frame(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": completion_id, "created": created, "model": model, "choices": choices,
            "object": "text_completion" if is_text else "chat.completion.chunk"}
        if usage:
            payload["usage"] = usage
        return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        nonlocal sent_logprobs
        fresh = len(gen.token_logprobs) > sent_logprobs  # tokens since the last chunk
        if is_text:
            choice = text_choice(gen, delta.get("content", ""), sent_logprobs, finish_reason)
        else:
            choice = {"index": 0, "delta": delta,
                      "logprobs": gen.logprobs(sent_logprobs) if fresh else None,
                      "finish_reason": finish_reason}
        sent_logprobs = len(gen.token_logprobs)
        return frame([choice])

    def error(err: ApiError) -> str:
        return "data: " + json.dumps({"error": {"code": err.code.value,
                                                "message": err.message}}) + "\n\n"

    def role() -> str:
        nonlocal opened
        opened = True
        return frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}])

    try:
        async with (aclosing(ctx.chat.stream(gen, api="openai")) as pieces,
                    aclosing(_with_pings(pieces, ctx.chat.config.sse_ping_s)) as paced):
            async for piece in paced:
                if piece is None:
                    yield ": ping\n\n"
                    continue
                if not opened:
                    yield role()
                yield chunk({"content": piece})
        await ctx.turns.record_exchange(gen)
    except ApiError as err:
        ctx.metrics.errors.labels(err.code.value).inc()
        yield error(err)
        return
    except Exception as exc:
        failure = unexpected_error(exc, f"chat completion {completion_id}",
                                   "the session's context was not saved")
        ctx.metrics.errors.labels(failure.code.value).inc()
        yield error(failure)
        return
    finally:
        await _release(ctx, gen, slot)
    if not opened:  # a reply without text
        yield role()
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield frame([], usage=gen.usage())
    yield "data: [DONE]\n\n"
