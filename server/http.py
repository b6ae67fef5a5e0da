"""REST helpers: authentication, bounded body parsing, and the error format."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from antiphon.server.auth import key_from_headers
from antiphon.server.context import AppContext
from antiphon.server.errors import NOT_RETRIABLE, ApiError, ErrorCode, bad_message
from antiphon.server.protocol import parse_json

M = TypeVar("M", bound=BaseModel)


def authorize(request: Request) -> str:
    """The caller's owner id; raises `unauthorized`."""
    ctx: AppContext = request.app.state.ctx
    key = key_from_headers(request.headers.get("authorization"),
                           request.query_params.get("api_key"))
    return ctx.auth.owner_for(key)


def declared_body_bytes(request: Request) -> int | None:
    """The body's Content-Length; None for a chunked body (or a length that is no number)."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


async def read_body(request: Request) -> bytes:
    """The request body, refusing more than `max_frame_bytes` without reading it all."""
    limit = request.app.state.ctx.config.server.max_frame_bytes
    declared = declared_body_bytes(request)
    if declared is not None and declared > limit:
        raise ApiError(ErrorCode.TOO_LARGE, f"body of {declared} bytes exceeds {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(ErrorCode.TOO_LARGE, f"body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_model(request: Request, model: type[M], may_be_empty: bool = False) -> M:
    """Parse and validate a JSON body into `model` (with `may_be_empty`, no body at all is
    `{}`: a model whose every field is optional); raises typed `ApiError`s."""
    raw = await read_body(request)
    if may_be_empty and not raw.strip():
        raw = b"{}"
    data = parse_json(raw, "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_message(exc.errors()) from None


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error shape, with Antiphon's stable code."""
    return {"error": {"code": err.code.value, "message": err.message, "param": err.param,
                      "type": "invalid_request_error" if err.http_status < 500
                      else "server_error"}}


def error_response(err: ApiError) -> JSONResponse:
    headers = {}
    if err.http_status == 401:  # says how to authenticate (RFC 9110), as OpenAI's does
        headers["WWW-Authenticate"] = 'Bearer realm="antiphon"'
    if err.code in NOT_RETRIABLE:
        headers["x-should-retry"] = "false"
    return JSONResponse(error_body(err), status_code=err.http_status, headers=headers)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body's generator, and runs its background task,
    also when sending fails (Starlette does neither then: a reply whose write failed held its
    generation and its slot of the key's limit until the garbage collector found the
    generator)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            if self.background is not None:
                await self.background()
            raise
