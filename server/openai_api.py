"""OpenAI-compatible `/v1/chat/completions` and `/v1/completions` (streaming SSE and not), and
`/v1/models`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from antiphon.server.chat import Generation, total_usage
from antiphon.server.choices import run_choices, stream_choices
from antiphon.server.completions import (
    ChatCompletionRequest,
    completion_object,
    prepare_completion,
    require_served_model,
    session_xarg,
)
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, unexpected_error
from antiphon.server.http import ClosingStreamingResponse, authorize, error_body, read_model
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
from antiphon.server.tools import ToolStream

router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the reply


# Line breaks to Python's str.splitlines, which httpx's `aiter_lines` splits an event stream
# with, that JSON writes raw (a model's U+2028 cut a `data:` line in two, and its JSON failed)
_SPLITLINES_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse_json(payload: Any) -> str:
    """`payload` as the JSON of one event-stream line: escaped where a line reader would
    break it (control characters JSON escapes anyway)."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False).translate(_SPLITLINES_BREAKS)


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
    slot = ctx.inflight_per_key.take(owner, body.num_choices)  # (before the render: _prepared)
    gens = await _prepared(slot, ctx.chat.off_loop(
        prepare_completion, ctx.chat, body, owner, session_id=session_id,
        request_class=ctx.chat.render_class(owner, body.vllm_xargs)))
    if session_id is not None:
        hold = None
        try:
            hold = await ctx.turns.claims.claim_soon(session_id)
            # Read again once claimed: a deletion may have run while this waited for the
            # session (the claim keeps it from running now).
            await ctx.turns.get(owner, session_id)
        except BaseException:  # refused, gone, or the client gone while it waited
            ctx.turns.claims.release(session_id, hold)
            slot.release()
            raise
        gens[0].session_claim = hold
        ctx.turns.turn_began(session_id)
    return await _respond(request, gens, slot, body)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    """A legacy text completion: the prompt as given, without the chat template."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    ctx.chat.check_open()
    body = await read_model(request, TextCompletionRequest)
    slot = ctx.inflight_per_key.take(owner, body.num_choices)
    gens = await _prepared(slot, ctx.chat.off_loop(
        prepare_text_completion, ctx.chat, body, owner,
        request_class=ctx.chat.render_class(owner, body.vllm_xargs)))
    return await _respond(request, gens, slot, body)


async def _prepared(slot: Slot, preparing: Awaitable[list[Generation]]) -> list[Generation]:
    """The generations `preparing` (a render on the render thread) gives, `slot` released if
    it raises. The key's slots are taken before the render: taken after, a key at its limit
    still rendered every request it was refused, and those renders queued ahead of every
    other key's (found by a review)."""
    try:
        return await preparing
    except BaseException:
        slot.release()
        raise


@router.post("/tokenize")
async def tokenize_route(request: Request) -> dict[str, Any]:
    """vLLM's `/tokenize`: the token ids the served model gives a prompt or a conversation
    (`vllm bench serve` checks its own tokenizer against it)."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    body = await read_model(request, TokenizeRequest)
    with ctx.tokenizing_per_key.take(owner):  # (a render: it queues with chat turns')
        return await ctx.chat.off_loop(tokenize, ctx.chat, body,
                                       request_class=ctx.chat.render_class(owner))


@router.post("/detokenize")
async def detokenize_route(request: Request) -> dict[str, Any]:
    """vLLM's `/detokenize`: the text of token ids."""
    ctx: AppContext = request.app.state.ctx
    owner = authorize(request)
    body = await read_model(request, DetokenizeRequest)
    with ctx.tokenizing_per_key.take(owner):
        return await ctx.chat.off_loop(detokenize, ctx.chat, body)


