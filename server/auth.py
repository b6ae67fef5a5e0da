"""API keys: who is calling, as an owner id that sessions are filed under.

Raw keys are never stored: an owner is the fingerprint of the key that opened the session.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import urllib.parse

from antiphon.server.errors import ApiError, ErrorCode

ANONYMOUS_OWNER = "local"


class Authenticator:
    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._fingerprints = {self.fingerprint(k) for k in api_keys}

    @property
    def is_required(self) -> bool:
        return bool(self._fingerprints)

    @staticmethod
    def fingerprint(key: str) -> str:
        return "key_" + hashlib.sha256(key.encode()).hexdigest()[:24]

    def owner_for(self, key: str | None) -> str:
        """The owner id of a request carrying `key`; raises `unauthorized` for a bad key."""
        if not self.is_required:
            return ANONYMOUS_OWNER
        if not key:
            raise ApiError(ErrorCode.UNAUTHORIZED, "an API key is required")
        fp = self.fingerprint(key)
        if not any(hmac.compare_digest(fp, known) for known in self._fingerprints):
            raise ApiError(ErrorCode.UNAUTHORIZED, "invalid API key")
        return fp


def key_from_headers(authorization: str | None, api_key_param: str | None = None) -> str | None:
    """The key from `Authorization: Bearer KEY`, else from an `api_key` query parameter."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return api_key_param or None


# A query parameter's name in a logged URL, as sent (maybe percent-encoded), up to its "=";
# found wherever one follows a "?" or "&", also inside another parameter's value (a key sent
# after a "?" in a value is the client's secret too, though the server reads no key there).
_NAME_IN_ARG = re.compile(r"(?<=[?&])([^=&?\s]*)=")
_NAME_IN_MSG = re.compile(r"(?<=[?&])([^=&?\s\"]*)=")
# A value runs to the next "&" as Starlette splits them (parse_qsl), a "?" included: a key
# holding one authenticates whole. In a formatted message it also ends at the quote that
# closes the logged request line.
_VALUE_IN_ARG = re.compile(r"[^&\s]*")
_VALUE_IN_MSG = re.compile(r"[^&\s\"]*")
# uvicorn logs each request's path with its query string: HTTP to "uvicorn.access", websocket
# upgrades to "uvicorn.error". The browser UI sends its key as `?api_key=` on the websocket.
URL_LOGGERS = ("uvicorn.access", "uvicorn.error")


def redact_api_key_params(text: str, is_message: bool = False) -> str:
    """`text` with the value of each query parameter whose name reads `api_key` as `***`
    (names compare as Starlette reads them, parse_qsl: '+' is a space, then percent-decoded,
    so `?api%5Fkey=KEY` authenticates as `?api_key=KEY` does; logged as sent); `is_message`:
    `text` is a formatted log message, where a quote ends a URL."""
    if "=" not in text:
        return text
    names, value = (_NAME_IN_MSG, _VALUE_IN_MSG) if is_message else (_NAME_IN_ARG, _VALUE_IN_ARG)
    parts, done = [], 0  # text up to `done` is in `parts`
    for name in names.finditer(text):
        if name.start() >= done and urllib.parse.unquote_plus(name[1]) == "api_key":
            parts += [text[done:name.end()], "***"]
            end = value.match(text, name.end())
            done = end.end() if end else name.end()
    return "".join(parts) + text[done:] if parts else text


class RedactApiKeys(logging.Filter):
    """Replaces the value of an `api_key` query parameter in logged URLs with `***`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_api_key_params(a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_api_key_params(record.msg, is_message=True)
        return True


def redact_api_keys_in_logs() -> None:
    """Keep API keys out of uvicorn's request logs (idempotent)."""
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactApiKeys) for f in logger.filters):
            logger.addFilter(RedactApiKeys())
