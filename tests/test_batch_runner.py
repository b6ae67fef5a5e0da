"""The batch runner without a server: expiry, and a crash in the middle of finalizing."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server import batch_runner
from antiphon.server.batch_runner import BatchRunner
from antiphon.server.batch_store import BatchStore
from antiphon.server.batch_types import (
    Batch,
    BatchStatus,
    FileRecord,
    InputItem,
    ItemResult,
    new_file_id,
)
from antiphon.server.chat import ChatService
from antiphon.server.config import ServerConfig
from antiphon.server.file_store import FileStore
from antiphon.server.metrics import ServerMetrics
from tests.test_batches import jsonl


def direct_runner(tmp_path: Path, token_delay_s: float = 0.0,
                  ) -> tuple[BatchStore, FileStore, ScriptedEngine, BatchRunner]:
    """A runner without a server, over a store and files in `tmp_path`."""
    store, files = BatchStore(tmp_path / "b.sqlite3"), FileStore(tmp_path / "files")
    engine = ScriptedEngine(token_delay_s=token_delay_s)
    metrics = ServerMetrics()
    config = ServerConfig(max_batch_concurrency=2)
    return store, files, engine, BatchRunner(store, files, ChatService(engine, metrics, config),
                                             metrics)


def add_input(store: BatchStore, files: FileStore, n: int, window_s: float = 3600.0,
              owner: str = "o") -> str:
    file_id = new_file_id()
    with files.create(file_id) as w:
        w.write(jsonl(n))
        w.commit()
    store.add_file(FileRecord(file_id, owner, "batch", "in.jsonl", w.num_bytes, time.time()))
    return store.create_batch(owner, file_id, "24h", window_s, None).batch_id


async def run_until_finished(store: BatchStore, runner: BatchRunner, batch_id: str) -> Batch:
    await runner.start()
    try:
        for _ in range(200):
            batch = store.get_batch("o", batch_id)
            if batch is not None and batch.status.is_finished:
                return batch
            await asyncio.sleep(0.05)
    finally:
        await runner.stop()
    raise TimeoutError(f"batch {batch_id} did not finish")


async def test_expiry_fails_unfinished_items(tmp_path: Path) -> None:
    store, files, engine, runner = direct_runner(tmp_path, token_delay_s=0.05)
    await engine.start()
    batch = await run_until_finished(store, runner, add_input(store, files, 20, window_s=0.5))
    assert batch.status == BatchStatus.EXPIRED
    assert batch.counts.total == 20 and batch.counts.completed + batch.counts.failed == 20
    assert 0 < batch.counts.completed < 20 and batch.error_file_id is not None
    errors = files.path(batch.error_file_id).read_text().splitlines()
    assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_expired"}
    assert not engine.active_request_ids
    store.check_integrity()
    files.check_integrity(store.file_sizes())


async def test_crash_during_finalize_rebuilds_the_files(tmp_path: Path) -> None:
    """All items committed, the batch FINALIZING, result files half written when the process
    died: the next start sweeps the strays and finalizes from the committed results."""
    store, files, engine, runner = direct_runner(tmp_path)
    batch_id = add_input(store, files, 5)
    store.start_batch(batch_id, [InputItem(i, f"item-{i}", "{}") for i in range(5)])
    for i in range(5):
        store.commit_item(batch_id, i, ItemResult(f"r{i}", json.dumps({"n": i})))
    assert store.begin_finalize(batch_id)
    stray, partial = new_file_id(), new_file_id()
    files.path(stray).write_text("a whole but unregistered output file\n")
    files.path(partial).with_suffix(".part").write_text("half")
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED and batch.output_file_id is not None
    assert not files.path(stray).exists() and not list(files.directory.glob("*.part"))
    out = [json.loads(line) for line in files.path(batch.output_file_id).read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [f"item-{i}" for i in range(5)]
    assert [r["response"]["body"] for r in out] == [{"n": i} for i in range(5)]
    assert not engine.finished_request_ids  # nothing ran again
    store.check_integrity()
    files.check_integrity(store.file_sizes())


async def test_a_batch_whose_check_fails_fails_alone_and_the_others_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure no line explains (here: a checker bug) fails that batch, once; it neither
    stops the runner nor keeps the batches beside it waiting."""
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    good = add_input(store, files, 4)
    broken = add_input(store, files, 3)
    real = batch_runner.read_items

    def read_items(path: Path, *args: Any) -> Any:
        if path == files.path(store.get_batch("o", broken).input_file_id):  # type: ignore[union-attr]
            raise RecursionError("maximum recursion depth exceeded")
        return real(path, *args)

    monkeypatch.setattr(batch_runner, "read_items", read_items)
    assert (await run_until_finished(store, runner, good)).status == BatchStatus.COMPLETED
    failed = store.get_batch("o", broken)
    assert failed is not None and failed.status == BatchStatus.FAILED
    assert failed.errors and "RecursionError" in failed.errors[0]["message"]
    store.check_integrity()


