"""A session's fields as clients give and page them: titles cleaned, listing cursors."""

from __future__ import annotations

import math
import re

from antiphon.server import protocol
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.sessions.store import Session


def title_text(text: str) -> str:
    """`text` as a session title shows it: whitespace runs as single spaces, no control
    characters."""
    return " ".join("".join(ch for ch in text if ch.isprintable() or ch.isspace()).split())


TITLE_CHARS = 60  # of a title taken from a session's first message


def title_from(message: str) -> str:
    """The title a session's first message gives it: its start, cut after a whole word
    (with "…") where it runs past `TITLE_CHARS`."""
    text = title_text(message)
    if len(text) <= TITLE_CHARS:
        return text
    cut = text[:TITLE_CHARS - 1]
    words = cut.rsplit(" ", 1)[0] if " " in cut[TITLE_CHARS // 2:] else cut
    return words.rstrip(" ,.;:-") + "…"


def clean_title(title: str) -> str:
    """A title a client gave, as stored (`title_text`); raises `bad_message` when nothing is
    left."""
    title = title_text(title)
    if not title:
        raise ApiError(ErrorCode.BAD_MESSAGE, "title is empty")
    return title


def session_cursor(session: Session) -> str:
    """Where a listing goes on after `session`: `<updated_at>|<session_id>`."""
    return f"{session.updated_at!r}|{session.session_id}"


def parse_cursor(cursor: str) -> tuple[float, str]:
    """A `session_cursor`'s (updated_at, session_id); raises `bad_message`."""
    updated_at, _, session_id = cursor.partition("|")
    try:
        value = float(updated_at)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and re.fullmatch(protocol.ID_PATTERN, session_id)):
        raise ApiError(ErrorCode.BAD_MESSAGE, f"not a session listing cursor: {cursor[:80]!r}")
    return value, session_id
