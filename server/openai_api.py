"""OpenAI-compatible `/v1/chat/completions` (streaming SSE and not) and `/v1/models`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from antiphon.server.chat import Generation
from antiphon.server.completions import (
    ChatCompletionRequest,
    completion_object,
    prepare_completion,
    session_xarg,
)
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError
from antiphon.server.http import authorize, read_model

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    return {"object": "list", "data": [{
        "id": ctx.engine.model_name, "object": "model", "created": 0, "owned_by": "antiphon",
        "max_model_len": ctx.engine.max_model_len}]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    """A chat completion. With `vllm_xargs.session_id` (one of the caller's sessions) the
    request runs as a turn of that session: the client still sends the whole conversation,
    and the server keeps the exchange's exact tokens as the session's context, which an
    advisory for the session (`POST /v1/advisory`) brings forward before its next call."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    body = await read_model(request, ChatCompletionRequest)
    session_id = session_xarg(body)
    if session_id is not None:
        await ctx.turns.get(owner, session_id)
    gen = prepare_completion(ctx.chat, body, session_id=session_id)
    completion_id = "chatcmpl-" + gen.request_id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(ctx, gen, completion_id, body.model, include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with aclosing(ctx.chat.stream(gen, api="openai")) as pieces:
        async for _ in pieces:
            pass
    await ctx.turns.record_exchange(gen)
    return JSONResponse(completion_object(gen, body.model))


async def _sse(ctx: AppContext, gen: Generation, completion_id: str, model: str,
               include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None,
              usage: dict[str, int] | None = None) -> str:
        choices = [] if usage else [
            {"index": 0, "delta": delta, "finish_reason": finish_reason}]
        payload: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk",
                                   "created": created, "model": model, "choices": choices}
        if usage:
            payload["usage"] = usage
        return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    try:
        async with aclosing(ctx.chat.stream(gen, api="openai")) as pieces:
            async for text in pieces:
                yield chunk({"content": text})
    except ApiError as err:
        yield "data: " + json.dumps({"error": {"code": err.code.value,
                                               "message": err.message}}) + "\n\n"
        return
    await ctx.turns.record_exchange(gen)
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield chunk({}, usage=gen.usage())
    yield "data: [DONE]\n\n"