async def test_running_out_of_file_descriptors_while_checking_fails_no_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of the moment reading the input (the process at its open-file limit) failed
    the batch for good, "the input file cannot be read", a file that was fine."""
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    real, failures = batch_runner.read_items, [OSError(errno.EMFILE, "Too many open files")]

    def read_items(*args: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args)

    monkeypatch.setattr(batch_runner, "read_items", read_items)
    batch = await run_until_finished(store, runner, add_input(store, files, 3))
    assert not failures and batch.status == BatchStatus.COMPLETED
    assert batch.counts.completed == 3
    store.check_integrity()


async def test_a_batch_whose_input_cannot_be_read_within_its_window_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An error of the moment that never passed left it validating for good, `--wait` showing
    # 0/0 (found by a review).
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()

    def read_items(*args: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(batch_runner, "read_items", read_items)
    batch = await run_until_finished(store, runner, add_input(store, files, 3, window_s=0.5))
    assert batch.status == BatchStatus.FAILED
    assert batch.errors is not None and "Too many open files" in batch.errors[0]["message"]
    store.check_integrity()


async def test_stopping_the_server_does_not_use_up_an_items_attempts(tmp_path: Path) -> None:
    """Items cut off by a clean shutdown run again as often as the server restarts; only a
    start that ends in a crash counts towards --max-batch-item-attempts."""
    store, files, engine, runner = direct_runner(tmp_path, token_delay_s=0.05)
    await engine.start()
    batch_id = add_input(store, files, 2)
    for _ in range(runner.config.max_batch_item_attempts + 1):
        await runner.start()
        while len(engine.active_request_ids) < 2:
            await asyncio.sleep(0.01)
        await runner.stop()
    await asyncio.sleep(0.5)  # a count still in its thread lands
    assert [it.num_attempts for it in store.pending_items(batch_id, 10)] == [0, 0]
    batch = await run_until_finished(store, runner, batch_id)
    assert (batch.counts.completed, batch.counts.failed) == (2, 0)


async def test_a_stop_landing_while_a_start_is_taken_back_takes_it_back_once(
        tmp_path: Path) -> None:
    # One signal stops the engine and the server: the engine fails an item, its start is
    # taken back, and the runner's stop, landing meanwhile, took it back again. An item a
    # crash had cut short (one attempt counted, run alone after) then ran beside others
    # (found by a review).
    store, files, _, runner = direct_runner(tmp_path)
    batch_id = add_input(store, files, 1)
    await runner._validate(store.get_batch("o", batch_id))
    store.record_attempts(batch_id, [0])  # a start a crash cut short
    store.record_attempts(batch_id, [0])  # this start
    item = store.pending_items(batch_id, 1)[0]
    runner.chat.stop_requested = True

    async def engine_stopped(item: Any, batch: Any) -> None:
        return None
    runner._answer = engine_stopped  # type: ignore[method-assign]
    record = store.record_attempts

    def fsynced(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.2)
        record(*args, **kwargs)
    store.record_attempts = fsynced  # type: ignore[method-assign]
    task = asyncio.create_task(runner._run_item(store.get_batch("o", batch_id), item))
    await asyncio.sleep(0.05)  # the take-back is in its thread
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.5)
    assert store.pending_items(batch_id, 1)[0].num_attempts == 1


async def test_no_item_is_started_into_a_dead_engine(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each start into a dead engine would fail at once and count as an attempt: the items
    would use up their attempts before the server restarted (it shuts down when the engine
    dies), and fail for good."""
    monkeypatch.setattr(batch_runner, "RETRY_DELAY_S", 0.0)
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    engine.die()
    batch_id = add_input(store, files, 2)
    await runner.start()
    await asyncio.sleep(0.5)  # the runner's steps: validated, none started
    await runner.stop()
    batch = store.get_batch("o", batch_id)
    assert batch is not None and batch.status == BatchStatus.IN_PROGRESS
    assert [it.num_attempts for it in store.pending_items(batch_id, 10)] == [0, 0]


