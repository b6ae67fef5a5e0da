from pathlib import Path

import pytest

from antiphon.sessions.store import SessionStore
from antiphon.sqlite import DatabaseDamaged


def test_sessions_persist_across_reopen(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    store = SessionStore(db)
    s = store.create_session("alice", "first")
    store.append_message(s.session_id, "user", "hello", 2)
    store.append_message(s.session_id, "assistant", "hi!", 3, "stop")
    store.close()

    reopened = SessionStore(db)
    assert [m.content for m in reopened.messages(s.session_id)] == ["hello", "hi!"]
    got = reopened.get_session("alice", s.session_id)
    assert got is not None and got.num_messages == 2 and got.title == "first"
    reopened.check_integrity()


def test_a_database_of_an_older_server_gains_what_it_lacks(tmp_path: Path) -> None:
    """A data folder from before tool calls and system messages opens with its sessions and
    messages as they were (no system message, no calls) and takes the new ones."""
    import sqlite3

    path = tmp_path / "s.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL,
            title TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(session_id)
            ON DELETE CASCADE, seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
            num_tokens INTEGER NOT NULL, finish_reason TEXT, created_at REAL NOT NULL,
            PRIMARY KEY (session_id, seq));
        INSERT INTO sessions VALUES ('s_old', 'alice', 'kept', 1.0, 2.0);
        INSERT INTO messages VALUES ('s_old', 0, 'user', 'hello', 1, NULL, 1.5);
        """)
    old.commit()
    old.close()
    store = SessionStore(path)
    kept = store.get_session("alice", "s_old")
    assert kept is not None and (kept.title, kept.num_messages, kept.system) == ("kept", 1, None)
    assert [(m.role, m.content, m.tool_calls) for m in store.messages("s_old")] == [
        ("user", "hello", None)]
    new = store.create_session("alice", system="Be terse.")
    assert new is not None
    assert store.get_session("alice", new.session_id).system == "Be terse."  # type: ignore[union-attr]
    store.append_message("s_old", "assistant", "hi", 1, "stop", tool_calls=[{"id": "c"}])
    assert store.messages("s_old")[-1].tool_calls == ({"id": "c"},)
    store.check_integrity()


def test_owner_isolation(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    s = store.create_session("alice")
    assert store.get_session("mallory", s.session_id) is None
    assert store.list_sessions("mallory") == []
    assert not store.delete_session("mallory", s.session_id)
    assert not store.rename_session("mallory", s.session_id, "mine")
    assert store.get_session("alice", s.session_id) is not None


def test_list_orders_by_update_and_delete_cascades(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    a = store.create_session("o", "a")
    b = store.create_session("o", "b")
    store.append_message(a.session_id, "user", "x", 1)
    assert [s.session_id for s in store.list_sessions("o")] == [a.session_id, b.session_id]
    store.record_advisory(a.session_id, "typing", 1.0)
    assert store.advisories(a.session_id) == [("typing", 1.0)]
    assert store.delete_session("o", a.session_id)
    assert store.messages(a.session_id) == []
    assert store.advisories(a.session_id) == []
    store.check_integrity()


def test_first_message_names_untitled_session(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    s = store.create_session("o")
    undo = store.add_turn_messages(s.session_id, "user", [("What is KV caching?", 5, None)],
                                   "What is KV caching")
    assert (undo.title, undo.updated_at) == ("What is KV caching", s.updated_at)
    assert store.add_turn_messages(s.session_id, "user", [("second", 1, None)],
                                   "second").title is None
    assert store.get_session("o", s.session_id).title == "What is KV caching"  # type: ignore[union-attr]


def test_withdrawn_messages_leave_the_session_as_it_was(tmp_path: Path) -> None:
    """A turn the engine refused gives back the title its message gave, the session's place
    in the listings (its updated_at), and the window and stored context its cut moved."""
    store = SessionStore(tmp_path / "s.sqlite3")
    s = store.create_session("o")
    sid = s.session_id
    undo = store.add_turn_messages(sid, "user", [("hi there", 2, None)], "hi there")
    assert store.withdraw_messages(sid, "user", ["hi there"], undo)
    again = store.get_session("o", sid)
    assert again is not None and (again.title, again.updated_at) == ("New chat", s.updated_at)
    store.add_turn_messages(sid, "user", [("hello", 1, None)])
    store.append_message(sid, "assistant", "hi", 1, "stop", context_ids=[1, 2, 3])
    before = (store.window_start(sid), store.context(sid), store.kv_chains(sid))
    undo = store.add_turn_messages(sid, "user", [("long", 9, None)], window=2)
    assert (store.window_start(sid), store.context(sid)) == (2, None)
    assert store.withdraw_messages(sid, "user", ["long"], undo)
    assert (store.window_start(sid), store.context(sid), store.kv_chains(sid)) == before
    store.check_integrity()


def test_a_reply_stores_the_exact_context_tokens_with_it(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    store = SessionStore(db)
    s = store.create_session("o")
    assert store.context(s.session_id) is None
    store.append_message(s.session_id, "user", "hello", 2)
    store.append_message(s.session_id, "assistant", "hi!", 3, "stop", (7, 8, 70_000, 9))
    store.close()
    reopened = SessionStore(db)
    assert reopened.context(s.session_id) == (2, (7, 8, 70_000, 9))  # covers both messages
    reopened.append_message(s.session_id, "user", "more", 1)
    reopened.append_message(s.session_id, "assistant", "ok", 1, "stop", (1, 2))
    assert reopened.context(s.session_id) == (4, (1, 2))  # replaced by the newest
    assert reopened.delete_session("o", s.session_id)
    assert reopened.context(s.session_id) is None
    reopened.check_integrity()


def damage(path: Path, page: int) -> None:
    with open(path, "r+b") as f:
        f.seek(4096 * page)
        f.write(bytes(range(256)) * 16)


@pytest.mark.parametrize("how", ["a damaged page", "not a database"])
def test_a_damaged_database_is_refused_with_a_clear_error(tmp_path: Path, how: str) -> None:
    path = tmp_path / "sessions.sqlite3"
    store = SessionStore(path)
    for i in range(60):
        sid = store.create_session("k", f"title {i} " * 20).session_id  # type: ignore[union-attr]
        store.append_message(sid, "user", "hello " * 50, 50)
    store.close()
    if how == "a damaged page":
        damage(path, 2)
    else:
        path.write_bytes(b"this is no database " * 500)
    with pytest.raises(DatabaseDamaged, match=r"sessions\.sqlite3 is damaged"):
        SessionStore(path)


@pytest.mark.parametrize("lock", ["exclusive", "writing"])
@pytest.mark.parametrize("store_class", ["sessions", "batches"])
def test_a_database_locked_by_another_process_is_not_called_damaged(
        tmp_path: Path, lock: str, store_class: str) -> None:
    # Any SQLite error at start (locked, disk full, I/O error) was reported as a damaged file,
    # and serve advised restoring a backup or moving the file aside: a whole database lost.
    # A writer's lock (WAL) let the checks pass and failed the start's migration with a
    # traceback.
    import sqlite3

    from antiphon.server.batch_store import BatchStore
    from antiphon.sqlite import DatabaseUnavailable

    store = SessionStore if store_class == "sessions" else BatchStore
    path = tmp_path / f"{store_class}.sqlite3"
    store(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        if lock == "exclusive":
            holder.execute("PRAGMA locking_mode=EXCLUSIVE")
            holder.execute("BEGIN EXCLUSIVE")
        else:
            holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(DatabaseUnavailable, match="database is locked"):
            store(path)
    finally:
        holder.close()
    store(path).close()  # whole, once the other process lets go


def test_serve_refuses_a_damaged_database(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from antiphon.cli import main
    from tests.conftest import default_model_or_skip

    default_model_or_skip()
    (tmp_path / "sessions.sqlite3").write_bytes(b"this is no database " * 500)
    assert main(["serve", "--data-dir", str(tmp_path), "--port", "18999"]) == 2
    err = capsys.readouterr().err
    assert "sessions.sqlite3 is damaged" in err and "move it aside" in err


def test_a_session_keeps_only_its_latest_advisories(tmp_path: Path) -> None:
    # A client may send advisories as often as it likes (REST ones are not deduplicated):
    # each was a row for ever.
    from antiphon.sessions.store import ADVISORIES_KEPT

    store = SessionStore(tmp_path / "s.sqlite3")
    a = store.create_session("o", "a")
    for i in range(ADVISORIES_KEPT + 10):
        store.record_advisory(a.session_id, "rest", float(i))
    kept = store.advisories(a.session_id)
    assert [t for _, t in kept] == [float(i) for i in range(10, ADVISORIES_KEPT + 10)]
    store.check_integrity()
    # The number is a setting (`--advisories-kept`), checked like the others.
    few = SessionStore(tmp_path / "few.sqlite3", advisories_kept=3)
    b = few.create_session("o", "b")
    for i in range(5):
        few.record_advisory(b.session_id, "ws", float(i))
    assert [t for _, t in few.advisories(b.session_id)] == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="advisories_kept"):
        SessionStore(tmp_path / "none.sqlite3", advisories_kept=0)


def test_a_sessions_revision_changes_with_what_its_conversation_renders_to(
        tmp_path: Path) -> None:
    """`revision` keys the advisory repeat rule: every change to the messages, the stored
    context or the window changes it; reads, titles and advisories do not."""
    store = SessionStore(tmp_path / "s.sqlite3")
    sid = store.create_session("o").session_id
    seen = [store.revision(sid)]

    def changed() -> None:
        now = store.revision(sid)
        assert now not in seen, now
        seen.append(now)

    store.append_message(sid, "user", "hello", 2)
    changed()
    store.append_message(sid, "assistant", "hi", 1, "stop", context_ids=[1, 2, 3])
    changed()
    store.append_message(sid, "assistant", "hey", 1, "stop", context_ids=[1, 2, 4],
                         replaces_reply=True)  # a regenerated reply
    changed()
    store.set_context(sid, [1, 2, 4, 5])
    changed()
    store.append_message(sid, "user", "again", 1)
    assert store.withdraw_messages(sid, "user", ["again"])  # a turn the engine refused
    changed()
    store.move_window(sid, 1)
    changed()
    store.add_turn_messages(sid, "tool", [("42", 1, "call_1")])
    changed()
    store.messages(sid)
    store.rename_session("o", sid, "renamed")
    store.record_advisory(sid, "rest", 1.0)
    assert store.revision(sid) == seen[-1]
    store.delete_session("o", sid)
    assert store.revision(sid) is None


def test_a_failed_commit_rolls_back_and_the_next_writes_are_kept(tmp_path: Path) -> None:
    """A COMMIT that failed with its transaction still open (here a deferred foreign key)
    left it open: every later autocommit write joined it, and was lost at the next start."""
    import sqlite3

    from antiphon.sqlite import SqliteDb

    schema = """CREATE TABLE IF NOT EXISTS parent (id INTEGER PRIMARY KEY);
                CREATE TABLE IF NOT EXISTS child (id INTEGER PRIMARY KEY, parent INTEGER
                    REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED);"""
    db = SqliteDb(tmp_path / "t.db", schema)
    with pytest.raises(sqlite3.IntegrityError), db.transaction() as conn:
        conn.execute("INSERT INTO child VALUES (1, 99)")  # no parent 99: fails at COMMIT
    with db.locked() as conn:
        assert not conn.in_transaction
        conn.execute("INSERT INTO parent VALUES (7)")
    # SQLite rolled back itself: the body's error comes as it was
    with pytest.raises(KeyError), db.transaction() as conn:
        conn.execute("ROLLBACK")
        raise KeyError("the body's error")
    db.close()
    again = sqlite3.connect(tmp_path / "t.db")
    assert again.execute("SELECT id FROM parent").fetchall() == [(7,)]
    assert again.execute("SELECT COUNT(*) FROM child").fetchone() == (0,)


def test_a_deleted_sessions_words_are_in_no_file_of_the_data_folder(tmp_path: Path) -> None:
    # `secure_delete` overwrote them in the database file, but the write-ahead log kept the
    # frames that stored them until they happened to be reused (found by a review).
    secret = "card-4111-1111-1111-1111"
    store = SessionStore(tmp_path / "sessions.sqlite3")
    session = store.create_session("k")
    store.add_turn_messages(session.session_id, "user", [(secret, 10, None)])
    store.append_message(session.session_id, "assistant", "ok " + secret, 3, "stop",
                         context_ids=list(range(50)))
    for i in range(20):
        other = store.create_session("k")
        store.add_turn_messages(other.session_id, "user", [(f"hello {i}", 2, None)])
    assert store.delete_session("k", session.session_id)
    (erasure_id, *_), = store.pending_erasures()
    store.finish_erasure(erasure_id)
    held = [p.name for p in tmp_path.iterdir() if secret.encode() in p.read_bytes()]
    assert held == []
    assert [m.content for m in store.messages(other.session_id)] == ["hello 19"]
    store.close()


def test_a_deletion_whose_log_cannot_be_emptied_is_still_done(tmp_path: Path) -> None:
    # A full disk fails the checkpoint that empties the write-ahead log (the file must grow):
    # the deletion, committed, was reported failed (507), and its erasure never started
    # (found by a review of the change that empties the log).
    import sqlite3

    class FullCheckpoints:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
            if "wal_checkpoint" in sql:
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(sql, *args)

        def __getattr__(self, name: str) -> object:
            return getattr(self.db, name)

    store = SessionStore(tmp_path / "sessions.sqlite3")
    session = store.create_session("k")
    store.add_turn_messages(session.session_id, "user", [("hello", 2, None)])
    store._db._db = FullCheckpoints(store._db._db)  # type: ignore[assignment]
    assert store.delete_session("k", session.session_id)
    assert store.get_session("k", session.session_id) is None
    (erasure_id, *_), = store.pending_erasures()
    store.finish_erasure(erasure_id)
    assert store.pending_erasures() == []
    store.close()