async def _respond(request: Request, gens: list[Generation], slot: Slot,
                   body: ChatCompletionRequest | TextCompletionRequest) -> Response:
    """Run `body`'s prepared choices holding `slot`: as a stream of chunks, or to their ends
    and then the response object (499 if the client left first)."""
    ctx: AppContext = request.app.state.ctx
    is_text = isinstance(body, TextCompletionRequest)
    completion_id = ("cmpl-" if is_text else "chatcmpl-") + gens[0].request_id
    release = BackgroundTask(_release, ctx, gens[0], slot)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _sse(ctx, gens, completion_id, body.model, include_usage, slot,
                      is_text=is_text)
        # Its first event before the response starts: a request the engine refuses (a
        # schema its grammar backend cannot take) is a 400, as unstreamed, not a 200 with an
        # error event. It comes with the first token, or the first ping. A client that leaves
        # before it ends the request (it ran on until its first token, holding its slot).
        opening = asyncio.ensure_future(anext(stream))
        if not await _unless_gone(opening, request):
            await stream.aclose()
            await release()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            first = opening.result()
        except StopAsyncIteration:
            first = None
        # The release also runs after the stream: a client gone before its first chunk
        # leaves the stream never resumed, so its own `finally` never runs.
        return ClosingStreamingResponse(
            _resumed(first, stream), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"}, background=release)
    try:
        if not await _complete_unless_gone(ctx, gens, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await release()
    respond = text_completion_object if is_text else completion_object
    return JSONResponse(respond(gens, body.model))


async def _release(ctx: AppContext, gen: Generation, slot: Slot) -> None:
    """The completion is over: its session claim (`gen`'s, its only choice in a session) and
    its slots of the key's limit go back (async: a sync task would run off the loop; safe to
    run twice)."""
    slot.release()
    if gen.params.session_id is not None:
        ctx.turns.claims.release(gen.params.session_id, gen.session_claim)


async def _complete_unless_gone(ctx: AppContext, gens: list[Generation],
                                request: Request) -> bool:
    """Run `gens` to their ends and keep a session's exchange; False, with the generations
    aborted, if the client disconnected first."""
    async def run() -> None:
        if gens[0].params.session_id is not None:  # a client that left and asks again waits
            ctx.turns.claims.held_by_this_task(gens[0].params.session_id, gens[0].session_claim)
        await run_choices(ctx.chat, gens, "openai")
        for gen in gens:
            await ctx.turns.record_exchange(gen)

    work = asyncio.create_task(run())
    if not await _unless_gone(work, request):
        return False
    work.result()  # raises the generation's ApiError
    return True


async def _unless_gone(work: asyncio.Future[Any], request: Request) -> bool:
    """Wait for `work` to end unless the client disconnects first, which cancels it; whether
    it ended (its result or error is left in it)."""
    async def disconnected() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    return not work.cancelled()


async def _resumed(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """`first`, then the rest of the stream it came from."""
    async with aclosing(rest):  # type: ignore[type-var]
        if first is not None:
            yield first
        async for item in rest:
            yield item


async def _sse(ctx: AppContext, gens: list[Generation], completion_id: str, model: str,
               include_usage: bool, slot: Slot, is_text: bool = False) -> AsyncGenerator[str, None]:
    """The stream of a chat completion's chunks, or with `is_text` a text completion's, each
    chunk one choice's. A chat choice opens with the assistant's role when its first token is
    there, as in vLLM's and OpenAI's streams: a client timing its first chunk times the first
    token. A choice's final chunk comes when it is finished (a session turn's once its
    exchange is kept), the usage last where asked. An SSE comment goes out every
    `--sse-ping-s` with nothing else to send."""
    created = gens[0].created  # when the request came, as unstreamed
    tool_streams = [None if g.tool_use is None else ToolStream(g.tool_use) for g in gens]
    sent_logprobs = [0] * len(gens)  # output tokens whose logprobs went out, per choice
    opened = [False] * len(gens)  # the choice's first chunk went out
    ended = [False] * len(gens)  # its last chunk went out

    def frame(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": completion_id, "created": created, "model": model, "choices": choices,
            "object": "text_completion" if is_text else "chat.completion.chunk"}
        if include_usage:  # null but in the last chunk, as OpenAI's
            payload["usage"] = usage
        return "data: " + sse_json(payload) + "\n\n"

    def chunks(i: int, text: str | None, finish_reason: str | None = None) -> list[str]:
        """Choice `i`'s next chunks: for new text, or (None) its end. A chat choice's first
        is its role's; with tools, text may be held back, or give several deltas (the first
        carries the new tokens' logprobs, the last the finish reason). Built at once, from
        the output as it is now."""
        gen, start, frames = gens[i], sent_logprobs[i], []
        if is_text:
            frames.append(frame([text_choice(gen, text or "", start, finish_reason,
                                             opens=not opened[i])]))
        else:
            if not opened[i]:
                frames.append(frame([{"index": gen.index,
                                      "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]))
            deltas, finish_reason = _deltas(tool_streams[i], text, finish_reason)
            logprobs = gen.logprobs(start) if len(gen.token_logprobs) > start else None
            if not deltas and (logprobs is not None or text is None):
                deltas = [{}]  # text held back: its logprobs, or the end, still go out
            frames += [frame([{"index": gen.index, "delta": delta,
                               "logprobs": None if k else logprobs,
                               "finish_reason": finish_reason if k == len(deltas) - 1 else None}])
                       for k, delta in enumerate(deltas)]
        opened[i] = True
        sent_logprobs[i] = len(gen.token_logprobs)
        return frames

    def error(err: ApiError) -> str:
        return "data: " + json.dumps(error_body(err)) + "\n\ndata: [DONE]\n\n"

    started = False  # an event went out: an error from now on is one in the stream
    ping_s = ctx.chat.config.sse_ping_s
    last_sent = time.monotonic()

    try:
        async with aclosing(stream_choices(ctx.chat, gens, "openai", ping_s)) as events:
            async for event in events:
                started = True
                if event is None:
                    yield ": ping\n\n"
                    last_sent = time.monotonic()
                    continue
                i, piece = event
                if piece is not None:
                    frames_ = chunks(i, piece)
                    for frame_ in frames_:
                        yield frame_
                    # Text held back (a tool call's, until it closes) sends nothing while
                    # tokens come: the pings go on (a proxy dropped a long call's stream).
                    if frames_:
                        last_sent = time.monotonic()
                    elif time.monotonic() - last_sent >= ping_s:
                        yield ": ping\n\n"
                        last_sent = time.monotonic()
                elif gens[i].params.session_id is None:  # finished (a session's: once kept)
                    for frame_ in chunks(i, None, gens[i].finish_reason):
                        yield frame_
                    ended[i] = True
        for gen in gens:
            await ctx.turns.record_exchange(gen)
    except (asyncio.CancelledError, GeneratorExit):  # the client left: a turn of the
        ctx.turns.claims.mark_ending(gens[0].session_claim)  # session it sends again waits for this
        raise
    except ApiError as err:
        if not started:
            raise  # before the response: its status says it (`_respond`)
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
        await _release(ctx, gens[0], slot)
    for i, gen in enumerate(gens):
        if not ended[i]:
            for frame_ in chunks(i, None, gen.finish_reason):
                yield frame_
    if include_usage:
        yield frame([], usage=total_usage(gens))
    yield "data: [DONE]\n\n"


def _deltas(tools: ToolStream | None, text: str | None,
            finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """A chat choice's next deltas for new text, or for its end (None), and its finish
    reason."""
    if tools is None:
        return [{} if text is None else {"content": text}], finish_reason
    if text is not None:
        return tools.feed(text), finish_reason
    return tools.finish(finish_reason)
