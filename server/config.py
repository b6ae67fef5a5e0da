"""Configuration of the API server: address, keys, and every input limit."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from antiphon.configfields import doc


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = doc("Address to bind", default="127.0.0.1")
    port: int = doc("Port to bind", default=8000)
    api_keys: tuple[str, ...] = doc(
        "Accepted API key (repeat the option for several; also ANTIPHON_API_KEYS). "
        "Optional on loopback, required on any other address", default=())
    max_frame_bytes: int = doc("Largest websocket message or REST body, in bytes",
                               default=256 * 1024)
    max_content_chars: int = doc("Longest user message, in characters", default=32_000)
    max_messages: int = doc("Most messages in one /v1/chat/completions request", default=256)
    default_max_tokens: int = doc("Output tokens when a request does not say", default=512)
    max_tokens_limit: int = doc("Largest max_tokens a request may ask for", default=4096)
    max_inflight_per_connection: int = doc(
        "Most generations in flight on one websocket connection", default=16)
    max_connections: int = doc("Most open websocket connections", default=512)
    max_sessions_listed: int = doc("Most sessions returned by one listing", default=200)
    max_batch_file_bytes: int = doc("Largest file uploaded to /v1/files, in bytes",
                                    default=64 * 1024 * 1024)
    max_batch_items: int = doc("Most requests (lines) in one batch input file", default=50_000)
    max_batch_concurrency: int = doc(
        "Most batch (BE) requests running on the engine at once, over all batches", default=8)
    keep_alive_s: float = doc(
        "Seconds an idle HTTP connection stays open for the client's next request. Longer than "
        "clients keep theirs (httpx, and the OpenAI client with it: 5 s), so the client closes "
        "first: a request sent on a connection the server is closing fails", default=75.0)
    dashboard_interval_s: float = doc("Seconds between the dashboard's samples", default=1.0)
    dashboard_history: int = doc("Dashboard samples kept (the charts' time span)", default=600)
    dashboard_max_requests: int = doc(
        "Finished requests kept between two dashboard samples for their latency quantiles",
        default=10_000)

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be 1..65535, got {self.port}")
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(
                f"binding to {self.host} needs at least one API key (--api-keys or "
                "ANTIPHON_API_KEYS); without keys the server only binds to loopback"
            )
        if any(len(k) < 8 for k in self.api_keys):
            raise ValueError("API keys must be at least 8 characters long")
        for name in ("max_frame_bytes", "max_content_chars", "max_messages", "default_max_tokens",
                     "max_tokens_limit", "max_inflight_per_connection", "max_connections",
                     "max_sessions_listed", "max_batch_file_bytes", "max_batch_items",
                     "max_batch_concurrency", "dashboard_history", "dashboard_max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("dashboard_interval_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")

    def uvicorn_options(self) -> dict[str, Any]:
        """The options uvicorn serves the app with."""
        return {"host": self.host, "port": self.port, "timeout_keep_alive": self.keep_alive_s,
                "ws_max_size": 4 * self.max_frame_bytes,
                # Token frames are tiny: compressing each costs more CPU than it saves.
                "ws_per_message_deflate": False}
