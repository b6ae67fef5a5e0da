"""Everything a request handler needs, built once per app."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable

from antiphon.config import AppConfig
from antiphon.engine_ext.engine import Engine
from antiphon.server.auth import Authenticator
from antiphon.server.batch_runner import BatchRunner
from antiphon.server.batch_store import BatchStore
from antiphon.server.chat import ChatService
from antiphon.server.dashboard import Dashboard
from antiphon.server.file_store import FileStore
from antiphon.server.limits import PerKeyLimit
from antiphon.server.metrics import ServerMetrics
from antiphon.server.turns import SessionTurns
from antiphon.sessions.store import SessionStore


@dataclasses.dataclass
class AppContext:
    config: AppConfig
    engine: Engine
    store: SessionStore
    metrics: ServerMetrics
    auth: Authenticator
    chat: ChatService
    turns: SessionTurns
    batch_store: BatchStore
    files: FileStore
    batches: BatchRunner
    dashboard: Dashboard
    connections_per_key: PerKeyLimit
    inflight_per_key: PerKeyLimit  # chat replies generating (websocket and REST)
    advisories_per_key: PerKeyLimit  # REST advisories being recorded (each reaches the engine)
    # /tokenize and /detokenize requests running: each renders on the thread chat turns'
    # renders take, and one key's many held every other key's requests up
    tokenizing_per_key: PerKeyLimit
    # Per API key: held while an upload is checked against the key's stored bytes and kept.
    upload_locks: defaultdict[str, asyncio.Lock] = dataclasses.field(
        default_factory=lambda: defaultdict(asyncio.Lock))
    started_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    num_connections: int = 0  # open websocket connections
    is_ready: bool = False  # the engine accepts requests
    engine_died: bool = False  # the engine failed for good: the server shuts down
    # Set by the server running the app (`DrainingServer`): begin a graceful shutdown.
    request_shutdown: Callable[[], None] | None = None
    # The engine's start (model load, first-start profiling) while it runs: a shutdown
    # asked for meanwhile cancels it (`app.DrainingServer.handle_exit`)
    starting: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, config: AppConfig, engine: Engine) -> AppContext:
        store = SessionStore(config.sessions.db_path, config.sessions.sqlite_synchronous,
                             config.sessions.kv_chains_kept, config.sessions.advisories_kept)
        metrics = ServerMetrics(config.server.dashboard_max_requests)
        targets_s = (config.engine.rt_ttft_slo_s, config.engine.rt_tpot_slo_s)
        chat = ChatService(engine, metrics, config.server, targets_s)
        data_dir = config.sessions.data_dir
        batch_store = BatchStore(data_dir / "batches.sqlite3", config.sessions.sqlite_synchronous)
        files = FileStore(data_dir / "files")
        auth = Authenticator(config.server.accepted_api_keys)
        server = config.server
        return cls(config, engine, store, metrics, auth,
                   chat, SessionTurns(store, chat, metrics, config.tiering.advisory_ttl_s),
                   batch_store, files,
                   BatchRunner(batch_store, files, chat, metrics),
                   Dashboard(metrics, engine, targets_s, config.server.dashboard_interval_s,
                             config.server.dashboard_history),
                   PerKeyLimit(server.max_connections_per_key, "open websocket connections",
                               "--max-connections-per-key", applies=auth.is_required),
                   PerKeyLimit(server.max_inflight_per_key, "replies generating",
                               "--max-inflight-per-key", applies=auth.is_required),
                   PerKeyLimit(server.max_inflight_per_key, "advisories being recorded",
                               "--max-inflight-per-key", applies=auth.is_required),
                   PerKeyLimit(server.max_inflight_per_key, "tokenize requests running",
                               "--max-inflight-per-key", applies=auth.is_required))