class NeighbourRecordingEngine(ScriptedEngine):
    """Records, for each request's prompt, the most requests that ran beside it."""

    def __init__(self) -> None:
        super().__init__(token_delay_s=0.01)
        self.most_beside: dict[str, int] = {}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: Any) -> Any:
        prompt = self.decode(prompt_token_ids)
        async for delta in super().generate(request_id, prompt_token_ids, params):
            beside = len(self.active_request_ids) - 1
            self.most_beside[prompt] = max(self.most_beside.get(prompt, 0), beside)
            yield delta


async def test_an_item_a_crash_cut_short_runs_alone(tmp_path: Path) -> None:
    """Items started before that never finished may be what crashed the engine: each runs
    with nothing beside it, so a crashing request cannot use up its neighbours' attempts;
    the others run side by side as before."""
    store, files, _, _ = direct_runner(tmp_path)
    engine = NeighbourRecordingEngine()
    metrics, config = ServerMetrics(), ServerConfig(max_batch_concurrency=4)
    runner = BatchRunner(store, files, ChatService(engine, metrics, config), metrics)
    await engine.start()
    batch_id = add_input(store, files, 0)
    body = json.loads(jsonl(1).decode())["body"]
    items = [InputItem(i, f"item-{i}", json.dumps(
        {**body, "messages": [{"role": "user", "content": f"doc {i} a b c"}]}))
        for i in range(10)]
    assert store.start_batch(batch_id, items)
    store.record_attempts(batch_id, [0, 1, 5])  # in flight at a crash
    batch = await run_until_finished(store, runner, batch_id)
    assert (batch.counts.completed, batch.counts.failed) == (10, 0)
    beside = {int(prompt.split("doc ")[1].split()[0]): n
              for prompt, n in engine.most_beside.items()}
    assert sorted(beside) == list(range(10))
    assert [beside[i] for i in (0, 1, 5)] == [0, 0, 0]
    assert max(beside[i] for i in (2, 3, 4, 6, 7, 8, 9)) > 0  # the rest ran side by side
    store.check_integrity()


async def test_another_keys_batch_does_not_wait_for_a_big_one(tmp_path: Path) -> None:
    """Free slots go to the owner with the fewest items running: a one-item batch of key B
    starts as soon as a slot frees, not after all of key A's earlier batch."""
    store, files, _engine, runner = direct_runner(tmp_path, token_delay_s=0.01)

    def batch(owner: str, batch_id: str) -> Batch:
        found = store.get_batch(owner, batch_id)
        assert found is not None
        return found

    big = add_input(store, files, 40, owner="a")
    await runner.start()
    try:
        while batch("a", big).counts.completed < 2:  # both slots busy with key A's items
            await asyncio.sleep(0.02)
        small = add_input(store, files, 1, owner="b")
        runner.notify()
        while not batch("b", small).status.is_finished:
            await asyncio.sleep(0.02)
        remaining = batch("a", big).counts
    finally:
        await runner.stop()
        store.close()
    assert remaining.num_pending > 20, remaining


