"""Batch jobs, their items and file records, persisted in SQLite (WAL) in the data directory.

Every write commits before it returns (synchronous FULL survives power loss), and each status
change is guarded by the status it expects, so racing writers (a cancel and the runner) never
both win. An item's result is committed exactly once, keyed by (batch_id, line_index): the
commit only applies to a PENDING item, and `num_commits` counts it so `check_integrity` can
prove it. Files and batches belong to one owner; a read by another owner finds nothing.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from antiphon.server.batch_types import (
    CHAT_ENDPOINT,
    Batch,
    BatchStatus,
    FileRecord,
    InputItem,
    ItemResult,
    ItemState,
    PendingItem,
    RequestCounts,
    new_batch_id,
)
from antiphon.server.errors import ErrorCode
from antiphon.sqlite import SqliteDb

logger = logging.getLogger(__name__)

_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at")
_FINISHED = str(tuple(s.value for s in BatchStatus if s.is_finished))  # an SQL list literal
# A batch's item counts (`RequestCounts`), kept by triggers on `items` so that reading them
# does not count a batch's items (3 ms per read with 50,000 items: the runner reads every
# unfinished batch's counts each time an item finishes).
_COUNT_COLUMNS = ("num_items", "num_succeeded", "num_failed")
_COUNT_COLUMNS_SQL = ", ".join(f"{c} INTEGER NOT NULL DEFAULT 0" for c in _COUNT_COLUMNS)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL,
    filename TEXT NOT NULL, num_bytes INTEGER NOT NULL, created_at REAL NOT NULL,
    deleted_at REAL  -- set by DELETE /v1/files: the row stays for the batches naming it
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, owner TEXT NOT NULL,
    input_file_id TEXT NOT NULL REFERENCES files(file_id),
    completion_window TEXT NOT NULL, metadata TEXT,
    status TEXT NOT NULL, final_status TEXT,  -- BatchStatus; final: where finalizing ends
    output_file_id TEXT REFERENCES files(file_id), error_file_id TEXT REFERENCES files(file_id),
    errors TEXT,  -- why the batch failed as a whole, JSON
    created_at REAL NOT NULL, expires_at REAL NOT NULL,
    endpoint TEXT NOT NULL DEFAULT '{CHAT_ENDPOINT}',  -- every line's url
    items_dropped_at REAL,  -- its result files were all deleted, and its items with them
    {", ".join(f"{s} REAL" for s in _STAMPS)},
    {_COUNT_COLUMNS_SQL}
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches(owner, created_at);
CREATE INDEX IF NOT EXISTS files_owner ON files(owner, created_at);
-- The runner's work list: finished batches, however many, are never read for it.
CREATE INDEX IF NOT EXISTS batches_unfinished ON batches(created_at)
    WHERE status NOT IN {_FINISHED};
CREATE TABLE IF NOT EXISTS items (
    batch_id   TEXT NOT NULL REFERENCES batches(batch_id),
    line_index INTEGER NOT NULL,  -- 0-based line of the input file
    custom_id  TEXT,
    body       TEXT,              -- the request; NULL when the line failed validation,
                                  -- and once the batch finished (as `response`)
    state      INTEGER NOT NULL,  -- ItemState
    request_id TEXT, response TEXT, error_code TEXT, error_message TEXT,  -- the result
    num_attempts INTEGER NOT NULL DEFAULT 0,  -- times started
    num_commits  INTEGER NOT NULL DEFAULT 0,  -- times a result was committed: 0 or 1
    status_code  INTEGER,  -- the HTTP status of a request the endpoint refused
    PRIMARY KEY (batch_id, line_index)
);
CREATE UNIQUE INDEX IF NOT EXISTS items_custom_id ON items(batch_id, custom_id)
    WHERE body IS NOT NULL;
CREATE INDEX IF NOT EXISTS items_state ON items(batch_id, state, line_index);
-- Finished batches whose items still hold requests or answers (`BatchStore.forget_items`):
-- queued in the transaction that finishes the batch, gone once forgotten; a start forgets
-- what a crash left here.
CREATE TABLE IF NOT EXISTS forgetting (batch_id TEXT PRIMARY KEY REFERENCES batches(batch_id));
"""
_BATCH_COLUMNS = ("batch_id, owner, input_file_id, completion_window, metadata, status, "
                  "final_status, output_file_id, error_file_id, errors, created_at, expires_at, "
                  + ", ".join(_STAMPS))
