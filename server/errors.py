"""Typed API errors shared by the websocket and REST layers."""

from __future__ import annotations

import enum
import errno
import logging
import re
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The names pydantic gives the members of a union of plain types, in an error's path.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


class ErrorCode(enum.StrEnum):
    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    SESSION_NOT_FOUND = "session_not_found"
    REQUEST_NOT_FOUND = "request_not_found"
    DUPLICATE_REQUEST = "duplicate_request"
    MODEL_NOT_FOUND = "model_not_found"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN_ORIGIN = "forbidden_origin"
    TOO_MANY_REQUESTS = "too_many_requests"
    SESSION_BUSY = "session_busy"
    TOO_MANY_SESSIONS = "too_many_sessions"
    TOO_MANY_FILES = "too_many_files"
    SESSION_FULL = "session_full"
    ENGINE_ERROR = "engine_error"
    SHUTTING_DOWN = "shutting_down"
    FILE_NOT_FOUND = "file_not_found"
    FILE_IN_USE = "file_in_use"
    INVALID_FILE = "invalid_file"
    BATCH_NOT_FOUND = "batch_not_found"
    BATCH_NOT_CANCELLABLE = "batch_not_cancellable"
    MISSING_CUSTOM_ID = "missing_custom_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    UNSUPPORTED_URL = "unsupported_url"
    TOO_MANY_ITEMS = "too_many_items"
    BATCH_EXPIRED = "batch_expired"
    BATCH_CANCELLED = "batch_cancelled"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    STORAGE_FULL = "storage_full"
    INTERNAL_ERROR = "internal_error"


# Refusals that asking again cannot change until the caller does something (deletes files or
# sessions, waits for a batch's end): their responses say `x-should-retry: false`, which the
# `openai` client honours (it resends a 409 or a 429 twice, with any upload's body, otherwise).
NOT_RETRIABLE = frozenset({
    ErrorCode.TOO_MANY_FILES, ErrorCode.TOO_MANY_SESSIONS, ErrorCode.FILE_IN_USE,
    ErrorCode.BATCH_NOT_CANCELLABLE, ErrorCode.DUPLICATE_REQUEST, ErrorCode.SESSION_FULL})

# HTTP status for each code, used by the REST layer.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_JSON: 400,
    ErrorCode.BAD_MESSAGE: 400,
    ErrorCode.UNKNOWN_TYPE: 400,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.MAX_TOKENS_TOO_LARGE: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.REQUEST_NOT_FOUND: 404,
    ErrorCode.DUPLICATE_REQUEST: 409,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN_ORIGIN: 403,
    ErrorCode.TOO_MANY_REQUESTS: 429,
    ErrorCode.SESSION_BUSY: 409,
    ErrorCode.TOO_MANY_SESSIONS: 429,
    ErrorCode.TOO_MANY_FILES: 429,
    ErrorCode.SESSION_FULL: 409,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.FILE_NOT_FOUND: 404,
    ErrorCode.FILE_IN_USE: 409,
    ErrorCode.INVALID_FILE: 400,
    ErrorCode.BATCH_NOT_FOUND: 404,
    ErrorCode.BATCH_NOT_CANCELLABLE: 409,
    ErrorCode.MISSING_CUSTOM_ID: 400,
    ErrorCode.DUPLICATE_CUSTOM_ID: 400,
    ErrorCode.UNSUPPORTED_URL: 400,
    ErrorCode.TOO_MANY_ITEMS: 413,
    ErrorCode.BATCH_EXPIRED: 408,
    ErrorCode.BATCH_CANCELLED: 409,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.STORAGE_FULL: 507,
    ErrorCode.INTERNAL_ERROR: 500,
}


class ApiError(Exception):
    """An error the client caused or must know about; carries a stable code."""

    def __init__(self, code: ErrorCode, message: str, http_status: int | None = None,
                 param: str | None = None) -> None:
        """`http_status` overrides the code's (`HTTP_STATUS`) where one code covers cases
        HTTP tells apart; `param` names the request field at fault (OpenAI's `param`)."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self._http_status = http_status

    @property
    def http_status(self) -> int:
        return self._http_status or HTTP_STATUS[self.code]


def over_limit(message: str, param: str | None = None) -> ApiError:
    """A field of a request (`param`) past one of the server's limits (too many messages or
    stop sequences, a message too long): `too_large`, but a 400 as OpenAI answers it, not the
    413 of a body too large."""
    return ApiError(ErrorCode.TOO_LARGE, message, http_status=400, param=param)


def bad_message(errors: Sequence[Mapping[str, Any]], prefix: str = "", skip_loc: int = 0,
                default_loc: str = "body", parent: str = "") -> ApiError:
    """A `bad_message` error naming a failed field of a pydantic validation (`errors()` of a
    ValidationError), e.g. "messages.0.role: Input should be 'user' or ...": the first of the
    deepest, which for a union (`str | list[str]`) is the member the input's shape matched.
    The names pydantic gives union members ("constrained-str") are left out of the path,
    which starts with `parent` where the model validated sits inside another object."""
    deepest = max(len(e["loc"]) for e in errors)
    first = next(e for e in errors if len(e["loc"]) == deepest)
    path = ".".join(str(p) for p in first["loc"][skip_loc:] if isinstance(p, int)
                    or (_FIELD_NAME.fullmatch(str(p)) and str(p) not in _UNION_TAGS
                        and not str(p)[0].isupper()))  # (a model's name: a union's member)
    where = ".".join(part for part in (parent, path) if part) or default_loc
    message = str(first["msg"]).removeprefix("Value error, ")  # a validator's own words
    return ApiError(ErrorCode.BAD_MESSAGE, f"{prefix}{where}: {message}", param=where)


def is_storage_full(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is a full disk: SQLite's SQLITE_FULL, or
    an OSError of no space or quota left."""
    seen: BaseException | None = exc
    for _ in range(4):  # its causes, a few deep
        if seen is None:
            return False
        if isinstance(seen, sqlite3.OperationalError):
            if getattr(seen, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                return True
        elif isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def unexpected_error(exc: BaseException, where: str, outcome: str = "nothing was saved",
                     log_traceback: bool = True) -> ApiError:
    """What a client is told of an exception no handler expected in `where` (for the log):
    `storage_full`, saying `outcome`, when the disk is full (an operator can fix it and the
    client retry), logged as one line; else `internal_error`, logged with its traceback
    (unless the caller's framework logs it)."""
    if is_storage_full(exc):
        logger.error("%s: the disk is full (%s)", where, exc)
        return ApiError(ErrorCode.STORAGE_FULL, f"the server's disk is full, so {outcome}; "
                        "try again once space is freed")
    if log_traceback:
        logger.error("%s failed", where, exc_info=exc)
    return ApiError(ErrorCode.INTERNAL_ERROR, "internal error; see the server log")
