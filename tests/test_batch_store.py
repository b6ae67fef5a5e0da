"""Batch store, file store and input validation, without a server."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.batch_input import read_items
from antiphon.server.batch_store import BatchStore, InputFileGone
from antiphon.server.batch_types import (
    BatchStatus,
    FileRecord,
    InputItem,
    ItemResult,
    ItemState,
    new_file_id,
)
from antiphon.server.chat import ChatService
from antiphon.server.config import ServerConfig
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.file_store import FileStore
from antiphon.server.metrics import ServerMetrics


def make_batch(store: BatchStore, owner: str = "alice", window_s: float = 3600.0) -> str:
    file_id = new_file_id()
    store.add_file(FileRecord(file_id, owner, "batch", "in.jsonl", 10, 0.0))
    return store.create_batch(owner, file_id, "24h", window_s, {"k": "v"}).batch_id


def items(n: int, failed: tuple[int, ...] = ()) -> list[InputItem]:
    return [InputItem(i, f"c{i}", None, (ErrorCode.BAD_JSON, "bad")) if i in failed
            else InputItem(i, f"c{i}", '{"model": "m"}') for i in range(n)]


def ok(i: int) -> ItemResult:
    return ItemResult(f"r{i}", json.dumps({"answer": i}))


def test_lifecycle_commits_each_item_once_and_survives_reopen(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    bid = make_batch(store)
    assert store.start_batch(bid, items(5, failed=(3,)))
    assert not store.start_batch(bid, items(5))  # no longer validating: nothing written
    assert [p.line_index for p in store.pending_items(bid, 10)] == [0, 1, 2, 4]
    store.record_attempts(bid, [0, 1])
    assert store.commit_item(bid, 0, ok(0))
    assert not store.commit_item(bid, 0, ok(0))  # answered already: the second commit is refused
    assert store.commit_item(bid, 1, ItemResult("r1", None, "context_length_exceeded", "long"))
    store.close()

    store = BatchStore(tmp_path / "b.sqlite3")
    batch = store.get_batch("alice", bid)
    assert batch is not None and batch.status == BatchStatus.IN_PROGRESS
    assert (batch.counts.total, batch.counts.completed, batch.counts.failed) == (5, 1, 2)
    assert store.commit_counts(bid) == {0: (1, 1), 1: (1, 1), 2: (0, 0), 3: (0, 1), 4: (0, 0)}
    for i in (2, 4):
        assert store.commit_item(bid, i, ok(i))
    assert store.begin_finalize(bid)
    assert store.get_batch("alice", bid).status == BatchStatus.FINALIZING  # type: ignore[union-attr]
    out = FileRecord(new_file_id(), "alice", "batch_output", "o.jsonl", 3, 1.0)
    store.finish_batch(store.get_batch("alice", bid), out, None)  # type: ignore[arg-type]
    done = store.get_batch("alice", bid)
    assert done is not None and done.status == BatchStatus.COMPLETED
    assert done.output_file_id == out.file_id and done.error_file_id is None
    assert "completed_at" in done.times and done.to_json()["metadata"] == {"k": "v"}
    assert [r[0] for r in store.results(bid, ItemState.SUCCEEDED, page_size=2)] == [0, 2, 4]
    store.check_integrity()


def test_cancel_races_are_settled_by_status_guards(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    bid = make_batch(store)
    assert store.request_cancel("mallory", bid) is None
    cancelled = store.request_cancel("alice", bid)
    assert cancelled is not None and cancelled.status == BatchStatus.CANCELLING
    assert not store.start_batch(bid, items(3))  # validation lost the race to the cancel
    assert store.get_batch("alice", bid).counts.total == 0  # type: ignore[union-attr]

    other = make_batch(store)
    store.start_batch(other, items(4))
    store.commit_item(other, 0, ok(0))
    assert store.request_cancel("alice", other).status == BatchStatus.CANCELLING  # type: ignore[union-attr]
    assert not store.begin_finalize(other)  # cancelling: completion cannot take over
    store.finish_batch(store.get_batch("alice", other), None, None)  # type: ignore[arg-type]
    batch = store.get_batch("alice", other)
    assert batch is not None and batch.status == BatchStatus.CANCELLED
    assert (batch.counts.total, batch.counts.completed, batch.counts.failed) == (4, 1, 0)
    assert not store.commit_item(other, 1, ok(1))  # skipped items take no late answer
    assert store.request_cancel("alice", other).status == BatchStatus.CANCELLED  # type: ignore[union-attr]
    store.check_integrity()


def test_expiry_fails_unanswered_items(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    bid = make_batch(store)
    store.start_batch(bid, items(4))
    store.commit_item(bid, 0, ok(0))
    assert store.expire_batch(bid) == 3
    assert store.expire_batch(bid) == 0
    failed = list(store.results(bid, ItemState.FAILED))
    assert [r.error_code for _, _, r in failed] == ["batch_expired"] * 3
    store.check_integrity()


def test_owner_isolation_and_listing(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    ids = [make_batch(store) for _ in range(3)]
    make_batch(store, owner="bob")
    assert store.get_batch("bob", ids[0]) is None
    listed = [b.batch_id for b in store.list_batches("alice", 10)]
    assert sorted(listed) == sorted(ids) and len(listed) == 3
    assert [b.batch_id for b in store.list_batches("alice", 10, after=listed[0])] == listed[1:]
    file_id = store.get_batch("alice", ids[0]).input_file_id  # type: ignore[union-attr]
    assert store.get_file("bob", file_id) is None and store.get_file("alice", file_id)


def test_batches_created_at_one_instant_are_each_listed_once_across_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cursor compared created_at alone: a page ending on one of two batches stamped
    # alike skipped the other.
    store = BatchStore(tmp_path / "b.sqlite3")
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    ids = {make_batch(store) for _ in range(4)}
    seen: list[str] = []
    after = None
    while page := store.list_batches("alice", 1, after=after):
        seen += [b.batch_id for b in page]
        after = page[-1].batch_id
    assert sorted(seen) == sorted(ids)


def test_file_store_writes_atomically_and_sweeps(tmp_path: Path) -> None:
    files = FileStore(tmp_path / "files")
    kept, orphan = new_file_id(), new_file_id()
    for file_id in (kept, orphan):
        with files.create(file_id) as w:
            w.write(b"abc\n")
            w.commit()
    with pytest.raises(ApiError) as info, files.create(new_file_id(), max_bytes=5) as w:
        w.write(b"1234")
        w.write(b"56")
    assert info.value.code == ErrorCode.TOO_LARGE
    (tmp_path / "files" / "file-000000000000000000000000.part").write_bytes(b"x")
    assert sorted(files.sweep({kept})) == sorted([f"{orphan}.jsonl",
                                                   "file-000000000000000000000000.part"])
    files.check_integrity({kept: 4})
    with pytest.raises(AssertionError):
        files.check_integrity({orphan: 4})
    with pytest.raises(ValueError):
        files.path("../sessions.sqlite3")


def test_a_file_that_cannot_be_written_leaves_no_part_behind(tmp_path: Path) -> None:
    # On a full disk the commit's flush failed, then the close failed the same way, and the
    # .part was never removed: each retry of a batch's finalisation left another.
    import errno

    files = FileStore(tmp_path / "files")

    class DiskFull:
        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self.real.close()
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"), files.create(new_file_id()) as writer:
        writer.write(b"x" * 100)
        writer._file = DiskFull(writer._file)  # type: ignore[assignment]
        writer.commit()
    assert list(files.directory.iterdir()) == []


def test_input_lines_fail_one_by_one(tmp_path: Path) -> None:
    chat = ChatService(ScriptedEngine(), ServerMetrics(),
                       ServerConfig(max_content_chars=50, max_tokens_limit=100,
                                    default_max_tokens=100, max_frame_bytes=300,
                                    max_batch_items=12, max_custom_id_chars=150))

    def line(custom_id: object = "a", **over: object) -> str:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        record = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                  "body": body, **over}
        return json.dumps(record)

    good = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    lines = [line("a"), "", "{nope", line(None), line("a"), line("b", url="/v1/embeddings"),
             line("c", method="GET"), line("d", body={"model": "scripted", "messages": []}),
             line("e", body={**good, "model": "gpt-9"}), line("f", body={**good, "stream": True}),
             line("g", body={**good, "max_tokens": 1000}),
             line("h", body={"model": "scripted",
                             "messages": [{"role": "user", "content": "x" * 51}]}),
             line("i" * 200), "[1, 2]", line("j")]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = read_items(path, chat)
    codes = {it.line_index: it.error[0].value if it.error else "ok" for it in got}
    assert codes == {0: "ok", 2: "bad_json", 3: "missing_custom_id", 4: "duplicate_custom_id",
                     5: "unsupported_url", 6: "bad_message", 7: "bad_message",
                     8: "model_not_found", 9: "bad_message", 10: "max_tokens_too_large",
                     11: "too_large", 12: "too_large", 13: "too_many_items",
                     14: "too_many_items"}
    by_line = {it.line_index: it for it in got}
    assert by_line[0].body is not None and json.loads(by_line[0].body) == good
    duplicate = by_line[4]
    # Reported under no custom_id: results matched by it keep line 1's answer for "a".
    assert duplicate.custom_id is None and duplicate.body is None and duplicate.error is not None
    assert duplicate.error[1].startswith("line 5: ") and "'a'" in duplicate.error[1]
    path.write_text(line("k" * 151) + "\n" + line("l" * 150) + "\n")
    too_long, longest = read_items(path, chat)
    assert too_long.error is not None and too_long.error[0] == ErrorCode.BAD_MESSAGE
    assert "(--max-custom-id-chars)" in too_long.error[1] and longest.error is None


def test_a_last_line_of_the_limit_ending_in_a_lone_cr_is_read(tmp_path: Path) -> None:
    record = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}}
    text = json.dumps(record)
    chat = ChatService(ScriptedEngine(), ServerMetrics(), ServerConfig(max_frame_bytes=len(text)))
    path = tmp_path / "in.jsonl"
    for ending in (b"\r", b"\r\n", b""):
        path.write_bytes(text.encode() + ending)
        got = read_items(path, chat)
        assert [it.error for it in got] == [None], ending
    path.write_bytes(text.encode() + b"x\r")  # one byte over: too long, whatever its ending
    got = read_items(path, chat)
    assert got[0].error is not None and got[0].error[0] == ErrorCode.TOO_LARGE


def test_a_batch_is_not_created_from_a_file_deleted_meanwhile(tmp_path: Path) -> None:
    """The file is checked in the batch's own transaction, the one `delete_file`'s check for
    unfinished batches waits on: of a delete and a create racing, one fails."""
    store = BatchStore(tmp_path / "b.sqlite3")
    file_id = new_file_id()
    store.add_file(FileRecord(file_id, "alice", "batch", "in.jsonl", 10, 0.0))
    assert store.delete_file("alice", file_id) is None
    with pytest.raises(InputFileGone):
        store.create_batch("alice", file_id, "24h", 60.0, None)
    other = new_file_id()
    store.add_file(FileRecord(other, "bob", "batch", "in.jsonl", 10, 0.0))
    with pytest.raises(InputFileGone):  # not alice's
        store.create_batch("alice", other, "24h", 60.0, None)
    assert store.list_batches("alice", 10) == []
    batch = store.create_batch("bob", other, "24h", 60.0, {})
    assert batch is not None and batch.metadata == {}  # empty metadata stays empty
    assert store.delete_file("bob", other) == "in use"


def test_a_database_from_before_file_deletion_opens_and_deletes(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("CREATE TABLE files (file_id TEXT PRIMARY KEY, owner TEXT NOT NULL,"
                      " purpose TEXT NOT NULL, filename TEXT NOT NULL,"
                      " num_bytes INTEGER NOT NULL, created_at REAL NOT NULL);"
                      "INSERT INTO files VALUES ('file-old', 'alice', 'batch', 'a.jsonl', 3, 0);")
    old.close()
    store = BatchStore(path)
    try:
        assert store.get_file("alice", "file-old") is not None
        batch_id = store.create_batch("alice", "file-old", "24h", 3600.0, None).batch_id
        assert store.delete_file("alice", "file-old") == "in use"
        assert store.request_cancel("alice", batch_id) is not None
        store.finish_batch(store.get_batch("alice", batch_id), None, None)  # type: ignore[arg-type]
        assert store.delete_file("bob", "file-old") == "not found"
        assert store.delete_file("alice", "file-old") is None
        assert store.get_file("alice", "file-old") is None and store.file_sizes() == {}
        assert store.get_batch("alice", batch_id).input_file_id == "file-old"  # type: ignore[union-attr]
        store.check_integrity()
    finally:
        store.close()


def test_a_database_from_before_finished_batches_forgot_their_items_forgets_them(
        tmp_path: Path) -> None:
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    finished, running = make_batch(store), make_batch(store)
    for bid in (finished, running):
        store.start_batch(bid, items(2))
        store.commit_item(bid, 0, ok(0))
    store.request_cancel("alice", finished)
    store.finish_batch(store.get_batch("alice", finished), None, None)  # type: ignore[arg-type]
    store.close()
    old = sqlite3.connect(path)  # as an older server left it
    old.execute("UPDATE items SET body = '{}', response = '{}' WHERE state = 1")
    old.execute("PRAGMA user_version = 0")
    old.commit()
    old.close()
    store = BatchStore(path)
    try:
        with store.db.locked() as db:
            kept = db.execute("SELECT batch_id, line_index FROM items WHERE body IS NOT NULL"
                              " OR response IS NOT NULL").fetchall()
        assert sorted(kept) == [(running, 0), (running, 1)]
        store.check_integrity()
    finally:
        store.close()


def answered_batch(store: BatchStore, n: int) -> str:
    """A batch of `n` items, each answered, finalizing."""
    bid = make_batch(store)
    store.start_batch(bid, items(n))
    for i in range(n):
        store.commit_item(bid, i, ok(i))
    assert store.begin_finalize(bid)
    return bid


def assert_forgotten_at_start(path: Path, bid: str) -> None:
    """The store at `path`, opened again, holds batch `bid` completed and its items with no
    request or answer."""
    store = BatchStore(path)
    try:
        assert store.get_batch("alice", bid).status == BatchStatus.COMPLETED  # type: ignore[union-attr]
        with store.db.locked() as db:
            assert db.execute("SELECT COUNT(*) FROM items WHERE body IS NOT NULL"
                              " OR response IS NOT NULL").fetchone() == (0,)
        store.check_integrity()
    finally:
        store.close()


def test_a_batch_finishes_though_its_items_cannot_be_forgotten_then_and_a_restart_does_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forgotten in the transaction that finished the batch, the items' pages all went into
    # the write-ahead log at once: on a nearly full disk the batch never finished, and other
    # batches' commits waited for it (found by a review). Now a few rows at a time, after.
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    monkeypatch.setattr(BatchStore, "FORGET_ROWS", 2)
    bid = answered_batch(store, 5)

    class FullForForgetting:
        """The connection, on a disk with no room for the forgetting's log."""

        def __init__(self, connection: sqlite3.Connection) -> None:
            self._connection = connection

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql.startswith("UPDATE items SET body = NULL"):
                raise sqlite3.OperationalError("database or disk is full")
            return self._connection.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._connection, name)

    connection = store.db._db
    store.db._db = FullForForgetting(connection)  # type: ignore[assignment]
    try:
        store.finish_batch(store.get_batch("alice", bid), None, None)  # type: ignore[arg-type]
    finally:
        store.db._db = connection
    assert store.get_batch("alice", bid).status == BatchStatus.COMPLETED  # type: ignore[union-attr]
    store.check_integrity()
    store.close()
    assert_forgotten_at_start(path, bid)