_SELECT_BATCH = f"SELECT {_BATCH_COLUMNS}, {', '.join(_COUNT_COLUMNS)}, endpoint FROM batches b"
_SUCCEEDED, _FAILED = int(ItemState.SUCCEEDED), int(ItemState.FAILED)
# The counts of each batch from its items, as the triggers keep them.
_COUNTED = (f"(SELECT COUNT(*) FROM items i WHERE i.batch_id = b.batch_id),"
            f" (SELECT COUNT(*) FROM items i WHERE i.batch_id = b.batch_id"
            f" AND i.state = {_SUCCEEDED}),"
            f" (SELECT COUNT(*) FROM items i WHERE i.batch_id = b.batch_id"
            f" AND i.state = {_FAILED})")
_COUNT_TRIGGERS = (
    f"""CREATE TRIGGER IF NOT EXISTS items_counted AFTER INSERT ON items BEGIN
        UPDATE batches SET num_items = num_items + 1,
            num_succeeded = num_succeeded + (NEW.state = {_SUCCEEDED}),
            num_failed = num_failed + (NEW.state = {_FAILED})
        WHERE batch_id = NEW.batch_id;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS items_recounted AFTER UPDATE OF state ON items
    WHEN OLD.state != NEW.state BEGIN
        UPDATE batches SET
            num_succeeded = num_succeeded
                + (NEW.state = {_SUCCEEDED}) - (OLD.state = {_SUCCEEDED}),
            num_failed = num_failed + (NEW.state = {_FAILED}) - (OLD.state = {_FAILED})
        WHERE batch_id = NEW.batch_id;
    END""",
    """CREATE TRIGGER IF NOT EXISTS items_dropped_with_results BEFORE DELETE ON items
    WHEN (SELECT items_dropped_at FROM batches WHERE batch_id = OLD.batch_id) IS NULL BEGIN
        SELECT RAISE(ABORT, 'batch items go only with the last of their result files');
    END""",
)
_FILE_COLUMNS = "file_id, owner, purpose, filename, num_bytes, created_at"  # FileRecord's


def _batch(row: Sequence[Any]) -> Batch:
    (batch_id, owner, input_file_id, window, metadata, status, final_status, output_file_id,
     error_file_id, errors, created_at, expires_at) = row[:12]
    stamps = dict(zip(_STAMPS, row[12:12 + len(_STAMPS)], strict=True))
    times = {"created_at": created_at, "expires_at": expires_at,
             **{k: v for k, v in stamps.items() if v is not None}}
    return Batch(batch_id, owner, input_file_id, window,
                 None if metadata is None else json.loads(metadata), BatchStatus(status),
                 BatchStatus(final_status) if final_status else None, times, output_file_id,
                 error_file_id, json.loads(errors) if errors else None,
                 RequestCounts(*row[12 + len(_STAMPS):-1]), row[-1])


class InputFileGone(Exception):
    """A batch's input file is not (or no longer) one of its owner's files."""


