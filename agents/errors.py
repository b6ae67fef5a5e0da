"""Typed errors of the client SDK, one class per kind of failure a caller handles differently.

Every error the server sends carries a stable `code` (see `antiphon.server.errors.ErrorCode`);
`error_for` turns it into the matching class, keeping the code and the server's message.
"""

from __future__ import annotations


class AntiphonError(Exception):
    """Base of every SDK error. `code` is the server's error code (or an SDK one)."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class AuthenticationError(AntiphonError):
    """The server requires an API key and got none or a wrong one."""


class NotFoundError(AntiphonError):
    """A session, request, file, batch or model that does not exist (for this API key)."""


class InvalidRequestError(AntiphonError):
    """The request broke a rule or a limit (bad field, message too long, context too long)."""


class BusyError(AntiphonError):
    """Try again later: rate or connection limits, a session already answering, shutting down."""


class ServerError(AntiphonError):
    """The server or its engine failed."""


class ConnectionLostError(AntiphonError):
    """The connection dropped, or could not be opened, before the reply was complete.

    `accepted` says whether the server had taken the message: if so it keeps it, with
    `partial` (the text received so far) as its reply where there is some (unless the server
    itself went down: then the message is kept without a reply), and
    `regenerate(session_id)` asks for a whole reply; if not, the server did not say it had
    taken it, which it may still have done (it kept the message and went down before its
    answer reached the client): `get_session` tells, before the message is sent again. The
    next call reconnects."""

    def __init__(self, message: str, partial: str = "", request_id: str | None = None, *,
                 accepted: bool = False) -> None:
        super().__init__("connection_lost", message)
        self.partial = partial
        self.request_id = request_id
        self.accepted = accepted


class RequestTimeoutError(AntiphonError):
    """No answer (or no next token) within the client's timeout."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


_BY_CODE: dict[str, type[AntiphonError]] = {
    "unauthorized": AuthenticationError,
    "session_not_found": NotFoundError,
    "request_not_found": NotFoundError,
    "model_not_found": NotFoundError,
    "file_not_found": NotFoundError,
    "batch_not_found": NotFoundError,
    "not_found": NotFoundError,
    "too_many_requests": BusyError,
    "session_busy": BusyError,
    "shutting_down": BusyError,
    "engine_error": ServerError,
    "internal_error": ServerError,
    # (websocket error frames carry no HTTP status: every 5xx code is named here)
    "storage_full": ServerError,
}


# The class of an answer with no server error in it (a proxy's plain page, `http_<status>`),
# by its status alone.
_BY_STATUS: dict[int, type[AntiphonError]] = {
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    429: BusyError,
}


def error_for(code: str, message: str, status: int | None = None) -> AntiphonError:
    """The typed error for a server error `code`; unknown 5xx codes are server errors, any
    other unknown code an invalid request, but an answer that carried no code (a proxy's
    page) is typed by its status: a proxy's 401 asking for its own credentials is an
    `AuthenticationError`, not a bad request."""
    cls = _BY_CODE.get(code)
    if cls is None and status is not None and code == f"http_{status}":
        cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status is not None and status >= 500 else InvalidRequestError
    return cls(code, message, status)
