"""Sessions and their messages, persisted in SQLite (WAL) under the data directory.

A session belongs to one owner (an API key's fingerprint); every read takes the owner and a
session of another owner is reported as absent. Writes commit before they return, so an accepted
message survives a crash of the server.
"""

from __future__ import annotations

import array
import dataclasses
import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from antiphon.sqlite import SqliteDb

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    title      TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    system     TEXT  -- the system message the model sees before the conversation (null: none)
);
DROP INDEX IF EXISTS sessions_owner;
CREATE INDEX IF NOT EXISTS sessions_owner_recent ON sessions(owner, updated_at, session_id);
CREATE TABLE IF NOT EXISTS messages (
    session_id    TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
    seq           INTEGER NOT NULL,
    role          TEXT NOT NULL,
    content       TEXT NOT NULL,
    num_tokens    INTEGER NOT NULL,
    finish_reason TEXT,
    created_at    REAL NOT NULL,
    tool_calls    TEXT,  -- an assistant's calls of tools: JSON, as OpenAI's `tool_calls`
    tool_call_id  TEXT,  -- a tool's result: the call it answers
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS advisories (
    session_id  TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
    source      TEXT NOT NULL,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS advisories_session ON advisories(session_id, received_at);
CREATE TABLE IF NOT EXISTS contexts (
    session_id   TEXT PRIMARY KEY REFERENCES sessions(session_id) ON DELETE CASCADE,
    num_messages INTEGER NOT NULL,
    token_ids    BLOB NOT NULL
);
-- The first message the model still sees, once a conversation outgrew the model's context
-- (no row: the first message of all).
CREATE TABLE IF NOT EXISTS windows (
    session_id    TEXT PRIMARY KEY REFERENCES sessions(session_id) ON DELETE CASCADE,
    first_message INTEGER NOT NULL
);
-- Token sequences a session ran that its stored context no longer extends (a window cut, a
-- prompt rendered anew): the KV tiers may hold their chunks, which its deletion erases.
CREATE TABLE IF NOT EXISTS kv_chains (
    session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
    token_ids  BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS kv_chains_session ON kv_chains(session_id);
-- Deleted sessions whose KV the engine has yet to erase from its tiers, and live sessions'
-- chains past the most kept (kept across a restart; a row goes once the engine has erased it).
CREATE TABLE IF NOT EXISTS kv_erasures (
    erasure_id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner      TEXT NOT NULL,
    chains     BLOB NOT NULL
);
"""

ADVISORIES_KEPT = 32  # per session, the most recent (`SessionConfig.advisories_kept`)
# Per session, the most recent token chains its stored context no longer extends (a reply
# regenerated over and over leaves one each; `SessionConfig.kv_chains_kept`): older ones are
# queued for erasure from the KV tiers, less what the session still runs (`kept_chains`).
KV_CHAINS_KEPT = 16

# Before a session's stored context is replaced: keep it as a chain unless the new context
# (`:ids`, token ids as `_ids` packs them; null when there is none) extends it.
_KEEP_DIVERGED_CHAIN = (
    "INSERT INTO kv_chains SELECT c.session_id, c.token_ids FROM contexts c WHERE"
    " c.session_id = :session AND (:ids IS NULL OR substr(:ids, 1, length(c.token_ids))"
    " != c.token_ids)"
    " AND NOT EXISTS (SELECT 1 FROM kv_chains k WHERE k.session_id = c.session_id"
    " AND k.token_ids = c.token_ids)")  # a greedy reply regenerated again: the same chain

# Every token sequence of a session's whose KV the tiers may hold: its stored context and its
# kept chains (parameters: the session id, twice).
_SESSION_CHAINS = ("SELECT token_ids FROM contexts WHERE session_id = ? UNION ALL"
                   " SELECT token_ids FROM kv_chains WHERE session_id = ?")


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    owner: str
    title: str
    created_at: float  # unix seconds
    updated_at: float
    num_messages: int = 0
    context_start: int = 0  # the first message the model still sees (`move_window`)
    system: str | None = None  # the system message the model sees first, set at creation

    def to_json(self, *, listed: bool = False) -> dict[str, object]:
        """As the APIs give it; `listed` (a listing of many) without the system message, which
        may be as long as a message."""
        data: dict[str, object] = {
            "session_id": self.session_id, "title": self.title, "created_at": self.created_at,
            "updated_at": self.updated_at, "num_messages": self.num_messages,
            "context_start": self.context_start}
        if not listed:
            data["system"] = self.system
        return data


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # "user" | "assistant" | "tool"
    content: str
    num_tokens: int
    created_at: float
    # assistant messages: "stop", "length", "cancelled", "tool_calls"
    finish_reason: str | None = None
    # an assistant's calls of tools, as OpenAI's `tool_calls` ({"id", "type": "function",
    # "function": {"name", "arguments"}}); None: it called none
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def to_json(self) -> dict[str, object]:
        """As the APIs give it; the tool fields only where set."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if value is not None or name not in ("tool_calls", "tool_call_id")}


_MESSAGE_COLUMNS = "role, content, num_tokens, created_at, finish_reason, tool_calls, tool_call_id"


def _message(row: Sequence[Any]) -> Message:
    calls = None if row[5] is None else tuple(json.loads(row[5]))
    role, content, num_tokens, created_at, finish_reason = row[:5]
    return Message(role, content, num_tokens, created_at, finish_reason, calls, row[6])


# `Session`'s fields, from `sessions s`.
_SESSION_COLUMNS = (
    "s.session_id, s.owner, s.title, s.created_at, s.updated_at,"
    " (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.session_id),"
    " COALESCE((SELECT first_message FROM windows w WHERE w.session_id = s.session_id), 0),"
    " s.system")


def _ids(token_ids: Sequence[int]) -> bytes:
    return array.array("I", token_ids).tobytes()


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    ids = array.array("I")
    ids.frombytes(blob)
    return tuple(ids)


def _pack_chains(chains: Sequence[bytes]) -> bytes:
    """Token-id blobs, each behind its length in tokens."""
    return b"".join(array.array("I", [len(c) // 4]).tobytes() + c for c in chains)


def _unpack_chains(blob: bytes) -> list[tuple[int, ...]]:
    ids = _unpack_ids(blob)
    chains, at = [], 0
    while at < len(ids):
        chains.append(ids[at + 1:at + 1 + ids[at]])
        at += 1 + ids[at]
    return chains


@dataclasses.dataclass(frozen=True)
class TurnUndo:
    """What a turn's messages changed of their session besides adding themselves, for
    `withdraw_messages` to give back (`add_turn_messages`)."""

    updated_at: float  # the session's, before them (orders the listings)
    title: str | None = None  # the title they gave the session; None: they gave none
    window: int | None = None  # where the window was, when they moved it
    context: tuple[int, bytes] | None = None  # the stored context the move dropped


def _insert_message(db: sqlite3.Connection, session_id: str, m: Message) -> None:
    """Insert `m` as the session's next message (seq one past its last)."""
    calls = None if m.tool_calls is None else json.dumps(m.tool_calls)
    db.execute(
        f"INSERT INTO messages (session_id, seq, {_MESSAGE_COLUMNS}) SELECT ?,"
        " COALESCE(MAX(seq), -1) + 1, ?, ?, ?, ?, ?, ?, ? FROM messages WHERE session_id = ?",
        (session_id, m.role, m.content, m.num_tokens, m.created_at, m.finish_reason, calls,
         m.tool_call_id, session_id))


def new_session_id() -> str:
    return "s_" + secrets.token_urlsafe(12)


class SessionStore:
    """Thread-safe; one connection guarded by a lock (SQLite serialises writers anyway)."""

    def __init__(self, path: Path, synchronous: str = "FULL",
                 kv_chains_kept: int = KV_CHAINS_KEPT,
                 advisories_kept: int = ADVISORIES_KEPT) -> None:
        if kv_chains_kept < 1:
            raise ValueError(f"kv_chains_kept must be at least 1, not {kv_chains_kept}")
        if advisories_kept < 1:
            raise ValueError(f"advisories_kept must be at least 1, not {advisories_kept}")
        self.path = path
        self.kv_chains_kept = kv_chains_kept
        self.advisories_kept = advisories_kept
        # Called (in the writing thread) once a write queued an erasure of a live session's
        # old chains; the server has its eraser run then.
        self.on_erasure_queued: Callable[[], None] | None = None
        self._db = SqliteDb(path, _SCHEMA, synchronous, migrate=_migrate)

    def close(self) -> None:
        self._db.close()

    def create_session(self, owner: str, title: str = "New chat",
                       max_sessions: int | None = None,
                       system: str | None = None) -> Session | None:
        """A new session of `owner`'s, whose model sees `system` first (None: no system
        message); None (and nothing written) when the owner has `max_sessions` already."""
        now = time.time()
        session = Session(new_session_id(), owner, title, now, now, system=system)
        with self._db.locked() as db:
            inserted = db.execute(
                "INSERT INTO sessions (session_id, owner, title, created_at, updated_at, system)"
                " SELECT ?, ?, ?, ?, ?, ? WHERE ? IS NULL OR"
                " (SELECT COUNT(*) FROM sessions WHERE owner = ?) < ?",
                (session.session_id, owner, title, now, now, system, max_sessions, owner,
                 max_sessions),
            ).rowcount
        return session if inserted else None

    def get_session(self, owner: str, session_id: str) -> Session | None:
        """The session, or None when it does not exist or belongs to another owner."""
        with self._db.locked() as db:
            row = db.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions s"
                " WHERE s.session_id = ? AND s.owner = ?",
                (session_id, owner),
            ).fetchone()
        return Session(*row) if row else None

    def list_sessions(self, owner: str, limit: int = 100,
                      before: tuple[float, str] | None = None) -> list[Session]:
        """The owner's sessions, most recently updated first (ties by id, descending);
        `before` = (updated_at, session_id) lists those after that one in this order."""
        # A row-value comparison, which SQLite answers from the index (an OR of the two
        # columns made it scan all of the owner's sessions for every page after the first).
        after = "" if before is None else " AND (s.updated_at, s.session_id) < (?, ?)"
        cursor = () if before is None else before
        with self._db.locked() as db:
            rows = db.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions s WHERE s.owner = ?{after}"
                " ORDER BY s.updated_at DESC, s.session_id DESC LIMIT ?",
                (owner, *cursor, limit),
            ).fetchall()
        return [Session(*r) for r in rows]

    def add_turn_messages(self, session_id: str, role: str,
                          messages: Sequence[tuple[str, int, str | None]],
                          title: str | None = None, window: int | None = None,
                          untitled: str = "New chat") -> TurnUndo:
        """Append and commit a turn's messages of `role` (a user's, or tools' results), each
        (content, num_tokens, tool_call_id), bumping updated_at; with `title` name the session
        after them unless it was named already; with `window`, move the window there first
        (`move_window`: a turn that leaves messages out). One transaction, durable on return:
        a crash between them left a window moved past a message never added, or a session
        untitled for good. Returns what `withdraw_messages` gives back."""
        now = time.time()
        pruned, old_window, old_context = False, None, None
        with self._db.transaction() as db:
            row = db.execute("SELECT updated_at FROM sessions WHERE session_id = ?",
                             (session_id,)).fetchone()
            if window is not None:
                at = db.execute("SELECT first_message FROM windows WHERE session_id = ?",
                                (session_id,)).fetchone()
                old_window = 0 if at is None else int(at[0])
                old_context = db.execute(
                    "SELECT num_messages, token_ids FROM contexts WHERE session_id = ?",
                    (session_id,)).fetchone()
                pruned = self._move_window(db, session_id, window)
            for content, num_tokens, tool_call_id in messages:
                _insert_message(db, session_id, Message(role, content, num_tokens, now,
                                                        tool_call_id=tool_call_id))
            db.execute("UPDATE sessions SET updated_at = ? WHERE session_id = ?",
                       (now, session_id))
            named = title is not None and db.execute(
                "UPDATE sessions SET title = ? WHERE session_id = ? AND title = ?",
                (title, session_id, untitled)).rowcount == 1
        self._erasure_queued(pruned)
        return TurnUndo(now if row is None else float(row[0]), title if named else None,
                        old_window, None if old_context is None else tuple(old_context))

    def withdraw_messages(self, session_id: str, role: str, contents: Sequence[str],
                          undo: TurnUndo | None = None, untitled: str = "New chat") -> bool:
        """Delete the session's last messages if they are `contents`, in order, all of `role`
        (what a turn the engine refused had committed), and give back what `undo` says they
        changed: the session's updated_at (the listings' order), its untitled name if they
        named it and nothing renamed it since, and the window and stored context if they
        moved it (the model saw none of the conversation before them again, for good). One
        transaction; True when the messages were deleted."""
        with self._db.transaction() as db:
            rows = db.execute("SELECT seq, role, content FROM messages WHERE session_id = ?"
                              " ORDER BY seq DESC LIMIT ?",
                              (session_id, len(contents))).fetchall()
            if not contents or [(r[1], r[2]) for r in reversed(rows)] != [
                    (role, content) for content in contents]:
                return False
            db.execute("DELETE FROM messages WHERE session_id = ? AND seq >= ?",
                       (session_id, rows[-1][0]))
            if undo is not None:
                self._undo(db, session_id, undo, untitled)
        return True

    def _undo(self, db: sqlite3.Connection, session_id: str, undo: TurnUndo,
              untitled: str) -> None:
        db.execute("UPDATE sessions SET updated_at = ? WHERE session_id = ?",
                   (undo.updated_at, session_id))
        if undo.title is not None:
            db.execute("UPDATE sessions SET title = ? WHERE session_id = ? AND title = ?"
                       " AND NOT EXISTS (SELECT 1 FROM messages WHERE session_id = ?)",
                       (untitled, session_id, undo.title, session_id))
        if undo.window is not None:
            db.execute("INSERT OR REPLACE INTO windows SELECT session_id, ? FROM sessions"
                       " WHERE session_id = ?", (undo.window, session_id))
        if undo.context is not None:  # back, and no longer one of the chains it ran
            num_messages, token_ids = undo.context
            db.execute("INSERT OR REPLACE INTO contexts VALUES (?, ?, ?)",
                       (session_id, num_messages, token_ids))
            db.execute("DELETE FROM kv_chains WHERE session_id = ? AND token_ids = ?",
                       (session_id, token_ids))

    def rename_session(self, owner: str, session_id: str, title: str) -> bool:
        """Set the title; `updated_at` (the last turn, which orders listings) stays."""
        with self._db.locked() as db:
            cur = db.execute(
                "UPDATE sessions SET title = ? WHERE session_id = ? AND owner = ?",
                (title, session_id, owner),
            )
        return cur.rowcount == 1

    def delete_session(self, owner: str, session_id: str,
                       last_prompt: Sequence[int] | None = None) -> bool:
        """Delete the session with its messages, and queue the erasure of its KV from the
        engine's tiers (`kv_erasures`): its stored context, its earlier chains, and
        `last_prompt` (the prompt its conversation renders to now: that of a turn whose reply
        was never stored). False (nothing changed) when `owner` has no such session."""
        with self._db.transaction() as db:
            if db.execute("SELECT 1 FROM sessions WHERE session_id = ? AND owner = ?",
                          (session_id, owner)).fetchone() is None:
                return False
            chains = [row[0] for row in db.execute(_SESSION_CHAINS, (session_id, session_id))]
            if last_prompt:
                chains.append(_ids(last_prompt))
            # queued also with no chain: the engine erases what the session's requests saved
            # by its owner tag too (an OpenAI request whose client left stored no context)
            db.execute("INSERT INTO kv_erasures (session_id, owner, chains) VALUES (?, ?, ?)",
                       (session_id, owner, _pack_chains(chains)))
            db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
        self._db.scrub()
        return True

    def erase_if_deleted(self, owner: str, session_id: str,
                         chains: Sequence[Sequence[int]]) -> bool:
        """Queue the erasure of `chains` for `session_id` if it has been deleted (an advisory
        sent for it as the deletion ran: its prefetch may have brought back KV the deletion's
        erasure had removed, and the engine holds its advisory). True if queued."""
        with self._db.locked() as db:  # (a transaction on every advisory: no, a read; a
            # session deleted stays deleted, so the insert after it needs none)
            if db.execute("SELECT 1 FROM sessions WHERE session_id = ?",
                          (session_id,)).fetchone() is not None:
                return False
            db.execute("INSERT INTO kv_erasures (session_id, owner, chains) VALUES (?, ?, ?)",
                       (session_id, owner, _pack_chains([_ids(c) for c in chains])))
        return True

    def pending_erasures(self) -> list[tuple[int, str, str, list[tuple[int, ...]]]]:
        """(erasure id, session id, owner, token chains) of each deleted session whose KV the
        engine has not yet erased, and of each live session's chains past `kv_chains_kept`,
        oldest first."""
        with self._db.locked() as db:
            rows = db.execute("SELECT erasure_id, session_id, owner, chains FROM kv_erasures"
                              " ORDER BY erasure_id").fetchall()
        return [(r[0], r[1], r[2], _unpack_chains(r[3])) for r in rows]

    def finish_erasure(self, erasure_id: int) -> None:
        with self._db.locked() as db:
            rows = db.execute("DELETE FROM kv_erasures WHERE erasure_id = ?"
                              " RETURNING session_id", (erasure_id,)).fetchall()
            deleted = bool(rows) and db.execute(
                "SELECT 1 FROM sessions WHERE session_id = ?", rows[0]).fetchone() is None
        if deleted:  # the row named a deleted session's tokens (a live session's old chains
            self._db.scrub()  # are erased at every regenerate past `kv_chains_kept`: not those)

    def kv_chains(self, session_id: str) -> list[tuple[int, ...]]:
        """The token sequences the session ran that its stored context does not extend."""
        with self._db.locked() as db:
            rows = db.execute("SELECT token_ids FROM kv_chains WHERE session_id = ?",
                              (session_id,)).fetchall()
        return [_unpack_ids(r[0]) for r in rows]

    def messages(self, session_id: str, start: int = 0) -> list[Message]:
        """The session's messages from its `start`-th on (a message's seq is its index)."""
        with self._db.locked() as db:
            rows = db.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_id = ? AND seq >= ?"
                " ORDER BY seq", (session_id, start),
            ).fetchall()
        return [_message(r) for r in rows]

    def append_message(
        self, session_id: str, role: str, content: str, num_tokens: int,
        finish_reason: str | None = None, context_ids: Sequence[int] | None = None,
        replaces_reply: bool = False, tool_calls: Sequence[dict[str, Any]] | None = None,
        window: int | None = None,
    ) -> Message:
        """Append and commit one message (durable on return); bumps the session's updated_at.
        `context_ids`: the conversation's exact tokens through this message (`context`).
        `replaces_reply`: the session's last message, if a reply, is deleted in the same
        transaction (a regenerated reply). `tool_calls`: an assistant's calls of tools.
        `window`: the window moves there first (`move_window`: a regenerated reply that left
        messages out)."""
        now = time.time()
        calls = None if tool_calls is None else tuple(tool_calls)
        with self._db.transaction() as db:
            pruned = window is not None and self._move_window(db, session_id, window)
            if replaces_reply:
                db.execute(
                    "DELETE FROM messages WHERE session_id = ? AND role = 'assistant' AND seq ="
                    " (SELECT MAX(seq) FROM messages WHERE session_id = ?)",
                    (session_id, session_id))
            _insert_message(db, session_id, Message(role, content, num_tokens, now,
                                                    finish_reason, calls))
            db.execute("UPDATE sessions SET updated_at = ? WHERE session_id = ?",
                       (now, session_id))
            if context_ids is not None:
                ids = _ids(context_ids)
                pruned = self._keep_diverged_chain(db, session_id, ids) or pruned
                db.execute(
                    "INSERT OR REPLACE INTO contexts SELECT ?, COUNT(*), ? FROM messages"
                    " WHERE session_id = ?",
                    (session_id, ids, session_id))
        self._erasure_queued(pruned)
        return Message(role, content, num_tokens, now, finish_reason, calls)

    def set_context(self, session_id: str, token_ids: Sequence[int]) -> None:
        """Keep `token_ids` as the session's context with no messages behind it
        (`num_messages` 0): the last exchange of a client that sends the whole conversation
        itself (the OpenAI API), which advisories bring forward. Bumps updated_at."""
        ids = _ids(token_ids)
        with self._db.transaction() as db:
            pruned = self._keep_diverged_chain(db, session_id, ids)
            db.execute("INSERT OR REPLACE INTO contexts SELECT session_id, 0, ? FROM sessions"
                       " WHERE session_id = ?",  # nothing once the session is deleted
                       (ids, session_id))
            db.execute("UPDATE sessions SET updated_at = ? WHERE session_id = ?",
                       (time.time(), session_id))
        self._erasure_queued(pruned)

    def _keep_diverged_chain(self, db: sqlite3.Connection, session_id: str,
                             ids: bytes | None) -> bool:
        """Before the session's stored context is replaced by `ids` (None: dropped), keep it
        as a chain unless `ids` extends it; past `kv_chains_kept` chains, queue the oldest
        for erasure. True when one was queued."""
        db.execute(_KEEP_DIVERGED_CHAIN, {"session": session_id, "ids": ids})
        old = db.execute("SELECT rowid, token_ids FROM kv_chains WHERE session_id = ?"
                         " ORDER BY rowid DESC LIMIT -1 OFFSET ?",
                         (session_id, self.kv_chains_kept)).fetchall()
        if not old:
            return False
        db.execute("INSERT INTO kv_erasures (session_id, owner, chains) SELECT session_id,"
                   " owner, ? FROM sessions WHERE session_id = ?",
                   (_pack_chains([row[1] for row in old]), session_id))
        db.executemany("DELETE FROM kv_chains WHERE rowid = ?", [(row[0],) for row in old])
        return True

    def _erasure_queued(self, queued: bool) -> None:
        if queued and self.on_erasure_queued is not None:
            self.on_erasure_queued()

    def kept_chains(self, session_id: str) -> list[tuple[int, ...]] | None:
        """The token chains whose KV the session may still use (its stored context and its
        kept chains), or None once it is deleted: what an erasure of its older chains spares
        (`pending_erasures`)."""
        with self._db.locked() as db:
            if db.execute("SELECT 1 FROM sessions WHERE session_id = ?",
                          (session_id,)).fetchone() is None:
                return None
            rows = db.execute(_SESSION_CHAINS, (session_id, session_id)).fetchall()
        return [_unpack_ids(row[0]) for row in rows]

    def context(self, session_id: str) -> tuple[int, tuple[int, ...]] | None:
        """(messages covered, token ids) of the session's last stored context, or None."""
        with self._db.locked() as db:
            row = db.execute(
                "SELECT num_messages, token_ids FROM contexts WHERE session_id = ?",
                (session_id,)).fetchone()
        if row is None:
            return None
        return row[0], _unpack_ids(row[1])

    def window_start(self, session_id: str) -> int:
        """The first message the model sees of the session's conversation (`move_window`)."""
        with self._db.locked() as db:
            row = db.execute("SELECT first_message FROM windows WHERE session_id = ?",
                             (session_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def move_window(self, session_id: str, first_message: int) -> None:
        """From now on the model sees the conversation from message `first_message` on; the
        stored context, rendered from the messages before, is dropped with it."""
        with self._db.transaction() as db:
            pruned = self._move_window(db, session_id, first_message)
        self._erasure_queued(pruned)

    def _move_window(self, db: sqlite3.Connection, session_id: str, first_message: int) -> bool:
        """`move_window` in transaction `db`; True when a chain was queued for erasure."""
        db.execute("INSERT OR REPLACE INTO windows SELECT session_id, ? FROM sessions"
                   " WHERE session_id = ?", (first_message, session_id))
        pruned = self._keep_diverged_chain(db, session_id, None)
        db.execute("DELETE FROM contexts WHERE session_id = ?", (session_id,))
        return pruned

    def revision(self, session_id: str) -> tuple[Any, ...] | None:
        """A value that changes whenever what the session's conversation renders to may have:
        a message added (updated_at) or taken back (the count), a context kept (updated_at,
        its length), the window moved. None when the session is gone. One indexed query:
        cheap beside reading the messages."""
        with self._db.locked() as db:
            row = db.execute(
                "SELECT s.updated_at,"
                " (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.session_id),"
                " (SELECT length(token_ids) FROM contexts c WHERE c.session_id = s.session_id),"
                " (SELECT first_message FROM windows w WHERE w.session_id = s.session_id)"
                " FROM sessions s WHERE s.session_id = ?", (session_id,)).fetchone()
        return None if row is None else tuple(row)

    def record_advisory(self, session_id: str, source: str, received_at: float) -> bool:
        """Keep an advisory the session received; a session keeps its last
        `advisories_kept` (a client may send them as often as it likes). False (nothing
        kept) when the session is gone (deleted meanwhile)."""
        with self._db.transaction() as db:
            if not db.execute(
                    "INSERT INTO advisories SELECT session_id, ?, ? FROM sessions"
                    " WHERE session_id = ?", (source, received_at, session_id)).rowcount:
                return False
            db.execute(
                "DELETE FROM advisories WHERE session_id = :s AND rowid NOT IN (SELECT rowid"
                " FROM advisories WHERE session_id = :s ORDER BY received_at DESC, rowid DESC"
                " LIMIT :n)", {"s": session_id, "n": self.advisories_kept})
        return True

    def advisories(self, session_id: str) -> list[tuple[str, float]]:
        """(source, received_at) of each advisory the session received, oldest first."""
        with self._db.locked() as db:
            rows = db.execute(
                "SELECT source, received_at FROM advisories WHERE session_id = ?"
                " ORDER BY received_at",
                (session_id,),
            ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def check_integrity(self) -> None:
        """Raise AssertionError if the database violates its invariants."""
        self._db.check({"messages without a session":
                        "SELECT COUNT(*) FROM messages m LEFT JOIN sessions s USING (session_id)"
                        " WHERE s.session_id IS NULL"})


def _migrate(db: sqlite3.Connection) -> None:
    """What a database from an older server lacks (in the opening transaction)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
    for column in ("tool_calls", "tool_call_id"):  # from before tool calls
        if column not in columns:
            db.execute(f"ALTER TABLE messages ADD COLUMN {column} TEXT")
    if "system" not in {row[1] for row in db.execute("PRAGMA table_info(sessions)")}:
        db.execute("ALTER TABLE sessions ADD COLUMN system TEXT")  # from before system messages
