"""Configuration of the API server: address, keys, and every input limit."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from typing import Any
from urllib.parse import urlsplit

from antiphon.configfields import check_int_fields, doc

# A key as an `Authorization: Bearer` header carries it: printable ASCII (a header's value is
# read as Latin-1 and a key hashed as UTF-8, so no other character compares equal), spaces
# inside only (the server strips the value it reads).
_HEADER_SAFE_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a `Host` header, without its port: `[::1]:8000` -> `::1`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


DEFAULT_PORTS = {"http": 80, "https": 443}


def web_origin(origin: str) -> str | None:
    """`origin` as browsers send it: `scheme://host[:port]` in lower case, an http(s) one
    without its scheme's default port; another scheme's (a browser extension's
    `chrome-extension://id`, an app shell's `tauri://localhost`) as it is, and `null` (a
    `file://` page's). None where it is no origin (a path, no host)."""
    text = origin.strip().rstrip("/").lower()
    if text == "null":
        return text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # (a port that is no number)
        return None
    if not parts.scheme or not parts.hostname or parts.path or parts.query \
            or parts.fragment or parts.username is not None:
        return None
    if parts.scheme not in DEFAULT_PORTS:
        return text
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return (f"{parts.scheme}://{host}" if port in (None, DEFAULT_PORTS[parts.scheme])
            else f"{parts.scheme}://{host}:{port}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = doc("Address to bind", default="127.0.0.1")
    port: int = doc("Port to bind", default=8000)
    api_keys: tuple[str, ...] = doc(
        "Accepted API key (repeat the option for several; also ANTIPHON_API_KEYS). "
        "Optional on loopback, required on any other address", default=())
    best_effort_api_keys: tuple[str, ...] = doc(
        "Accepted API key whose every request runs as best-effort (BE) work, behind chat "
        "turns (repeat for several): for clients that cannot ask for it themselves "
        "(vllm_xargs.request_class), such as an evaluation harness or a crawler; such a key's "
        "request that asks for rt is refused. Also ANTIPHON_BEST_EFFORT_API_KEYS", default=())
    allowed_origins: tuple[str, ...] = doc(
        "Web origin (scheme://host[:port]) besides the server's own whose pages may use a server "
        "without API keys through the user's browser (repeat for several); other sites' pages "
        "are refused", default=())
    allowed_hosts: tuple[str, ...] = doc(
        "Host name besides localhost and loopback addresses that a server without API keys "
        "answers to (repeat for several); others are refused, against DNS rebinding",
        default=())
    model_aliases: tuple[str, ...] = doc(
        "Another name requests may give the served model (repeat the option for several), such "
        "as the model an app was written for (gpt-4o-mini): /v1/models lists it, and replies "
        "name the model as the request named it", default=())
    max_frame_bytes: int = doc("Largest websocket message or REST body, in bytes",
                               default=256 * 1024)
    max_content_chars: int = doc("Longest user message, in characters", default=32_000)
    max_messages: int = doc("Most messages in one /v1/chat/completions request", default=256)
    default_max_tokens: int | None = doc(
        "Output tokens when a request does not say; unset: 512, or --max-tokens-limit where "
        "that is lower", default=None)
    max_tokens_limit: int = doc("Largest max_tokens a request may ask for", default=4096)
    default_temperature: float | None = doc(
        "Sampling temperature of a request that does not say (REST, websocket and batch); 0 "
        "answers greedily. Unset: the model's generation_config.json temperature, as vLLM "
        "takes it (the default model's: 0.2), else 1 as in OpenAI's API", default=None)
    max_stop_sequences: int = doc("Most stop sequences in one request", default=16)
    max_stop_chars: int = doc(
        "Longest stop sequence (characters): the engine looks for each one in the reply's end "
        "at every token", default=1000)
    max_logit_bias_tokens: int = doc("Most tokens one request's logit_bias names", default=300)
    max_choices: int = doc(
        "Most choices one completion request asks for: n, times the prompts of a text "
        "completion (each choice is a reply generating, counted in --max-inflight-per-key)",
        default=16)
    max_tools: int = doc("Most tools one chat completion offers the model", default=128)
    max_prompt_logprobs_tokens: int = doc(
        "Most prompt tokens a text completion may ask the logprobs of (echo with logprobs), "
        "over all its prompts and times its choices (n), each of which computes them: they "
        "are computed at once, over the whole vocabulary, and took 0.5 GB of memory per 1000 "
        "tokens with the default model", default=4096)
    max_inflight_per_connection: int = doc(
        "Most generations in flight on one websocket connection", default=16)
    max_connections: int = doc("Most open websocket connections", default=512)
    max_connections_per_key: int = doc(
        "Most open websocket connections of one API key (with keys only)", default=64)
    max_inflight_per_key: int = doc(
        "Most chat replies (websocket turns and REST completions) of one API key generating "
        "at once (with keys only), and most of its REST advisories being recorded, and of its "
        "/tokenize and /detokenize requests running, at once; batch items share "
        "--max-batch-concurrency instead", default=64)
    max_sessions_listed: int = doc("Most sessions returned by one listing", default=200)
    share_kv_across_keys: bool = doc(
        "Let API keys share cached KV (vLLM's prefix cache and the KV tiers): a prompt prefix "
        "common to several keys is computed once, but one key can then time another's "
        "prompts (a cache hit answers sooner). Off: each key's KV is salted with its own "
        "fingerprint (vLLM's cache_salt)", default=False)
    context_refill_frac: float = doc(
        "When a chat session's conversation leaves a reply less room than it asks for, its "
        "oldest messages leave the model's view (they stay in the session) until what "
        "remains fills at most this fraction of the model's context: the rest is room to "
        "grow, and the conversation is recomputed once per cut, not at every turn",
        default=0.5)
    public_metrics: bool = doc(
        "Serve /metrics without an API key when keys are set (a Prometheus scraper with no "
        "credentials). Off: /metrics needs a key like /v1/engine/stats; /healthz never does",
        default=False)
    max_sessions_per_key: int = doc(
        "Most chat sessions one API key keeps, all keys together without keys; creating one "
        "past it is refused until sessions are deleted", default=100_000)
    max_session_messages: int = doc(
        "Most messages one chat session keeps (users', replies, tools' results); a turn that "
        "would take it past is refused with session_full, and the conversation goes on in a "
        "new session (the model sees the latest messages of a long one only, and opening a "
        "session sends all of them)", default=10_000)
    typing_interval_s: float = doc(
        "A session's typing advisories closer together than this many seconds count once: "
        "the rest are dropped unrecorded (a client that sends one per keystroke)", default=1.0)
    advisory_repeat_interval_s: float = doc(
        "An advisory (any source) for a session whose conversation has not changed since its "
        "last advisory sent to the engine, within this many seconds of it, repeats it: it is "
        "answered as that one was and not sent again (each one sent reads, renders and "
        "hashes the whole conversation). 0: every advisory is sent", default=1.0)
    session_free_wait_s: float = doc(
        "How long a turn, or a deletion, of a session whose running turn is being cut short "
        "(cancelled, or its client gone) waits for that turn to keep what it has and let go of "
        "the session, before it is refused with session_busy (a client cut off mid-reply "
        "reconnects and asks again at once). 0: refused at once", default=5.0)
    kv_erasure_retry_s: float = doc(
        "How long after a failed erasure of a deleted session's KV (the engine busy, down or "
        "a disk write failing) it is tried again, in seconds; doubled after each failure up "
        "to 64 times this, and the rest of the queue goes on meanwhile", default=5.0)
    max_advisory_lead_s: float = doc(
        "Latest expected_arrival an advisory may name, in seconds from now: the prefetched KV "
        "stays reserved until then (plus the engine's --advisory-ttl-s)", default=600.0)
    max_batch_file_bytes: int = doc("Largest file uploaded to /v1/files, in bytes",
                                    default=64 * 1024 * 1024)
    max_stored_file_bytes: int = doc(
        "Most bytes of files (batch inputs, outputs and errors) one API key keeps stored, all "
        "keys together without keys; an upload past it is refused until files are deleted, "
        "and a batch is created only while the key has room (its results, written as it "
        "finishes, may pass it by their size)",
        default=8 * 1024 ** 3)
    max_files_per_key: int = doc(
        "Most files (batch inputs, outputs and errors) one API key keeps, all keys together "
        "without keys; an upload or a new batch past it is refused with too_many_files until "
        "files are deleted (each costs a file on disk and a row read at every start, whatever "
        "its size); the batches still running may add their results (two files each) past "
        "it", default=10_000)
    max_batch_items: int = doc("Most requests (lines) in one batch input file", default=50_000)
    max_custom_id_chars: int = doc("Longest custom_id of a batch input line, in characters "
                                   "(a line's longest is --max-frame-bytes)", default=512)
    max_unfinished_batches: int = doc(
        "Most batches one API key has not finished (validating, in progress, finalizing), all "
        "keys together without keys; creating one past it is refused until some finish",
        default=16)
    max_batch_concurrency: int = doc(
        "Most batch (BE) requests running on the engine at once, over all batches: a line "
        "asking for several choices runs one per choice (one asking for more runs alone)",
        default=8)
    max_batch_item_attempts: int = doc(
        "Times a batch item may start without an answer (each cut short by a crash, a restart "
        "or an engine failure) before it fails instead of running again, so that no request "
        "keeps a batch or a server in a crash loop; a clean shutdown does not count",
        default=3)
    sse_ping_s: float = doc(
        "Seconds a streaming completion may send nothing (a request queued for its first "
        "token, or paused) before it sends an SSE comment, which clients skip, so that proxies "
        "with idle timeouts keep it open", default=15.0)
    keep_alive_s: float = doc(
        "Seconds an idle HTTP connection stays open for the client's next request. Longer than "
        "clients keep theirs (httpx, and the OpenAI client with it: 5 s), so the client closes "
        "first: a request sent on a connection the server is closing fails", default=75.0)
    header_timeout_s: float = doc(
        "Seconds a connection has to send a request's headers, from when it opens or the "
        "request's first byte: one that sends none, or trickles them, is closed (uvicorn "
        "times out only connections idle between requests)", default=30.0)
    body_timeout_s: float = doc(
        "Seconds a request's body may send nothing before its connection is closed (the "
        "request fails as if the client had left)", default=60.0)
    send_timeout_s: float = doc(
        "Seconds a client may take nothing of what the server sends it (it stopped reading, "
        "or its network went away, and the socket's buffers are full) before its connection "
        "is closed: its replies end as if it had left, and a websocket turn's session is free "
        "for the next turn", default=60.0)
    min_request_slo_frac: float = doc(
        "The tightest TTFT or TPOT target a request may set for itself (vllm_xargs), as a "
        "fraction of the deployment's (--rt-ttft-slo-s, --rt-tpot-slo-s): a tighter target "
        "takes step time from every other request. 1: none tighter than the deployment's; "
        "looser targets are always allowed", default=1.0)
    drain_timeout_s: float = doc(
        "On SIGTERM or Ctrl-C, how long chat replies streaming then may run to their end "
        "before the server closes their connections (new turns get shutting_down, and "
        "/healthz says not ready, meanwhile); batch items stop at once and run again after "
        "the restart", default=30.0)
    dashboard_interval_s: float = doc("Seconds between the dashboard's samples", default=1.0)
    dashboard_history: int = doc("Dashboard samples kept (the charts' time span)", default=600)
    dashboard_max_requests: int = doc(
        "Finished requests kept between two dashboard samples for their latency quantiles",
        default=10_000)

    @property
    def accepted_api_keys(self) -> tuple[str, ...]:
        """Every key the server accepts: `api_keys`, then `best_effort_api_keys`."""
        return self.api_keys + self.best_effort_api_keys

    def __post_init__(self) -> None:
        check_int_fields(self)
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be 1..65535, got {self.port}")
        for origin in self.allowed_origins:
            if web_origin(origin) == "null":
                raise ValueError("allowed_origins: null is the origin of file:// pages, and "
                                 "of sandboxed frames any web site can make: allowed, every "
                                 "site's pages could use this server (serve the page "
                                 "instead, and allow its origin)")
            if web_origin(origin) is None:
                raise ValueError(f"allowed_origins: {origin!r} is no web origin: give "
                                 "scheme://host[:port], e.g. https://chat.example.com")
        for host in self.allowed_hosts:
            if not host_name(host) or any(c in host for c in "/@ \t"):
                raise ValueError(f"allowed_hosts: {host!r} is no host name: give the name "
                                 "alone, e.g. chat.example.com")
        if not self.accepted_api_keys and not is_loopback(self.host):
            raise ValueError(
                f"binding to {self.host} needs at least one API key (--api-keys or "
                "ANTIPHON_API_KEYS); without keys the server only binds to loopback"
            )
        if any(len(k) < 8 for k in self.accepted_api_keys):
            raise ValueError("API keys must be at least 8 characters long")
        for name in ("api_keys", "best_effort_api_keys"):
            bad = [i for i, k in enumerate(getattr(self, name), 1)
                   if not _HEADER_SAFE_KEY.fullmatch(k)]
            if bad:  # (the key itself is a secret: named by its place, not shown)
                raise ValueError(
                    f"{name} #{bad[0]} can never be sent in an Authorization header: API keys "
                    "must be printable ASCII, with no whitespace at either end")
        if set(self.api_keys) & set(self.best_effort_api_keys):
            # (it ran as best-effort work, whichever list the operator meant)
            raise ValueError("a key is in both --api-keys and --best-effort-api-keys: give "
                             "each key in one of them")
        if any(not alias.strip() or len(alias) > 256 for alias in self.model_aliases):
            raise ValueError("model aliases must be 1 to 256 characters, not blank")
        for name in ("max_frame_bytes", "max_content_chars", "max_messages", "default_max_tokens",
                     "max_tokens_limit", "max_stop_sequences", "max_stop_chars",
                     "max_logit_bias_tokens",
                     "max_choices", "max_tools", "max_prompt_logprobs_tokens",
                     "max_inflight_per_connection", "max_connections", "max_connections_per_key",
                     "max_inflight_per_key", "max_sessions_listed", "max_sessions_per_key",
                     "max_session_messages", "max_batch_file_bytes", "max_stored_file_bytes",
                     "max_files_per_key", "max_batch_items",
                     "max_custom_id_chars", "max_unfinished_batches", "max_batch_item_attempts",
                     "max_batch_concurrency", "dashboard_history", "dashboard_max_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("dashboard_interval_s", "keep_alive_s", "header_timeout_s", "body_timeout_s",
                     "send_timeout_s", "sse_ping_s", "max_advisory_lead_s", "drain_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite")
        if not 0 < self.context_refill_frac < 1:
            raise ValueError("context_refill_frac must be within (0, 1)")
        if not 0 < self.min_request_slo_frac <= 1:
            raise ValueError("min_request_slo_frac must be within (0, 1]")
        if self.default_temperature is not None and not 0 <= self.default_temperature <= 2:
            raise ValueError("default_temperature must be within [0, 2]")
        for name in ("typing_interval_s", "advisory_repeat_interval_s", "session_free_wait_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be at least 0 and finite")
        if not 0 < self.kv_erasure_retry_s < math.inf:
            raise ValueError("kv_erasure_retry_s must be positive and finite")
        if self.reply_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must not exceed "
                             f"max_tokens_limit ({self.max_tokens_limit})")

    @property
    def reply_max_tokens(self) -> int:
        """Output tokens of a request that does not say (`default_max_tokens` resolved)."""
        if self.default_max_tokens is None:
            return min(512, self.max_tokens_limit)
        return self.default_max_tokens

    def uvicorn_options(self) -> dict[str, Any]:
        """The options uvicorn serves the app with."""
        from antiphon.server.http_deadlines import deadline_protocols

        http, ws = deadline_protocols(self.header_timeout_s, self.body_timeout_s,
                                      self.send_timeout_s)
        return {"host": self.host, "port": self.port, "timeout_keep_alive": self.keep_alive_s,
                "http": http,
                # After the drain (`app.DrainingServer`), what still streams is cut soon.
                "timeout_graceful_shutdown": 5.0,
                "ws": ws,  # (websockets-sansio: `app.DrainingServer` knows its shutdown)
                "ws_max_size": 4 * self.max_frame_bytes,
                # Token frames are tiny: compressing each costs more CPU than it saves.
                "ws_per_message_deflate": False}
