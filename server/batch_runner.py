"""Runs batches in the background: validate the input, run its items on the engine as BE
requests with bounded concurrency, finalize the result files, handle cancel and expiry.

Crash safety comes from the store: all progress is in SQLite, and the runner only ever acts on
what is committed there. An item is answered when its result commits (once, keyed by batch and
line); an item that was in flight when the process died has no result, so it runs again after
a restart, and its first answer, never committed, was never shown to anyone. Result files are
built from committed results only, under fresh ids, and registered in the same transaction that
finishes the batch; a crash before that leaves unregistered files that `start` sweeps away, and
the batch is finalized again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import json
import logging
import time
from typing import Any

from antiphon.engine_ext.types import RequestClass
from antiphon.server.batch_endpoints import ENDPOINTS, check_batch_line
from antiphon.server.batch_input import parse_body, read_items
from antiphon.server.batch_store import BatchStore
from antiphon.server.batch_types import (
    Batch,
    BatchStatus,
    FileRecord,
    ItemResult,
    ItemState,
    PendingItem,
    new_file_id,
)
from antiphon.server.chat import ChatService, Generation
from antiphon.server.choices import run_choices
from antiphon.server.errors import ApiError, ErrorCode, is_storage_full
from antiphon.server.file_store import FileStore
from antiphon.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Seconds between looks at the store when nothing happens (how late expiry can be noticed).
POLL_INTERVAL_S = 1.0
# Seconds to hold new items back after the engine failed one.
RETRY_DELAY_S = 1.0
# Errors reading a batch's input that say nothing of the file, and pass: it stays validating
# (failed for good, the user had to submit it again)
PASSING_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS,
                            errno.EAGAIN, errno.EINTR})
# Most seconds between tries to commit an answer while the disk is full.
COMMIT_RETRY_MAX_S = 30.0

ItemKey = tuple[str, int]  # (batch_id, line_index)


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileStore, chat: ChatService,
                 metrics: ServerMetrics) -> None:
        self.store = store
        self.files = files
        self.chat = chat
        self.metrics = metrics
        self.config = chat.config
        self._inflight: dict[ItemKey, asyncio.Task[None]] = {}
        # batch id -> its check or its finalizing, running beside the items (a 50,000-line
        # check took 3 s, in which no item of any batch started, and no cancel was seen)
        self._staging: dict[str, asyncio.Task[None]] = {}
        self._num_choices: dict[ItemKey, int] = {}  # of each item running: engine requests
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._paused_until = 0.0  # time.monotonic() before which no new item starts
        self._alone: ItemKey | None = None  # a suspect item running with nothing beside it

    async def start(self) -> None:
        """Remove files a crash left unregistered, then resume every unfinished batch."""
        registered = await asyncio.to_thread(self.store.file_sizes)
        swept = await asyncio.to_thread(self.files.sweep, registered.keys())
        if swept:
            logger.info("removed %d unregistered batch files", len(swept))
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Abort in-flight items (they stay unanswered and run again after a restart)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def notify(self) -> None:
        """Look at the store now (a batch was created or cancelled)."""
        self._wake.set()

    async def _loop(self) -> None:
        try:
            while True:
                self._wake.clear()
                try:
                    await self._step()
                except Exception:
                    logger.exception("batch runner step failed; retrying")
                    await asyncio.sleep(RETRY_DELAY_S)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel
                # (stop) that lands as the event is set, and the runner would run on.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_INTERVAL_S):
                        await self._wake.wait()
        finally:
            staging = list(self._staging.values())
            for task in staging:
                task.cancel()
            await asyncio.gather(*staging, return_exceptions=True)
            await self._abort(list(self._inflight))

    async def _step(self) -> None:
        """Move each unfinished batch one stage on, then fill free slots with items."""
        runnable: list[Batch] = []
        for b in await asyncio.to_thread(self.store.unfinished_batches):
            if b.batch_id in self._staging:
                continue  # being checked or finalized
            if b.status in (BatchStatus.VALIDATING, BatchStatus.FINALIZING,
                            BatchStatus.CANCELLING):
                task = self._staging[b.batch_id] = asyncio.create_task(
                    self._stage(b), name=f"batch-{b.batch_id}-{b.status}")
                # (let go also by a stage cancelled before it ran)
                task.add_done_callback(functools.partial(self._staged, b.batch_id))
                continue
            try:
                if await self._advance(b):
                    runnable.append(b)
            except Exception:  # this batch waits for the next step; the others go on
                logger.exception("batch %s: %s failed; trying again", b.batch_id, b.status)
        if not self.chat.engine.is_dead:  # nothing runs until a restart brings a new one
            await self._dispatch(runnable)
        num_waiting = sum(b.counts.num_pending for b in runnable) - len(self._inflight)
        self.metrics.batch_queue.set(max(0, num_waiting))

    def _staged(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self._staging.pop(batch_id, None)

    async def _stage(self, b: Batch) -> None:
        """Check batch `b`'s input, or finish it (cancelling or finalizing), beside the
        items running; a failure is tried again at a later step."""
        try:
            now = await asyncio.to_thread(self.store.get_batch, b.owner, b.batch_id)
            if now is None or now.status != b.status:
                # moved on since the step read it: a stage that ended as the step went on
                # (the results written twice, a 50,000-line input checked twice)
                return
            b = now
            if b.status == BatchStatus.VALIDATING:
                await self._validate(b)
            else:
                await self._abort([k for k in self._inflight if k[0] == b.batch_id])
                num_unrun = await asyncio.to_thread(self.store.fail_unrun, b.batch_id)
                self.metrics.batch_items.labels("failed").inc(num_unrun)
                await self._finalize(b)
        except Exception:  # (tried at the next poll, not at once: it would spin)
            logger.exception("batch %s: %s failed; trying again", b.batch_id, b.status)
        else:
            self.notify()

    async def _advance(self, b: Batch) -> bool:
        """Move batch `b` (running) one stage on; whether it has items to run now."""
        if b.counts.num_pending == 0:  # answered in full: complete, even past its window
            await asyncio.to_thread(self.store.begin_finalize, b.batch_id)
            self.notify()
        elif time.time() >= b.times["expires_at"]:
            num_expired = await asyncio.to_thread(self.store.expire_batch, b.batch_id)
            self.metrics.batch_items.labels("failed").inc(num_expired)
            self.notify()
        else:
            return True
        return False

    async def _validate(self, b: Batch) -> None:
        """Check every line of `b`'s input; fails the batch as a whole only when the file
        cannot be read (or its check fails in a way no line explains: it would every time)."""
        path = self.files.path(b.input_file_id)
        try:
            items = await asyncio.to_thread(read_items, path, self.chat, b.endpoint)
        except OSError as exc:
            # (the next step tries again: the file is fine; not past the batch's window, or it
            # stayed validating for good)
            if exc.errno in PASSING_ERRNOS and time.time() < b.times["expires_at"]:
                raise
            await asyncio.to_thread(self.store.fail_batch, b.batch_id, ErrorCode.INVALID_FILE,
                                    f"the input file cannot be read: {exc.strerror}")
            return
        except Exception as exc:
            logger.exception("batch %s: validation failed", b.batch_id)
            await asyncio.to_thread(self.store.fail_batch, b.batch_id, ErrorCode.INVALID_FILE,
                                    f"the input file could not be checked: "
                                    f"{type(exc).__name__}: {exc}")
            return
        if not items:
            await asyncio.to_thread(self.store.fail_batch, b.batch_id, ErrorCode.INVALID_FILE,
                                    "the input file has no requests")
            return
        if await asyncio.to_thread(self.store.start_batch, b.batch_id, items):
            # Lines that failed validation are stored failed here and never run: counted now,
            # the once their batch leaves VALIDATING (a restart resumes it past this step).
            # (Not stored when the batch was cancelled meanwhile: nor counted.)
            self.metrics.batch_items.labels("failed").inc(sum(1 for it in items if it.error))
            logger.info("batch %s: %d requests", b.batch_id, len(items))
        self.notify()

    async def _dispatch(self, batches: list[Batch]) -> None:
        """Start pending items while slots are free, fairly: each free slot goes to the owner
        (API key) with the fewest items running, then to its batch with the fewest, then the
        oldest. (Taking the batches in turn from the oldest each time a slot came free gave
        every slot to the oldest batch: another key's batch waited for all of it.)

        A suspect item, one started before that never finished (a crash, or the engine failed
        it), runs alone: the items running finish first, and none starts beside it. A request
        that crashes the engine then takes no other item's attempts with it: run beside the
        same neighbours after each restart, it made them fail too."""
        num_free = self.config.max_batch_concurrency - sum(self._num_choices.values())
        if (num_free <= 0 or not batches or time.monotonic() < self._paused_until
                or self._alone in self._inflight):
            return
        owner_of = {b.batch_id: b.owner for b in batches}
        running_in = collections.Counter(batch_id for batch_id, _ in self._inflight)
        running_of = collections.Counter(owner_of[batch_id] for batch_id, _ in self._inflight
                                         if batch_id in owner_of)
        queues = []
        for b in batches:
            # Items running when the read starts may be committed under it: a read that began
            # before the commit lists one as pending, and it would run again.
            started = set(self._inflight)
            pending = await asyncio.to_thread(self.store.pending_items, b.batch_id,
                                              num_free + len(started))
            queues.append([(b, it) for it in pending if (b.batch_id, it.line_index)
                           not in started and (b.batch_id, it.line_index) not in self._inflight])
        chosen: list[tuple[Batch, PendingItem]] = []
        num_choices: dict[ItemKey, int] = {}  # of each item looked at
        num_taken = 0  # engine requests of the items chosen
        while any(queues):
            queue = min((q for q in queues if q), key=lambda q: (
                running_of[q[0][0].owner], running_in[q[0][0].batch_id]))  # stable: oldest
            b, item = queue[0]
            key = (b.batch_id, item.line_index)
            num_choices[key] = _num_choices(b, item, self.config.max_batch_concurrency)
            if 0 < item.num_attempts < self.config.max_batch_item_attempts:  # a suspect
                if not chosen and not self._inflight:
                    chosen.append(queue.pop(0))
                    self._alone = key
                break  # or it waits for the pipeline to drain, and so does what is after it
            if num_choices[key] > num_free - num_taken:
                break  # it waits for its choices' room, and so does what is after it
            queue.pop(0)
            chosen.append((b, item))
            num_taken += num_choices[key]
            running_of[b.owner] += 1
            running_in[b.batch_id] += 1
        for b in batches:
            mine = [it for batch, it in chosen if batch is b]
            if mine:
                await self._record_starts(b.batch_id, [it.line_index for it in mine])
            for it in mine:
                key = (b.batch_id, it.line_index)
                self._num_choices[key] = num_choices[key]
                self._inflight[key] = asyncio.create_task(self._run_item(b, it))

    async def _record_starts(self, batch_id: str, lines: list[int]) -> None:
        """Count a start of each item (`--max-batch-item-attempts`) before it runs. A stop landing
        while the count commits takes it back once it has: those items never ran."""
        record = asyncio.ensure_future(asyncio.to_thread(self.store.record_attempts,
                                                         batch_id, lines))
        try:
            await asyncio.shield(record)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await record
                await asyncio.to_thread(self.store.record_attempts, batch_id, lines, -1)
            raise

    async def _run_item(self, batch: Batch, item: PendingItem) -> None:
        batch_id = batch.batch_id
        is_uncounted = False  # its start taken back: once, also where a stop lands meanwhile
        try:
            if item.num_attempts >= self.config.max_batch_item_attempts:
                result: ItemResult | None = ItemResult(
                    None, None, ErrorCode.ENGINE_ERROR.value,
                    f"stopped after {item.num_attempts} attempts that did not finish")
            else:
                result = await self._answer(item, batch)
                if result is None and self.chat.stop_requested:
                    # The engine stopped with the server (one signal to both): not the
                    # item's doing, so the start does not count.
                    is_uncounted = True
                    await asyncio.shield(self._uncount_attempt(batch_id, item.line_index))
            if result is not None:
                await self._commit(batch_id, item.line_index, result)
        except asyncio.CancelledError:
            # Stopped on purpose (shutdown or cancel), not cut short by a failure: the start
            # does not count towards --max-batch-item-attempts. A crash leaves it counted.
            if not is_uncounted:
                await asyncio.shield(self._uncount_attempt(batch_id, item.line_index))
            raise
        except Exception:
            logger.exception("batch %s line %d failed; it will run again", batch_id,
                             item.line_index)
            self._paused_until = time.monotonic() + RETRY_DELAY_S
        finally:
            self._inflight.pop((batch_id, item.line_index), None)
            self._num_choices.pop((batch_id, item.line_index), None)
            self.notify()

    def _counted(self, committed: bool, result: ItemResult) -> bool:
        if committed:
            outcome = "completed" if result.state == ItemState.SUCCEEDED else "failed"
            self.metrics.batch_items.labels(outcome).inc()
        return committed

    async def _uncount_attempt(self, batch_id: str, line_index: int) -> None:
        await asyncio.to_thread(self.store.record_attempts, batch_id, [line_index], -1)

    async def _commit(self, batch_id: str, line_index: int, result: ItemResult) -> bool:
        """Commit in a thread, and count the item once committed. A cancel waits for the
        commit to land (and counts it then), so once `_abort` returns no late commit can slip
        in behind result files being written. A full disk is not the
        item's fault: its answer is kept and the commit tried again, ever less often (up to
        every `COMMIT_RETRY_MAX_S`), until there is room or the item is stopped; re-running
        it would spend its attempts (`--max-batch-item-attempts`) on answers it already has."""
        delay_s = RETRY_DELAY_S
        while True:
            commit = asyncio.ensure_future(asyncio.to_thread(
                self.store.commit_item, batch_id, line_index, result))
            try:
                return self._counted(await asyncio.shield(commit), result)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    self._counted(await commit, result)
                raise
            except Exception as exc:
                if not is_storage_full(exc):
                    raise
                logger.warning("batch %s line %d: the disk is full; its answer is kept and "
                               "committed once there is room", batch_id, line_index)
                self._paused_until = time.monotonic() + delay_s  # nor does any other start
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, COMMIT_RETRY_MAX_S)

    async def _answer(self, item: PendingItem, batch: Batch) -> ItemResult | None:
        """Run one request of `batch` on the engine as BE; None when the engine failed (not the
        request), so the item stays pending and runs again."""
        endpoint = ENDPOINTS[batch.endpoint]
        def prepare() -> tuple[Any, list[Generation]]:
            body: Any = parse_body(item.body, batch.endpoint)  # has `model`
            check_batch_line(body)  # (an item an older server checked may ask for a session)
            return body, endpoint.prepare(self.chat, body, batch.owner)

        try:
            # (off the event loop, on the batch items' own render thread)
            body, gens = await self.chat.off_loop(prepare, request_class=RequestClass.BE)
            await run_choices(self.chat, gens, api="batch")
        except ApiError as err:
            if err.http_status < 500:
                return ItemResult(None, None, err.code.value,
                                  f"line {item.line_index + 1}: {err.message}",
                                  status_code=err.http_status)
            logger.warning("batch item %r: %s; it will run again", item.custom_id, err.message)
            self._paused_until = time.monotonic() + RETRY_DELAY_S
            return None
        return ItemResult(gens[0].request_id, json.dumps(
            endpoint.response(gens, body.model), ensure_ascii=False))

    async def _abort(self, keys: list[ItemKey]) -> None:
        tasks = [self._inflight[k] for k in keys if k in self._inflight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _finalize(self, b: Batch) -> None:
        """Write the result files from committed results and finish the batch. Files of a
        try that failed go (the next step writes them anew under fresh ids): each retry
        against a full disk left a whole copy of the results behind until a restart."""
        written: list[FileRecord] = []
        try:
            output = await asyncio.to_thread(self._write_results, b, ItemState.SUCCEEDED,
                                             "output")
            written += [output] if output else []
            error = await asyncio.to_thread(self._write_results, b, ItemState.FAILED, "error")
            written += [error] if error else []
            await asyncio.to_thread(self.store.finish_batch, b, output, error)
        except Exception:  # not registered: finish_batch's transaction did not commit
            for record in written:
                self.files.path(record.file_id).unlink(missing_ok=True)
            raise
        logger.info("batch %s %s", b.batch_id, b.final_status)

    def _write_results(self, b: Batch, state: ItemState, kind: str) -> FileRecord | None:
        """The JSONL file of the batch's results in `state`, durable; None when there are none.
        Blocking: run it in a thread."""
        file_id = new_file_id()
        with self.files.create(file_id) as writer:
            for line_index, custom_id, result in self.store.results(b.batch_id, state):
                writer.write(result.to_line(b.batch_id, line_index, custom_id).encode())
            if writer.num_bytes == 0:
                return None
            writer.commit()
        return FileRecord(file_id, b.owner, "batch_output", f"{b.batch_id}_{kind}.jsonl",
                          writer.num_bytes, time.time())


def _num_choices(batch: Batch, item: PendingItem, most: int) -> int:
    """The engine requests `item` runs (its choices: `n`, times a text completion's prompts),
    at most `most`: an item asking for more than --max-batch-concurrency runs once nothing
    else does. 1 for a body that does not parse (it fails alone when it runs)."""
    try:
        body = ENDPOINTS[batch.endpoint].request.model_validate_json(item.body)
    except ValueError:
        return 1
    return min(most, body.num_choices)
