"""One SQLite database (WAL) shared by threads under a lock, with transactions and checks."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from antiphon.private import private_dir, private_file

logger = logging.getLogger(__name__)


class DatabaseDamaged(RuntimeError):
    """A database file that SQLite finds damaged, or that is no SQLite database at all."""


class DatabaseUnavailable(RuntimeError):
    """A database that cannot be opened now for a reason outside the file's contents (another
    process locks it, the disk is full or fails, the folder cannot be written): the file
    itself may be whole, and is not to be replaced."""


# SQLite's result codes that say the file's contents are wrong; any other error opening a
# database (SQLITE_BUSY, SQLITE_FULL, SQLITE_IOERR, SQLITE_CANTOPEN, ...) is no verdict on them.
_DAMAGED_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


class SqliteDb:
    """A connection in autocommit mode: each statement outside `transaction()` commits (and,
    with synchronous FULL, is durable) before it returns."""

    def __init__(self, path: Path, schema: str, synchronous: str = "FULL",
                 migrate: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """Open (or create) `path`, check it (SQLite's quick_check: 0.15 s for a 270 MB
        file), create `schema`, and run `migrate` (what an older database lacks) in one
        transaction. Raises `DatabaseDamaged` rather than serve from a damaged file, whose
        writes would fail, and whose reads would be wrong, and `DatabaseUnavailable` where
        any of it fails for a reason outside the file (locked, a full or failing disk)."""
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        private_file(private_dir(path.parent, tighten=False) / path.name)
        self._path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA foreign_keys=ON")
            # What is deleted (a session, its messages and context) is overwritten in the
            # file, not left in its free pages.
            self._db.execute("PRAGMA secure_delete=ON")
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise DatabaseDamaged(f"{path} is damaged ({problems[0]}; "
                                      f"{len(problems)} problems)")
            self._db.executescript(schema)
            if migrate is not None:
                with self.transaction() as db:
                    migrate(db)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            # the primary result code (an extended one's low byte: SQLITE_IOERR_READ is IOERR)
            code = getattr(exc, "sqlite_errorcode", None)
            if code is not None and code & 0xFF not in _DAMAGED_CODES:
                raise DatabaseUnavailable(f"cannot open {path} ({exc})") from exc
            raise DatabaseDamaged(f"{path} is damaged ({exc})") from exc
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def locked(self) -> Iterator[sqlite3.Connection]:
        """The connection, for statements that each commit on their own."""
        with self._lock:
            yield self._db

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside BEGIN IMMEDIATE ... COMMIT; any exception, a failed COMMIT's
        too, rolls back. Where SQLite has rolled back itself (a full disk, an I/O error), the
        error is raised as it came: a ROLLBACK then failed with "no transaction is active",
        which hid it. A COMMIT that failed with the transaction still open (a deferred
        constraint, a busy database) left it open, and every later write joined it, to be
        lost."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def scrub(self) -> None:
        """Move the write-ahead log into the database file and empty it (SQLite's
        `wal_checkpoint(TRUNCATE)`): what a deletion overwrote in the file (`secure_delete`)
        lingered in the log's older frames until they happened to be reused. Best effort: a
        reader in another process (`antiphon backup`) keeps the log, and is not waited for
        (all writes would wait with it)."""
        with self._lock:
            (waited,) = self._db.execute("PRAGMA busy_timeout").fetchone()
            self._db.execute("PRAGMA busy_timeout=0")
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except sqlite3.Error as exc:  # (a full disk: what called it has committed)
                logger.warning("%s: the write-ahead log was not emptied (%s)", self._path,
                               exc)
            finally:
                self._db.execute(f"PRAGMA busy_timeout={int(waited)}")

    def check(self, violations: Mapping[str, str]) -> None:
        """Raise AssertionError unless SQLite's own checks pass and each query in
        `violations` (what it finds -> `SELECT COUNT(*) ...`) counts zero rows."""
        with self._lock:
            (status,) = self._db.execute("PRAGMA integrity_check").fetchone()
            assert status == "ok", status
            (dangling,) = self._db.execute(
                "SELECT COUNT(*) FROM pragma_foreign_key_check").fetchone()
            assert dangling == 0, f"{dangling} dangling references"
            for what, sql in violations.items():
                (n,) = self._db.execute(sql).fetchone()
                assert n == 0, f"{n} {what}"
