"""OpenAI-compatible `/v1/chat/completions` (streaming SSE and not) and `/v1/models`."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from antiphon.engine_ext.types import ChatTurn, RequestClass
from antiphon.server.chat import Generation
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.http import authorize, read_model

router = APIRouter()


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: Annotated[list[OpenAIMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    vllm_xargs: dict[str, Any] | None = None
    """Antiphon reads `request_class` ("rt" or "be") from here."""


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
    gen = _prepare(ctx, body)
    completion_id = "chatcmpl-" + gen.request_id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(ctx, gen, completion_id, body.model, include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with aclosing(ctx.chat.stream(gen, api="openai")) as pieces:
        async for _ in pieces:
            pass
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": body.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                     "finish_reason": gen.finish_reason}],
        "usage": gen.usage(),
    })


def _prepare(ctx: AppContext, body: ChatCompletionRequest) -> Generation:
    if body.model != ctx.engine.model_name:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {body.model!r} is not served here; "
                       f"this server serves {ctx.engine.model_name!r}")
    limits = ctx.config.server
    if len(body.messages) > limits.max_messages:
        raise ApiError(ErrorCode.TOO_LARGE, f"{len(body.messages)} messages; the limit is "
                       f"{limits.max_messages}")
    turns = []
    for m in body.messages:
        text = m.text()
        ctx.chat.check_content(text)
        turns.append(ChatTurn("system" if m.role == "developer" else m.role, text))
    xargs = body.vllm_xargs or {}
    try:
        request_class = RequestClass(xargs.get("request_class", "rt"))
    except ValueError:
        raise ApiError(ErrorCode.BAD_MESSAGE,
                       "vllm_xargs.request_class must be 'rt' or 'be'") from None
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return ctx.chat.prepare(
        secrets.token_hex(12), turns, body.max_completion_tokens or body.max_tokens,
        body.temperature, request_class, top_p=body.top_p, stop=stop, seed=body.seed)


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