def test_a_batch_finished_as_the_server_is_killed_has_its_items_forgotten_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Killed between the finish and the end of its forgetting, its items kept their requests
    # and answers for good (found by a review).
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    bid = answered_batch(store, 3)

    def killed(*args: Any, **kwargs: Any) -> bool:
        raise KeyboardInterrupt  # (as a kill -9 would stop it)

    monkeypatch.setattr(store, "forget_items", killed)
    with pytest.raises(KeyboardInterrupt):
        store.finish_batch(store.get_batch("alice", bid), None, None)  # type: ignore[arg-type]
    store.close()
    assert_forgotten_at_start(path, bid)


def test_batch_counts_are_kept_through_every_change_of_an_item(tmp_path: Path) -> None:
    """The counts a batch reports are kept by triggers, not counted on read: every way an item
    changes (validation failure, commit, expiry, skip on cancel) moves them, and the integrity
    check compares them with the items."""
    store = BatchStore(tmp_path / "b.sqlite3")
    expired, cancelled = make_batch(store), make_batch(store)
    for bid in (expired, cancelled):
        store.start_batch(bid, items(6, failed=(2,)))
        store.commit_item(bid, 0, ok(0))
        store.commit_item(bid, 1, ItemResult("r1", None, "context_length_exceeded", "long"))
    assert store.expire_batch(expired) == 3
    assert store.fail_unrun(cancelled) == 0  # in progress: its items may still run
    store.request_cancel("alice", cancelled)
    assert store.fail_unrun(cancelled) == 3  # never run: failed, for the error file
    assert store.fail_unrun(cancelled) == 0
    store.finish_batch(store.get_batch("alice", cancelled), None, None)  # type: ignore[arg-type]
    counts = {bid: store.get_batch("alice", bid).counts for bid in (expired, cancelled)}  # type: ignore[union-attr]
    assert (counts[expired].total, counts[expired].completed, counts[expired].failed) == (6, 1, 5)
    assert (counts[cancelled].total, counts[cancelled].completed,
            counts[cancelled].failed) == (6, 1, 5)
    codes = {r.error_code for _, _, r in store.results(cancelled, ItemState.FAILED)}
    assert codes == {"bad_json", "context_length_exceeded", "batch_cancelled"}
    store.check_integrity()
    with store.db.locked() as db:
        with pytest.raises(sqlite3.IntegrityError, match="last of their result files"):
            db.execute("DELETE FROM items WHERE batch_id = ?", (expired,))
        db.execute("UPDATE batches SET num_items = num_items + 1 WHERE batch_id = ?",
                   (expired,))
    with pytest.raises(AssertionError, match="kept counts differ"):
        store.check_integrity()