class BatchStore:
    """Thread-safe: one connection under a lock (SQLite serialises writers anyway)."""

    def __init__(self, path: Path, synchronous: str = "FULL") -> None:
        self.db = SqliteDb(path, _SCHEMA, synchronous, migrate=_migrate)
        with self.db.locked() as db:  # what a crash, or a full disk, left to forget
            unforgotten = [row[0] for row in db.execute("SELECT batch_id FROM forgetting")]
        if unforgotten:
            for batch_id in unforgotten:
                self.forget_items(batch_id, scrub=False)
            self.db.scrub()

    # A finished batch's items forgotten this many at a time, each batch its own transaction:
    # in one, the write-ahead log grew by every page of its items (a batch on a nearly full
    # disk did not finish) and other batches' commits waited for all of it.
    FORGET_ROWS = 1000

    def forget_items(self, batch_id: str, *, scrub: bool = True) -> bool:
        """A finished batch's items keep no request and no answer (its result files hold the
        answers; each item keeps its state and error): a key that deleted the files had every
        prompt and reply kept in the database for good, outside its quota of stored bytes.
        Once its result files are all deleted (`delete_file`), the items go altogether: their
        custom ids and errors, kept, grew the database by every batch a key ran and cleared
        away. Best effort (a full disk, a crash: the batch stays in `forgetting`, and the next
        start does it), a `FORGET_ROWS` at a time, then (`scrub`) the log emptied."""
        try:
            while True:
                with self.db.transaction() as db:
                    (dropped,) = db.execute("SELECT items_dropped_at IS NOT NULL FROM batches"
                                            " WHERE batch_id = ?", (batch_id,)).fetchone()
                    forget = ("DELETE FROM items" if dropped
                              else "UPDATE items SET body = NULL, response = NULL")
                    forgotten = db.execute(
                        f"{forget} WHERE rowid IN (SELECT rowid FROM items WHERE batch_id = ?"
                        f"{'' if dropped else ' AND (body IS NOT NULL OR response IS NOT NULL)'}"
                        " LIMIT ?)", (batch_id, self.FORGET_ROWS)).rowcount
                    if forgotten < self.FORGET_ROWS:
                        db.execute("DELETE FROM forgetting WHERE batch_id = ?", (batch_id,))
                if forgotten < self.FORGET_ROWS:
                    break
        except sqlite3.Error as exc:
            logger.warning("batch %s: its items' requests and answers were not forgotten "
                           "(%s); the next start forgets them", batch_id, exc)
            return False
        if scrub:
            try:  # (after `finish_batch` committed: a raise here took its result files)
                self.db.scrub()
            except sqlite3.Error as exc:
                logger.warning("batch %s: the write-ahead log was not emptied (%s)", batch_id,
                               exc)
        return True

    def close(self) -> None:
        self.db.close()

    # Files.

    def add_file(self, f: FileRecord) -> None:
        with self.db.locked() as db:
            _insert_file(db, f)

    def stored(self, owner: str) -> tuple[int, int]:
        """(bytes, number) of `owner`'s files not deleted (inputs and results)."""
        with self.db.locked() as db:
            num_bytes, num_files = db.execute(
                "SELECT COALESCE(SUM(num_bytes), 0), COUNT(*) FROM files WHERE owner = ?"
                " AND deleted_at IS NULL", (owner,)).fetchone()
        return int(num_bytes), int(num_files)

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        with self.db.locked() as db:
            row = db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE file_id = ? AND"
                             " owner = ? AND deleted_at IS NULL", (file_id, owner)).fetchone()
        return FileRecord(*row) if row else None

    def list_files(self, owner: str, limit: int, after: str | None = None,
                   purpose: str | None = None, newest_first: bool = True) -> list[FileRecord]:
        """The owner's files (of `purpose`, when given), newest or oldest first, starting
        after the file `after` in that order."""
        op, order = ("<", "DESC") if newest_first else (">", "ASC")
        with self.db.locked() as db:
            rows = db.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE owner = :owner AND deleted_at IS NULL"
                " AND (:purpose IS NULL OR purpose = :purpose) AND (:after IS NULL OR"
                f" (created_at, file_id) {op} (SELECT created_at, file_id FROM files"
                "  WHERE file_id = :after AND owner = :owner))"
                f" ORDER BY created_at {order}, file_id {order} LIMIT :limit",
                {"owner": owner, "purpose": purpose, "after": after, "limit": limit}).fetchall()
        return [FileRecord(*row) for row in rows]

    def delete_file(self, owner: str, file_id: str) -> str | None:
        """Mark one of `owner`'s files deleted (the caller then removes it from disk; a crash
        before that leaves it to `FileStore.sweep`). Returns None when deleted, else why not:
        "not found", or "in use" while an unfinished batch reads it. The last of a finished
        batch's result files takes the batch's items with it (`forget_items`); the batch
        keeps its counts."""
        with self.db.transaction() as db:
            if db.execute("SELECT 1 FROM files WHERE file_id = ? AND owner = ? AND"
                          " deleted_at IS NULL", (file_id, owner)).fetchone() is None:
                return "not found"
            if db.execute("SELECT 1 FROM batches WHERE input_file_id = ? AND status NOT IN"
                          f" {_FINISHED}", (file_id,)).fetchone() is not None:
                return "in use"
            db.execute("UPDATE files SET deleted_at = ? WHERE file_id = ?",
                       (time.time(), file_id))
            row = db.execute(
                "SELECT batch_id FROM batches b WHERE ? IN (output_file_id, error_file_id) AND"
                f" status IN {_FINISHED} AND NOT EXISTS (SELECT 1 FROM files f WHERE"
                " f.file_id IN (b.output_file_id, b.error_file_id) AND f.deleted_at IS NULL)",
                (file_id,)).fetchone()
            if row is not None:
                db.execute("UPDATE batches SET items_dropped_at = ? WHERE batch_id = ?",
                           (time.time(), row[0]))
                db.execute("INSERT OR IGNORE INTO forgetting VALUES (?)", row)
        if row is not None:
            self.forget_items(row[0])
        return None

    def file_sizes(self) -> dict[str, int]:
        """Bytes of every registered file, by id."""
        with self.db.locked() as db:
            return dict(db.execute("SELECT file_id, num_bytes FROM files"
                                   " WHERE deleted_at IS NULL").fetchall())

    # Batches.

    def create_batch(self, owner: str, input_file_id: str, completion_window: str,
                     window_s: float, metadata: dict[str, str] | None,
                     endpoint: str = CHAT_ENDPOINT,
                     max_unfinished: int | None = None) -> Batch | None:
        """A new batch of requests to `endpoint`, in VALIDATING, expiring `window_s` seconds
        from now; None, nothing created, when `owner` has `max_unfinished` batches not
        finished already (counted in the same transaction). Raises `InputFileGone`, nothing
        created, when `input_file_id` is not one of `owner`'s files (deleted meanwhile:
        checked in the transaction that `delete_file`'s check of unfinished batches waits
        on, so one of the two calls fails)."""
        batch_id, now = new_batch_id(), time.time()
        with self.db.transaction() as db:
            if db.execute("SELECT 1 FROM files WHERE file_id = ? AND owner = ? AND"
                          " deleted_at IS NULL", (input_file_id, owner)).fetchone() is None:
                raise InputFileGone(input_file_id)
            if max_unfinished is not None and db.execute(
                    f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status NOT IN {_FINISHED}",
                    (owner,)).fetchone()[0] >= max_unfinished:
                return None
            db.execute(
                "INSERT INTO batches (batch_id, owner, input_file_id, completion_window,"
                " metadata, status, created_at, expires_at, endpoint)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, owner, input_file_id, completion_window,
                 None if metadata is None else json.dumps(metadata),
                 BatchStatus.VALIDATING.value, now,
                 now + window_s, endpoint))
        batch = self.get_batch(owner, batch_id)
        assert batch is not None
        return batch

    def get_batch(self, owner: str, batch_id: str) -> Batch | None:
        with self.db.locked() as db:
            row = db.execute(f"{_SELECT_BATCH} WHERE batch_id = ? AND owner = ?",
                             (batch_id, owner)).fetchone()
        return _batch(row) if row else None

    def list_batches(self, owner: str, limit: int, after: str | None = None) -> list[Batch]:
        """The owner's batches, newest first, starting after the batch `after` (batches created
        at the same instant in batch_id order, so that none falls between two pages)."""
        with self.db.locked() as db:
            rows = db.execute(
                f"{_SELECT_BATCH} WHERE owner = ? AND (? IS NULL OR (created_at, batch_id) <"
                " (SELECT created_at, batch_id FROM batches WHERE batch_id = ? AND owner = ?))"
                " ORDER BY created_at DESC, batch_id DESC LIMIT ?",
                (owner, after, after, owner, limit)).fetchall()
        return [_batch(r) for r in rows]

    def unfinished_batches(self) -> list[Batch]:
        """Every batch not in a final status, oldest first: the runner's work list."""
        with self.db.locked() as db:
            rows = db.execute(f"{_SELECT_BATCH} WHERE status NOT IN {_FINISHED}"
                              " ORDER BY created_at").fetchall()
        return [_batch(r) for r in rows]

    def request_cancel(self, owner: str, batch_id: str) -> Batch | None:
        """Move a validating or in-progress batch to CANCELLING; other statuses are unchanged.
        Returns the batch as it is now, or None if the owner has no such batch."""
        with self.db.locked() as db:
            db.execute(
                "UPDATE batches SET status = ?, final_status = ?, cancelling_at = ?"
                " WHERE batch_id = ? AND owner = ? AND status IN (?, ?)",
                (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value, time.time(), batch_id,
                 owner, BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value))
        return self.get_batch(owner, batch_id)

    def start_batch(self, batch_id: str, items: Sequence[InputItem]) -> bool:
        """VALIDATING -> IN_PROGRESS with the validated `items`, in one transaction. False (and
        nothing written) when the batch left VALIDATING meanwhile (cancelled)."""
        rows = [(batch_id, it.line_index, it.custom_id, it.body,
                 ItemState.FAILED if it.error else ItemState.PENDING,
                 it.error[0].value if it.error else None, it.error[1] if it.error else None,
                 1 if it.error else 0) for it in items]
        with self.db.transaction() as db:
            if not _move(db, batch_id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS):
                return False
            db.executemany(
                "INSERT INTO items (batch_id, line_index, custom_id, body, state, error_code,"
                " error_message, num_commits) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        return True

    def fail_batch(self, batch_id: str, code: ErrorCode, message: str) -> None:
        """VALIDATING -> FAILED: the input as a whole is unusable (missing, empty)."""
        errors = json.dumps([{"code": code.value, "message": message, "line": None,
                              "param": "input_file_id"}])
        with self.db.transaction() as db:
            if _move(db, batch_id, (BatchStatus.VALIDATING,), BatchStatus.FAILED):
                db.execute("UPDATE batches SET errors = ? WHERE batch_id = ?",
                                 (errors, batch_id))

    def begin_finalize(self, batch_id: str) -> bool:
        """IN_PROGRESS -> FINALIZING towards COMPLETED: every item is answered."""
        with self.db.transaction() as db:
            return _move(db, batch_id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING,
                         BatchStatus.COMPLETED)

    def expire_batch(self, batch_id: str) -> int:
        """IN_PROGRESS -> FINALIZING towards EXPIRED, failing every unanswered item with
        `batch_expired` in the same transaction (towards COMPLETED where none is left: the
        last was answered after the caller looked). Returns the number of items failed."""
        with self.db.transaction() as db:
            # (every item answered meanwhile, the last as the window ended: it completed)
            row = db.execute("SELECT num_items - num_succeeded - num_failed FROM batches"
                             " WHERE batch_id = ?", (batch_id,)).fetchone()
            final = BatchStatus.EXPIRED if row is None or row[0] else BatchStatus.COMPLETED
            if not _move(db, batch_id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING,
                         final):
                return 0
            return _fail_pending(db, batch_id, ErrorCode.BATCH_EXPIRED,
                                 "the batch expired before this request ran")

    def fail_unrun(self, batch_id: str) -> int:
        """A CANCELLING batch's unanswered items (never run, or stopped by the cancel) fail
        with `batch_cancelled`, so its error file lists them, as OpenAI's does. Call once
        nothing of the batch runs. Returns the number of items failed (0 for a batch in
        another status)."""
        with self.db.transaction() as db:
            row = db.execute("SELECT status FROM batches WHERE batch_id = ?",
                             (batch_id,)).fetchone()
            if row is None or row[0] != BatchStatus.CANCELLING.value:
                return 0
            return _fail_pending(db, batch_id, ErrorCode.BATCH_CANCELLED,
                                 "the batch was cancelled before this request was answered")

    def finish_batch(self, batch: Batch, output: FileRecord | None,
                     error: FileRecord | None) -> None:
        """FINALIZING or CANCELLING -> its final status, registering the result files (written
        already) and marking items still pending SKIPPED (none where the runner failed a
        cancelled batch's unrun items first: `fail_unrun`), in one transaction."""
        assert batch.final_status is not None
        with self.db.transaction() as db:
            for f in (output, error):
                if f is not None:
                    _insert_file(db, f)
            db.execute("UPDATE items SET state = ? WHERE batch_id = ? AND state = ?",
                       (ItemState.SKIPPED, batch.batch_id, ItemState.PENDING))
            db.execute(
                "UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE batch_id = ?",
                (output.file_id if output else None, error.file_id if error else None,
                 batch.batch_id))
            is_moved = _move(db, batch.batch_id,
                             (BatchStatus.FINALIZING, BatchStatus.CANCELLING), batch.final_status)
            assert is_moved, f"{batch.batch_id} left {batch.status} while finalizing"
            db.execute("INSERT OR IGNORE INTO forgetting VALUES (?)", (batch.batch_id,))
        self.forget_items(batch.batch_id)

    # Items.

    def pending_items(self, batch_id: str, limit: int) -> list[PendingItem]:
        """Up to `limit` unanswered items, in line order."""
        with self.db.locked() as db:
            rows = db.execute(
                "SELECT line_index, custom_id, body, num_attempts FROM items"
                " WHERE batch_id = ? AND state = ? ORDER BY line_index LIMIT ?",
                (batch_id, ItemState.PENDING, limit)).fetchall()
        return [PendingItem(*r) for r in rows]

    def record_attempts(self, batch_id: str, line_indexes: Sequence[int],
                        delta: int = 1) -> None:
        """Count one more start of each item (before it is sent to the engine); `delta` -1
        takes a start back (it was stopped on purpose, not cut short by a failure)."""
        with self.db.transaction() as db:
            db.executemany(
                "UPDATE items SET num_attempts = MAX(0, num_attempts + ?)"
                " WHERE batch_id = ? AND line_index = ?",
                [(delta, batch_id, i) for i in line_indexes])

    def commit_item(self, batch_id: str, line_index: int, result: ItemResult) -> bool:
        """Commit an item's result, durable on return. False (nothing written) when the item
        is no longer pending: it was answered, expired or skipped already."""
        with self.db.locked() as db:
            cur = db.execute(
                "UPDATE items SET state = ?, request_id = ?, response = ?, error_code = ?,"
                " error_message = ?, status_code = ?, num_commits = num_commits + 1"
                " WHERE batch_id = ? AND line_index = ? AND state = ?",
                (result.state, result.request_id, result.response, result.error_code,
                 result.error_message, result.status_code, batch_id, line_index,
                 ItemState.PENDING))
        return cur.rowcount == 1

    def results(self, batch_id: str, state: ItemState,
                page_size: int = 1000) -> Iterator[tuple[int, str | None, ItemResult]]:
        """(line_index, custom_id, result) of the batch's items in `state`, in line order,
        read a page at a time so the lock is never held for long."""
        last = -1
        while True:
            with self.db.locked() as db:
                rows = db.execute(
                    "SELECT line_index, custom_id, request_id, response, error_code,"
                    " error_message, status_code FROM items WHERE batch_id = ? AND state = ?"
                    " AND line_index > ? ORDER BY line_index LIMIT ?",
                    (batch_id, state, last, page_size)).fetchall()
            for line_index, custom_id, *result in rows:
                yield line_index, custom_id, ItemResult(*result)
            if len(rows) < page_size:
                return
            last = rows[-1][0]

    def commit_counts(self, batch_id: str) -> dict[int, tuple[int, int]]:
        """line_index -> (num_attempts, num_commits) of every item of the batch."""
        with self.db.locked() as db:
            rows = db.execute("SELECT line_index, num_attempts, num_commits FROM items"
                              " WHERE batch_id = ?", (batch_id,)).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def check_integrity(self) -> None:
        """Raise AssertionError if the database violates its invariants."""
        self.db.check({
            "items committed other than once": "SELECT COUNT(*) FROM items WHERE"
            " num_commits != (CASE WHEN state IN (1, 2) THEN 1 ELSE 0 END)",
            "successes without a response": "SELECT COUNT(*) FROM items i JOIN batches b"
            f" USING (batch_id) WHERE i.state = 1 AND (request_id IS NULL OR error_code IS"
            f" NOT NULL OR (response IS NULL AND b.status NOT IN {_FINISHED}))",
            "requests or answers kept past their batch's end": "SELECT COUNT(*) FROM items i"
            f" JOIN batches b USING (batch_id) WHERE b.status IN {_FINISHED}"
            " AND (i.body IS NOT NULL OR i.response IS NOT NULL)"
            " AND batch_id NOT IN (SELECT batch_id FROM forgetting)",
            "failures without an error": "SELECT COUNT(*) FROM items WHERE state = 2"
            " AND (error_code IS NULL OR response IS NOT NULL)",
            "pending items of finished batches": "SELECT COUNT(*) FROM items i JOIN batches b"
            f" USING (batch_id) WHERE i.state = 0 AND b.status IN {_FINISHED}",
            "result files of another owner": "SELECT COUNT(*) FROM batches b JOIN files f"
            " ON f.file_id IN (b.output_file_id, b.error_file_id) WHERE f.owner != b.owner",
            "finalizing batches without a final status": "SELECT COUNT(*) FROM batches WHERE"
            " status IN ('finalizing', 'cancelling') AND final_status IS NULL",
            "batches whose kept counts differ from their items": "SELECT COUNT(*) FROM batches b"
            f" WHERE ({', '.join(_COUNT_COLUMNS)}) != ({_COUNTED}) AND items_dropped_at IS NULL",
            "items kept past their batch's result files": "SELECT COUNT(*) FROM items i JOIN"
            " batches b USING (batch_id) WHERE b.items_dropped_at IS NOT NULL"
            " AND batch_id NOT IN (SELECT batch_id FROM forgetting)",
        })


def _insert_file(db: sqlite3.Connection, f: FileRecord) -> None:
    db.execute(f"INSERT INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
               (f.file_id, f.owner, f.purpose, f.filename, f.num_bytes, f.created_at))


def _move(db: sqlite3.Connection, batch_id: str, expected: Sequence[BatchStatus],
          new: BatchStatus, final_status: BatchStatus | None = None) -> bool:
    """Set the status (and its `<status>_at` stamp) if it is one of `expected`."""
    stamp = f", {new.value}_at = ?" if f"{new.value}_at" in _STAMPS else ""
    args: list[Any] = [new.value, final_status and final_status.value]
    args += [time.time()] if stamp else []
    cur = db.execute(
        f"UPDATE batches SET status = ?, final_status = COALESCE(?, final_status){stamp}"
        f" WHERE batch_id = ? AND status IN ({','.join('?' * len(expected))})",
        [*args, batch_id, *(s.value for s in expected)])
    return cur.rowcount == 1


def _migrate(db: sqlite3.Connection) -> None:
    """What a database from an older server lacks (in the opening transaction)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(files)")}
    if "deleted_at" not in columns:  # a database from before files could be deleted
        db.execute("ALTER TABLE files ADD COLUMN deleted_at REAL")
    columns = {row[1] for row in db.execute("PRAGMA table_info(batches)")}
    if "endpoint" not in columns:  # from before text completions: chat's, all of them
        db.execute(f"ALTER TABLE batches ADD COLUMN endpoint TEXT NOT NULL"
                   f" DEFAULT '{CHAT_ENDPOINT}'")
    if _COUNT_COLUMNS[0] not in columns:  # from before the counts were kept: count once
        for column in _COUNT_COLUMNS:
            db.execute(f"ALTER TABLE batches ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
        db.execute(f"UPDATE batches AS b SET ({', '.join(_COUNT_COLUMNS)}) = ({_COUNTED})")
    if "items_dropped_at" not in columns:  # from before items went with their results:
        # those of batches whose result files are all deleted go now (`forgetting`)
        db.execute("ALTER TABLE batches ADD COLUMN items_dropped_at REAL")
        db.execute(
            "UPDATE batches AS b SET items_dropped_at = ? WHERE status IN"
            f" {_FINISHED} AND COALESCE(output_file_id, error_file_id) IS NOT NULL AND NOT"
            " EXISTS (SELECT 1 FROM files f WHERE f.file_id IN (b.output_file_id,"
            " b.error_file_id) AND f.deleted_at IS NULL)", (time.time(),))
        db.execute("INSERT OR IGNORE INTO forgetting SELECT batch_id FROM batches"
                   " WHERE items_dropped_at IS NOT NULL")
    columns = {row[1] for row in db.execute("PRAGMA table_info(items)")}
    if "status_code" not in columns:  # from before refusals kept their status
        db.execute("ALTER TABLE items ADD COLUMN status_code INTEGER")
    db.execute("DROP TRIGGER IF EXISTS items_kept")  # (items were never deleted)
    for trigger in _COUNT_TRIGGERS:
        db.execute(trigger)
    (version,) = db.execute("PRAGMA user_version").fetchone()
    if version < 1:  # from before finished batches forgot their items' requests and answers
        db.execute(f"INSERT OR IGNORE INTO forgetting SELECT batch_id FROM batches"
                   f" WHERE status IN {_FINISHED}")
        db.execute("PRAGMA user_version = 1")


def _fail_pending(db: sqlite3.Connection, batch_id: str, code: ErrorCode, message: str) -> int:
    """Fail every pending item of `batch_id` with `code`; the number failed."""
    return db.execute(
        "UPDATE items SET state = ?, error_code = ?, error_message = ?,"
        " num_commits = num_commits + 1 WHERE batch_id = ? AND state = ?",
        (ItemState.FAILED, code.value, message, batch_id, ItemState.PENDING)).rowcount
