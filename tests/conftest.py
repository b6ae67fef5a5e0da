from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from antiphon.config import AppConfig
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.model import resolve_model
from antiphon.server.config import ServerConfig
from antiphon.sessions.config import SessionConfig
from tests.liveserver import live_server


def default_model_or_skip() -> Path:
    """The default model's folder; skips the test where it is not prepared."""
    try:
        return resolve_model(None)
    except Exception as exc:  # any reason the model is missing
        pytest.skip(f"default model not prepared: {exc}")


@dataclasses.dataclass
class Scripted:
    url: str
    engine: ScriptedEngine
    config: AppConfig

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/ws"


def scripted_config(data_dir: Path, **server: object) -> AppConfig:
    return AppConfig(server=ServerConfig(**server),  # type: ignore[arg-type]
                     sessions=SessionConfig(data_dir=data_dir))


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Scripted]:
    """A live server over a scripted engine (echoes the last user message, 10 ms a token)."""
    engine = ScriptedEngine(token_delay_s=0.01, max_model_len=1000)
    config = scripted_config(tmp_path, max_content_chars=1000, max_tokens_limit=100,
                             default_max_tokens=100,
                             max_frame_bytes=8192, dashboard_interval_s=0.1)
    with live_server(config, engine) as url:
        yield Scripted(url, engine, config)


async def erasures(engine: ScriptedEngine, timeout_s: float = 2.0) -> list[Any]:
    """What the server had `engine` forget (the erasures of deleted sessions' KV), once it
    has asked (it does so in the background)."""
    for _ in range(int(timeout_s / 0.02)):
        if engine.forgotten:
            break
        await asyncio.sleep(0.02)
    return list(engine.forgotten)
