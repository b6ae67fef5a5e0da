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
from antiphon.server.completions import ChatCompletionRequest, completion_object, prepare_completion
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
    ctx: AppContext = request.app.state.ctx
    authorize(request)
    body = await read_model(request, ChatCompletionRequest)
    gen = prepare_completion(ctx.chat, body)
    completion_id = "chatcmpl-" + gen.request_id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(ctx, gen, completion_id, body.model, include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with aclosing(ctx.chat.stream(gen, api="openai")) as pieces:
        async for _ in pieces:
            pass
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
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield chunk({}, usage=gen.usage())
    yield "data: [DONE]\n\n"