async def test_a_full_disk_at_commit_keeps_the_answer_and_spends_no_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each failed commit counted as a failed start: once space came back, items the engine
    # had answered every time failed as "stopped after N attempts".
    from tests.test_storage_full import sqlite_full_error

    monkeypatch.setattr(batch_runner, "RETRY_DELAY_S", 0.02)
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    batch_id = add_input(store, files, 2)
    real, calls = store.commit_item, []

    def commit_item(*args: Any) -> bool:
        calls.append(args[1])
        if len(calls) <= 8:  # the disk is full for a while, then space is freed
            raise sqlite_full_error()
        return real(*args)

    store.commit_item = commit_item  # type: ignore[method-assign]
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED
    assert (batch.counts.completed, batch.counts.failed) == (2, 0)
    assert len(engine.finished_request_ids) == 2  # each answered once, kept until committed


async def test_a_batch_answered_in_full_completes_even_past_its_window(tmp_path: Path) -> None:
    # The process died after the last answer committed and came back after the window:
    # the batch ended "expired", though every item had its answer.
    store, files, _, runner = direct_runner(tmp_path)
    batch_id = add_input(store, files, 3, window_s=0.0)
    store.start_batch(batch_id, [InputItem(i, f"item-{i}", "{}") for i in range(3)])
    for i in range(3):
        store.commit_item(batch_id, i, ItemResult(f"r{i}", json.dumps({"n": i})))
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED
    assert (batch.counts.completed, batch.counts.failed) == (3, 0)


async def test_a_batch_whose_last_answer_lands_as_its_window_ends_completes(
        tmp_path: Path) -> None:
    # The step read the batch with one item pending, the item's answer committed before the
    # step expired it: "expired" with every item answered (found by a review).
    store, files, _, runner = direct_runner(tmp_path)
    batch_id = add_input(store, files, 3, window_s=0.0)
    store.start_batch(batch_id, [InputItem(i, f"item-{i}", "{}") for i in range(3)])
    for i in range(2):
        store.commit_item(batch_id, i, ItemResult(f"r{i}", json.dumps({"n": i})))
    read = store.unfinished_batches

    def read_then_the_last_answer() -> list[Batch]:
        store.unfinished_batches = read  # type: ignore[method-assign]
        batches = read()
        store.commit_item(batch_id, 2, ItemResult("r2", json.dumps({"n": 2})))
        return batches

    store.unfinished_batches = read_then_the_last_answer  # type: ignore[method-assign]
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED
    assert (batch.counts.completed, batch.counts.failed) == (3, 0)


async def test_a_stop_while_starts_are_counted_takes_them_back(tmp_path: Path) -> None:
    # The count committed in its thread after the stop: items that never ran came back as
    # suspects, and a few such stops failed them.
    import threading

    store, files, engine, runner = direct_runner(tmp_path, token_delay_s=0.05)
    await engine.start()
    batch_id = add_input(store, files, 2)
    real, entered = store.record_attempts, threading.Event()

    def record_attempts(batch_id: str, lines: Any, delta: int = 1) -> None:
        if delta == 1:
            entered.set()
            time.sleep(0.3)  # a slow disk (synchronous FULL fsyncs)
        real(batch_id, lines, delta)

    store.record_attempts = record_attempts  # type: ignore[method-assign]
    await runner.start()
    while not entered.is_set():
        await asyncio.sleep(0.01)
    await runner.stop()
    await asyncio.sleep(0.5)  # a count still in its thread lands
    assert [it.num_attempts for it in store.pending_items(batch_id, 10)] == [0, 0]


async def test_a_failed_finalize_leaves_no_copy_of_the_results_behind(tmp_path: Path) -> None:
    from tests.test_storage_full import sqlite_full_error

    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    batch_id = add_input(store, files, 3)
    real, calls = store.finish_batch, []

    def finish_batch(*args: Any) -> None:
        calls.append(1)
        if len(calls) <= 3:  # the disk is full for three tries
            raise sqlite_full_error()
        real(*args)

    store.finish_batch = finish_batch  # type: ignore[method-assign]
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED and len(calls) == 4
    assert sorted(p.stem for p in files.directory.iterdir()) == sorted(store.file_sizes())


