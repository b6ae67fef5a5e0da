"""The FastAPI application: routes, error handling, static UI, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from antiphon.config import AppConfig
from antiphon.engine_ext.engine import Engine
from antiphon.server import batch_api, openai_api, rest
from antiphon.server.auth import redact_api_keys_in_logs
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode, bad_message, unexpected_error
from antiphon.server.http import error_response
from antiphon.server.origin import BrowserGuard, SecurityHeaders
from antiphon.server.ws import websocket_endpoint
from antiphon.shmsweep import EngineSegments

logger = logging.getLogger(__name__)


def create_app(config: AppConfig, engine: Engine) -> FastAPI:
    """An app that starts `engine` on start-up and shuts it down on exit."""
    ctx = AppContext.build(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        segments = EngineSegments(config.sessions.data_dir)
        segments.sweep()  # those a killed predecessor's engine left in /dev/shm
        before = segments.names()
        # Recorded as they appear, by a thread (vLLM's model load blocks the event loop for
        # minutes, and a first start profiles after it: a kill meanwhile left segments no
        # record named), and once more as the start ends, well or not (a failed start lost
        # a predecessor's segments still mapped, which `sweep` keeps for `remember`).
        recorded = threading.Event()
        recorder = threading.Thread(target=_keep_recording, args=(segments, before, recorded),
                                    name="engine-shm-record", daemon=True)
        recorder.start()
        try:
            started = await _start_engine(ctx, engine)
        finally:
            recorded.set()
            recorder.join()  # (its last write lands before this one: none is stale)
            segments.remember(before)
        if not started:  # a shutdown was asked for meanwhile
            yield  # uvicorn, told to exit, serves nothing and shuts down
            ctx.store.close()
            ctx.batch_store.close()
            return
        tasks: list[asyncio.Task[None]] = []
        try:  # (from here on, whatever fails, the engine started is stopped)
            await ctx.batches.start()
            ctx.turns.eraser.start()
            tasks += [asyncio.create_task(ctx.dashboard.run()),
                      asyncio.create_task(watch_engine(ctx))]
            # What start-up made (vLLM, torch, the tokenizer: 600,000 objects and more) is
            # static: frozen, the collector's oldest generation no longer walks it. A full
            # collection over it stopped the event loop, every stream with it, for 0.15-0.3
            # s on two cores (vLLM's own server freezes it too). Not collected first, which
            # cost as much again at every start: what garbage it holds stays till shutdown.
            gc.freeze()
            ctx.is_ready = True
            logger.info("Antiphon serving %s on http://%s:%d", engine.model_name,
                        config.server.host, config.server.port)
            yield
        finally:
            ctx.is_ready = False
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await ctx.batches.stop()
            await ctx.turns.eraser.stop()  # what is left, the next start erases
            await engine.shutdown()
            segments.forget()
            ctx.store.close()
            ctx.batch_store.close()
            ctx.chat.close()
            gc.unfreeze()  # (an app run in a test's process leaves it as it found it)

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, which the pages'
    # content security policy (and an offline machine) refuses, so they rendered blank.
    # The schema they draw, /openapi.json, stays.
    app = FastAPI(title="Antiphon", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(SecurityHeaders)
    if not ctx.auth.is_required:  # keys keep other sites out; without them, this does
        app.add_middleware(
            BrowserGuard, allowed_origins=config.server.allowed_origins,
            allowed_hosts=config.server.allowed_hosts,
            on_refused=ctx.metrics.errors.labels(ErrorCode.FORBIDDEN_ORIGIN.value).inc)
    app.include_router(openai_api.router)
    app.include_router(rest.router)
    app.include_router(batch_api.router)
    app.add_api_websocket_route("/v1/ws", websocket_endpoint)

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, err: ApiError) -> JSONResponse:
        ctx.metrics.errors.labels(err.code.value).inc()
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return await on_api_error(_request, bad_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code)
        if code is None:
            return JSONResponse({"error": {"code": "http_error", "message": str(exc.detail),
                                           "type": "invalid_request_error"}},
                                status_code=exc.status_code, headers=exc.headers)
        what = "no route" if code is ErrorCode.NOT_FOUND else "method not allowed"
        return await on_api_error(request, ApiError(
            code, f"{what}: {request.method} {request.url.path}"))

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(_request: Request, _exc: ClientDisconnect) -> Response:
        # The client left while its body was read (or a body deadline closed it): no
        # server error to count or log, and nobody to answer (nginx's "client closed").
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return await on_api_error(request, unexpected_error(  # Starlette logs the traceback
            exc, f"{request.method} {request.url.path}", log_traceback=False))

    static = resources.files("antiphon.web_ui") / "static"
    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    def page(name: str) -> Callable[[], Awaitable[FileResponse]]:
        async def serve_page() -> FileResponse:
            return FileResponse(str(static / name))
        return serve_page

    # The chat page knows the server's message limits: a message over the websocket's frame
    # limit closed the connection (1009) with no word of why, cutting every reply on it.
    limits = config.server
    chat_page = (static / "index.html").read_text(encoding="utf-8").replace(
        "<body ", f'<body data-max-content-chars="{limits.max_content_chars}" '
                  f'data-max-frame-bytes="{limits.max_frame_bytes}" ', 1)

    async def serve_chat_page() -> HTMLResponse:
        return HTMLResponse(chat_page)

    app.add_api_route("/", serve_chat_page, methods=["GET"], include_in_schema=False)
    for path, name in (("/dashboard", "dashboard.html"), ("/batches", "batches.html")):
        app.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)

    return app


ENGINE_WATCH_INTERVAL_S = 0.5


def _keep_recording(segments: EngineSegments, before: set[str], stop: threading.Event,
                    interval_s: float = 1.0) -> None:
    """`segments.remember(before)` now and every `interval_s` seconds until `stop` is set
    (a thread's: a predecessor's segments `sweep` held back are on record again at once)."""
    while True:
        segments.remember(before)
        if stop.wait(interval_s):
            return


async def _start_engine(ctx: AppContext, engine: Engine) -> bool:
    """Start `engine`; False, with it stopped again, when a shutdown asked for meanwhile
    cancelled the start (`DrainingServer.handle_exit`). A failed start stops what it had
    started and raises."""
    if ctx.chat.stop_requested:  # a signal came before the start
        return False
    starting = ctx.starting = asyncio.ensure_future(engine.start())
    try:
        await starting
        return True
    except asyncio.CancelledError:
        if not starting.cancelled():
            raise  # the lifespan itself is being cancelled
        await engine.shutdown()
        return False
    except BaseException as exc:
        await engine.shutdown()
        if isinstance(exc, Exception) and ctx.chat.stop_requested:  # the stop ended the
            logger.info("the engine's start was stopped")  # model's load (`stop_starting`)
            return False
        raise
    finally:
        ctx.starting = None


async def watch_engine(ctx: AppContext) -> None:
    """Shut the server down once the engine has failed for good (its process died: killed
    for memory, say). vLLM cannot restart it in place, and a server left running would fail
    every turn while it looked alive to anything but /healthz. `antiphon serve` then exits
    with status 1, so that a supervisor restarts it; batch items that were running run
    again after the restart (the runner starts none into a dead engine, which would use up
    their attempts)."""
    while not ctx.engine.is_dead:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    if ctx.chat.stop_requested:
        # The engine process got the signal too (one sent to the whole process group): it
        # finished its requests and stopped, as the server is doing; not a failure.
        logger.info("the engine stopped on the shutdown signal")
        return
    ctx.engine_died = True
    ctx.is_ready = False
    logger.error("The engine failed for good (the cause is logged above): shutting down so "
                 "that a supervisor can restart the server; batch items that were running "
                 "will run again after the restart")
    if ctx.request_shutdown is not None:
        ctx.request_shutdown()


# After the drain: how long the replies it cut short have to be kept and their websocket
# turns to get their `done` (uvicorn's own wait for connections after a shutdown is 5 s too).
CUT_SHORT_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn closes every websocket at once when it shuts down (1012, cutting the replies
    streaming on it short); this server first lets live replies finish, for up to
    `--drain-timeout-s`, while new turns are refused and `/healthz` says not ready."""

    def __init__(self, app: FastAPI, **options: Any) -> None:
        super().__init__(uvicorn.Config(app, **options))  # configures uvicorn's logging
        redact_api_keys_in_logs()
        self.ctx: AppContext = app.state.ctx
        self.ctx.request_shutdown = self._request_exit

    def _request_exit(self) -> None:
        self.should_exit = True  # as SIGTERM does

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal to the whole process group (Ctrl-C in a terminal, systemd's default
        # KillMode) reaches vLLM's engine processes too, which stop at once: what they fail
        # from now on was stopped on purpose (`ChatService.stop_requested`).
        self.ctx.chat.stop_requested = True
        super().handle_exit(sig, frame)
        starting = self.ctx.starting
        if starting is not None and not starting.done():
            # Still starting (the model's load, first-start profiling: minutes): stop now,
            # not once the engine serves. The load blocks the event loop, so the engine
            # ends it itself (`stop_starting`); the cancel takes the rest.
            logger.info("stopping during start-up")
            self.ctx.engine.stop_starting()
            starting.get_loop().call_soon_threadsafe(starting.cancel)

    @property
    def exit_status(self) -> int:
        """The process's exit status once `run` returns: 1 when the engine died."""
        return 1 if self.ctx.engine_died else 0

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:  # a second Ctrl-C skips the wait
            ctx = self.ctx
            ctx.is_ready = False
            ctx.dashboard.stopped = True
            await ctx.batches.stop()  # its items run again after the restart
            timeout_s = ctx.config.server.drain_timeout_s
            logger.info("shutting down: waiting up to %.0f s for the replies streaming now",
                        timeout_s)
            left = await self._unless_forced(ctx.chat.drain(timeout_s))
            if left is None:  # a second Ctrl-C: the replies streaming are cut short now
                logger.warning("second stop: the replies streaming are cut short")
                ctx.chat.cut_short.set()
                await ctx.chat.wait_for_replies(CUT_SHORT_WAIT_S)  # (each kept, as below)
            elif left:
                logger.warning("%d replies still streaming after %.0f s are cut short", left,
                               timeout_s)
                # each kept as it is, and a websocket turn's `done` sent, before uvicorn
                # closes the sockets
                await ctx.chat.wait_for_replies(CUT_SHORT_WAIT_S)
        self._mark_closing_websockets()  # no await from here to uvicorn's loop over them
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's own shutdown then: the engine, the
            await self.lifespan.shutdown()  # stores and the batch runner stop all the same

    async def _unless_forced(self, draining: Awaitable[int]) -> int | None:
        """`draining`'s result, or None once a second Ctrl-C asks to stop waiting."""
        task = asyncio.ensure_future(draining)
        while not self.force_exit:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
        task.cancel()
        return None

    def _mark_closing_websockets(self) -> None:
        """uvicorn's shutdown sends a close (1012) on every websocket, and its websockets
        implementation raises InvalidState, failing the whole shutdown, on one whose client has
        begun the closing handshake (websockets answered that close already). Such connections
        are marked closed-by-us, so uvicorn just closes their transport."""
        for connection in list(self.server_state.connections):
            if (isinstance(connection, WebSocketsSansIOProtocol)
                    and connection.conn.state in (State.CLOSING, State.CLOSED)):
                connection.close_sent = True
