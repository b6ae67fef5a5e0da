"""Run the real app under uvicorn in a background thread, on a free loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from antiphon.bench.serverproc import free_port
from antiphon.config import AppConfig
from antiphon.engine_ext.engine import Engine
from antiphon.server.app import DrainingServer, create_app


@contextmanager
def live_server(config: AppConfig, engine: Engine) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a running server."""
    with running_server(config, engine) as (url, _server):
        yield url


@contextmanager
def running_server(config: AppConfig, engine: Engine,
                   log_level: str = "warning",
                   port: int | None = None) -> Iterator[tuple[str, DrainingServer]]:
    """`live_server`, with the uvicorn server (`should_exit = True` shuts it down as SIGTERM
    does), and its thread joined on exit; on `port` (a restart) or a free one."""
    port = port or free_port()
    app = create_app(config, engine)
    options = {**config.server.uvicorn_options(), "host": "127.0.0.1", "port": port}
    server = DrainingServer(app, log_level=log_level, **options)  # as `antiphon serve` runs
    failures: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # re-raised in the test's thread once it is joined
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        if failures:
            raise RuntimeError("the server failed") from failures[0]