async def test_results_stay_when_the_log_is_not_emptied_after_the_finish(
        tmp_path: Path) -> None:
    """`finish_batch` commits, then forgets the items' answers and empties the write-ahead
    log; a failure there reached the finalize's cleanup, which deleted the result files the
    commit had registered: the answers were gone from both (found by a review)."""
    from tests.test_storage_full import sqlite_full_error

    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    batch_id = add_input(store, files, 3)

    def scrub() -> None:
        raise sqlite_full_error()

    store.db.scrub = scrub  # type: ignore[method-assign]
    batch = await run_until_finished(store, runner, batch_id)
    assert batch.status == BatchStatus.COMPLETED and batch.output_file_id
    assert len(files.path(batch.output_file_id).read_text().splitlines()) == 3


async def test_an_item_committed_while_pending_items_are_read_does_not_run_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An item answered while the runner reads which items are pending (in a thread, a slow
    disk's 10 ms here) is in that read, but no longer running once it is back: it was started
    again (6 of 900 items ran twice)."""
    store, files, engine, runner = direct_runner(tmp_path, token_delay_s=0.003)
    read = store.pending_items

    def slow_read(*args: Any, **kwargs: Any) -> Any:
        found = read(*args, **kwargs)
        time.sleep(0.01)
        return found
    monkeypatch.setattr(store, "pending_items", slow_read)
    batch_id = add_input(store, files, 200)
    try:
        batch = await run_until_finished(store, runner, batch_id)
    finally:
        store.close()
    assert batch.counts.completed == 200
    assert len(engine.request_prompts) == 200


async def test_an_item_asking_for_a_session_fails_also_when_an_older_server_checked_it(
        tmp_path: Path) -> None:
    """Items a server checked before lines naming a session were refused ran as plain BE
    work, the session unheeded; they fail when they run."""
    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    batch_id = add_input(store, files, 0)
    body = json.loads(jsonl(1).decode())["body"]
    assert store.start_batch(batch_id, [
        InputItem(0, "plain", json.dumps(body)),
        InputItem(1, "session", json.dumps({**body, "vllm_xargs": {"session_id": "s_x"}}))])
    try:
        batch = await run_until_finished(store, runner, batch_id)
    finally:
        store.close()
    assert (batch.counts.completed, batch.counts.failed) == (1, 1)
    assert len(engine.request_prompts) == 1


async def test_lines_that_fail_validation_are_counted_failed_once(tmp_path: Path) -> None:
    """antiphon_batch_items_total{outcome="failed"} left out the lines that failed validation
    (stored failed when the batch starts, never run); counted then, and not again when a
    restart resumes the batch."""
    store, files, engine, runner = direct_runner(tmp_path, token_delay_s=0.05)
    await engine.start()
    file_id = new_file_id()
    with files.create(file_id) as w:
        w.write(jsonl(4) + b"{not json\n[]\n")
        w.commit()
    store.add_file(FileRecord(file_id, "o", "batch", "in.jsonl", w.num_bytes, time.time()))
    batch_id = store.create_batch("o", file_id, "24h", 3600.0, None).batch_id

    def counted(outcome: str) -> float | None:
        return runner.metrics.registry.get_sample_value("antiphon_batch_items_total",
                                                        {"outcome": outcome})

    await runner.start()
    while not engine.active_request_ids:  # validated, and running
        await asyncio.sleep(0.01)
    await runner.stop()
    assert counted("failed") == 2
    batch = await run_until_finished(store, runner, batch_id)  # the restart resumes it
    assert (batch.counts.completed, batch.counts.failed) == (4, 2)
    assert (counted("completed"), counted("failed")) == (4, 2)


async def test_an_item_committed_as_its_batch_is_cancelled_is_counted(tmp_path: Path) -> None:
    """A cancel landing while an item's answer commits waits for the commit: the item is
    answered, and antiphon_batch_items_total left it out."""
    import threading

    store, files, engine, runner = direct_runner(tmp_path)
    await engine.start()
    batch_id = add_input(store, files, 4)
    real, committing = store.commit_item, threading.Event()

    def commit_item(*args: Any) -> bool:
        committed = real(*args)
        committing.set()
        time.sleep(0.3)  # (its thread not done yet when the cancel lands)
        return committed

    store.commit_item = commit_item  # type: ignore[method-assign]
    finished = asyncio.ensure_future(run_until_finished(store, runner, batch_id))
    while not committing.is_set():
        await asyncio.sleep(0.01)
    assert store.request_cancel("o", batch_id) is not None
    runner.notify()
    batch = await finished
    assert batch.status == BatchStatus.CANCELLED and batch.counts.completed >= 1
    counted = [runner.metrics.registry.get_sample_value("antiphon_batch_items_total",
                                                        {"outcome": outcome}) or 0
               for outcome in ("completed", "failed")]
    assert counted == [batch.counts.completed, batch.counts.failed]


async def test_items_keep_starting_while_another_batch_is_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check ran in the runner's step: while a 50,000-line file was read (3 s), no item of
    # any batch started, and no cancel was seen (found by a review). The check is slowed here.
    store, files, _engine, runner = direct_runner(tmp_path, token_delay_s=0.005)
    checking = asyncio.Event()
    loop = asyncio.get_running_loop()
    read_items = batch_runner.read_items

    def slow_read_items(*args: Any) -> Any:
        loop.call_soon_threadsafe(checking.set)
        time.sleep(1.5)
        return read_items(*args)

    monkeypatch.setattr(batch_runner, "read_items", slow_read_items)
    running = add_input(store, files, 400, owner="a")
    await runner.start()
    try:
        for _ in range(500):  # its own check done, its items running
            found = store.get_batch("a", running)
            if found is not None and found.counts.completed >= 4:
                break
            await asyncio.sleep(0.01)
        add_input(store, files, 3, owner="b")
        runner.notify()
        await asyncio.wait_for(checking.wait(), 5)
        before = store.get_batch("a", running)
        await asyncio.sleep(1.0)  # the other batch is being checked all this time
        after = store.get_batch("a", running)
    finally:
        await runner.stop()
        store.close()
    assert before is not None and after is not None
    assert after.counts.completed - before.counts.completed >= 10


async def test_a_batch_finished_while_a_step_goes_on_is_not_finalized_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The step read its list before the batch's finalizing ended, and reached the batch once
    # the stage had let go of it: it wrote the results again, and the store refused the
    # second finish (found by a review). Here another batch's step delays it.
    import threading

    from antiphon.server.batch_types import ItemResult

    def answered(batch_id: str, n: int) -> None:
        assert store.start_batch(batch_id, [InputItem(i, f"c{i}", "{}", None)
                                            for i in range(n)])
        for i in range(n):
            assert store.commit_item(batch_id, i, ItemResult("r", '{"x": 1}'))

    store, files, _engine, runner = direct_runner(tmp_path)
    finishing = add_input(store, files, 2)
    answered(finishing, 2)
    assert store.begin_finalize(finishing)
    gate = threading.Event()
    finish, begin, write = store.finish_batch, store.begin_finalize, runner._write_results
    written: list[str] = []

    def slow_finish(*args: Any) -> Any:
        gate.wait(5)
        return finish(*args)

    def slow_begin(batch_id: str) -> Any:
        gate.set()  # the stage ends while this step is on the other batch
        time.sleep(0.3)
        return begin(batch_id)

    def counting_write(b: Batch, *args: Any) -> Any:
        written.append(b.batch_id)
        return write(b, *args)

    store.finish_batch, store.begin_finalize = slow_finish, slow_begin  # type: ignore[method-assign]
    runner._write_results = counting_write  # type: ignore[method-assign]
    await runner._step()  # staged
    other = add_input(store, files, 1)  # answered in full, listed first
    answered(other, 1)
    with store.db.locked() as db:
        db.execute("UPDATE batches SET created_at = 0 WHERE batch_id = ?", (other,))
    await runner._step()
    for task in list(runner._staging.values()):
        await task
    found = store.get_batch("o", finishing)
    assert found is not None and found.status == BatchStatus.COMPLETED
    assert written == [finishing, finishing]  # its output and error files, once
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    store.close()
