"""The whole deployment's configuration: one frozen dataclass per component, gathered here."""

from __future__ import annotations

import dataclasses

from antiphon.engine_ext.config import EngineConfig
from antiphon.server.config import ServerConfig
from antiphon.sessions.config import SessionConfig
from antiphon.tiering.config import TieringConfig


@dataclasses.dataclass(frozen=True)
class AppConfig:
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    sessions: SessionConfig = dataclasses.field(default_factory=SessionConfig)
    tiering: TieringConfig = dataclasses.field(default_factory=TieringConfig)