def test_a_database_from_before_text_completion_batches_opens_with_chat_batches(
        tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    store = BatchStore(path)
    bid = make_batch(store)
    store.close()
    old = sqlite3.connect(path)  # as the store was before batches named their endpoint
    old.execute("ALTER TABLE batches DROP COLUMN endpoint")
    old.commit()
    old.close()
    store = BatchStore(path)
    try:
        assert store.get_batch("alice", bid).endpoint == "/v1/chat/completions"  # type: ignore[union-attr]
        new = store.create_batch("alice", store.get_batch("alice", bid).input_file_id,  # type: ignore[union-attr]
                                 "24h", 60.0, None, "/v1/completions")
        assert store.get_batch("alice", new.batch_id).to_json()["endpoint"] == "/v1/completions"  # type: ignore[union-attr]
        store.check_integrity()
    finally:
        store.close()


def test_a_database_from_before_items_went_with_their_results_drops_them(
        tmp_path: Path) -> None:
    """A database whose trigger kept items for good, without the column that marks a batch's
    items gone: opened, the items of a batch whose result files the old server deleted go,
    deleting a finished batch's last result file deletes its items, and a crash before they
    went (the batch left in `forgetting`) is finished on the next open."""
    path = tmp_path / "old.sqlite3"
    store = BatchStore(path)
    finished = []
    for _ in range(2):
        bid = make_batch(store)
        store.start_batch(bid, items(3))
        for i in range(3):
            store.commit_item(bid, i, ok(i))
        assert store.begin_finalize(bid)
        out = FileRecord(new_file_id(), "alice", "batch_output", "o.jsonl", 3, 1.0)
        store.finish_batch(store.get_batch("alice", bid), out, None)  # type: ignore[arg-type]
        finished.append((bid, out))
    store.close()
    old = sqlite3.connect(path)
    old.execute("DROP TRIGGER items_dropped_with_results")
    old.execute("CREATE TRIGGER items_kept BEFORE DELETE ON items BEGIN"
                " SELECT RAISE(ABORT, 'batch items are never deleted'); END")
    old.execute("ALTER TABLE batches DROP COLUMN items_dropped_at")
    old.execute("UPDATE files SET deleted_at = 1.0 WHERE file_id = ?",  # (the old server's)
                (finished[0][1].file_id,))
    old.commit()
    old.close()
    store = BatchStore(path)
    assert list(store.results(finished[0][0], ItemState.SUCCEEDED)) == []
    assert len(list(store.results(bid, ItemState.SUCCEEDED))) == 3  # its file kept: kept
    forget = store.forget_items
    store.forget_items = lambda batch_id, scrub=True: False  # type: ignore[method-assign]
    try:
        assert store.delete_file("alice", out.file_id) is None  # a crash before the items go
    finally:
        store.forget_items = forget  # type: ignore[method-assign]
        store.close()
    store = BatchStore(path)
    try:
        assert list(store.results(bid, ItemState.SUCCEEDED)) == []
        counts = store.get_batch("alice", bid).counts  # type: ignore[union-attr]
        assert (counts.total, counts.completed) == (3, 3)
        store.check_integrity()
    finally:
        store.close()


def test_a_database_from_before_kept_counts_is_counted_once_on_open(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    store = BatchStore(path)
    bid = make_batch(store)
    store.start_batch(bid, items(5, failed=(4,)))
    store.commit_item(bid, 0, ok(0))
    store.close()
    old = sqlite3.connect(path)  # as the store was before it kept counts
    for trigger in ("items_counted", "items_recounted", "items_dropped_with_results"):
        old.execute(f"DROP TRIGGER {trigger}")
    for column in ("num_items", "num_succeeded", "num_failed"):
        old.execute(f"ALTER TABLE batches DROP COLUMN {column}")
    old.execute("UPDATE items SET state = 1, response = '{}', request_id = 'r1',"
                " num_commits = 1 WHERE line_index = 1")  # answered by the old code
    old.commit()
    old.close()
    store = BatchStore(path)
    try:
        counts = store.get_batch("alice", bid).counts  # type: ignore[union-attr]
        assert (counts.total, counts.completed, counts.failed) == (5, 2, 1)
        assert store.commit_item(bid, 2, ok(2))
        assert store.get_batch("alice", bid).counts.completed == 3  # type: ignore[union-attr]
        store.check_integrity()
    finally:
        store.close()


def test_a_database_from_before_refusals_kept_their_status_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    store = BatchStore(path)
    bid = make_batch(store)
    store.start_batch(bid, items(2))
    store.commit_item(bid, 0, ItemResult(None, None, "context_length_exceeded", "long"))
    store.close()
    old = sqlite3.connect(path)  # as the store was before it kept a refusal's status
    old.execute("ALTER TABLE items DROP COLUMN status_code")
    old.commit()
    old.close()
    store = BatchStore(path)
    try:
        refused = ItemResult(None, None, "bad_message", "no", status_code=400)
        assert store.commit_item(bid, 1, refused)
        (_, _, before), (_, _, after) = store.results(bid, ItemState.FAILED)
        assert before.status_code is None and after == refused
        assert json.loads(after.to_line(bid, 1, "c"))["response"]["status_code"] == 400
        assert json.loads(before.to_line(bid, 0, "b"))["error"]["code"] == (
            "context_length_exceeded")
    finally:
        store.close()
