"""The real app over a scripted engine, in a process of its own, for tests that kill it:

    python -m tests.batchserver --data-dir DIR --port PORT [--token-delay S] [--concurrency N]

(`antiphon serve` always loads the real model.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import uvicorn

from antiphon.config import AppConfig
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.app import create_app
from antiphon.server.config import ServerConfig
from antiphon.sessions.config import SessionConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.01, help="seconds per token")
    parser.add_argument("--concurrency", type=int, default=8, help="max_batch_concurrency")
    args = parser.parse_args()
    config = AppConfig(server=ServerConfig(port=args.port,
                                           max_batch_concurrency=args.concurrency),
                       sessions=SessionConfig(data_dir=args.data_dir))
    engine = ScriptedEngine(token_delay_s=args.token_delay)
    uvicorn.run(create_app(config, engine), log_level="warning",
                **config.server.uvicorn_options())


if __name__ == "__main__":
    main()
