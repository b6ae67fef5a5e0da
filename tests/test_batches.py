"""The Batch API over a live server and a scripted engine: the official openai client, bad lines,
owners, cancel, limits, the CLI, and a kill -9 in the middle of a batch."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from antiphon.bench.serverproc import ServerProcess
from antiphon.cli import main
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.server.batch_store import BatchStore
from antiphon.server.batch_types import BatchStatus
from antiphon.server.config import ServerConfig
from antiphon.server.file_store import FileStore
from tests.conftest import scripted_config
from tests.liveserver import live_server, running_server

ROOT = Path(__file__).resolve().parent.parent
FINISHED = ("completed", "failed", "expired", "cancelled")


@dataclasses.dataclass
class Live:
    url: str
    engine: ScriptedEngine
    data_dir: Path

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


@contextmanager
def batch_server(data_dir: Path, token_delay_s: float = 0.0, max_model_len: int = 4096,
                 **server: Any) -> Iterator[Live]:
    engine = ScriptedEngine(token_delay_s=token_delay_s, max_model_len=max_model_len)
    with live_server(scripted_config(data_dir, **server), engine) as url:
        yield Live(url, engine, data_dir)
    check_stores(data_dir)


def check_stores(data_dir: Path) -> None:
    store = BatchStore(data_dir / "batches.sqlite3")
    try:
        store.check_integrity()
        FileStore(data_dir / "files").check_integrity(store.file_sizes())
    finally:
        store.close()


def request_line(custom_id: str, content: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "scripted",
                                "messages": [{"role": "user", "content": content}], **body}})


def jsonl(n: int) -> bytes:
    return "".join(request_line(f"item-{i}", f"doc {i}") + "\n" for i in range(n)).encode()


def submit(client: openai.OpenAI, data: bytes) -> str:
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    return batch.id


def wait_finished(url: str, batch_id: str, timeout_s: float = 30.0,
                  headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch: dict[str, Any] = httpx.get(f"{url}/v1/batches/{batch_id}", headers=headers).json()
        if batch["status"] in FINISHED:
            return batch
        time.sleep(0.02)
    raise TimeoutError(f"batch {batch_id} did not finish: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_round_trip_with_the_openai_client(tmp_path: Path) -> None:
    with batch_server(tmp_path, token_delay_s=0.001) as live:
        client = live.client()
        batch_id = submit(client, jsonl(30))
        wait_finished(live.url, batch_id)
        batch = client.batches.retrieve(batch_id)
        assert batch.status == "completed" and batch.error_file_id is None
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed) == (30, 30)
        assert batch.in_progress_at and batch.completed_at and batch.finalizing_at
        out = lines_of(client, batch.output_file_id)
        assert [r["custom_id"] for r in out] == [f"item-{i}" for i in range(30)]
        first = out[0]
        assert first["error"] is None and first["response"]["status_code"] == 200
        assert first["response"]["body"]["object"] == "chat.completion"
        assert first["response"]["body"]["choices"][0]["message"]["content"] == "You said: doc 0"
        output_file = client.files.retrieve(batch.output_file_id)  # type: ignore[arg-type]
        assert output_file.purpose == "batch_output" and output_file.bytes > 0
        assert [b.id for b in client.batches.list()] == [batch_id]
        metrics = httpx.get(live.url + "/metrics").text
        assert 'antiphon_batch_items_total{outcome="completed"} 30.0' in metrics
        assert ('antiphon_requests_total{api="batch",outcome="ok",request_class="be"} 30.0'
                in metrics)
        assert 'antiphon_generation_tokens_total{request_class="be"} 120.0' in metrics
        assert "antiphon_batch_queue_items 0.0" in metrics


def test_a_finished_batch_keeps_its_requests_and_answers_only_in_its_files(
        tmp_path: Path) -> None:
    # Each item's request and answer stayed in the database for good: deleting the input and
    # the output file left every prompt and reply on disk, outside the key's quota of stored
    # bytes (found by a review).
    with batch_server(tmp_path) as live:
        client = live.client()
        data = "".join(request_line(f"i{i}", f"SECRET-{i}") + "\n" for i in range(5)).encode()
        batch_id = submit(client, data)
        batch = wait_finished(live.url, batch_id)
        assert batch["status"] == "completed"
        out = lines_of(client, batch["output_file_id"])
        assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == \
            "You said: SECRET-0"
        client.files.delete(batch["input_file_id"])
        client.files.delete(batch["output_file_id"])
    for path in tmp_path.glob("batches.sqlite3*"):
        assert b"SECRET" not in path.read_bytes(), path.name


def test_a_batch_of_text_completions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A batch whose endpoint is /v1/completions: its lines are text completions (plain
    prompts, run as BE), answered with text_completion bodies; a line naming another url, or
    a body /v1/completions refuses, fails alone. The CLI takes the endpoint from the file."""
    def text_line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                           "body": {"model": "scripted", "prompt": f"doc {custom_id}",
                                    **body}}) + "\n"

    data = (text_line("a") + text_line("b", max_tokens=2) + text_line("c", echo=True, n=2)
            + text_line("d", url="/v1/chat/completions") + text_line("e", suffix="x")).encode()
    with batch_server(tmp_path / "data", token_delay_s=0.001) as live:
        client = live.client()
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert batch.endpoint == "/v1/completions"
        done = wait_finished(live.url, batch.id)
        assert done["status"] == "completed" and done["endpoint"] == "/v1/completions"
        assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
        out = {r["custom_id"]: r for r in lines_of(client, done["output_file_id"])}
        body = out["a"]["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == "You said: doc a"
        assert out["b"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
        assert [(c["index"], c["text"]) for c in out["c"]["response"]["body"]["choices"]] == [
            (i, "doc cYou said: doc c") for i in range(2)]  # echo, n 2
        errors = {r["custom_id"]: r["error"] for r in lines_of(client, done["error_file_id"])}
        assert "suffix is not supported" in errors["e"]["message"]
        assert errors["d"]["code"] == "unsupported_url"
        assert all(p.request_class.value == "be" for p in live.engine.params)

        path = tmp_path / "texts.jsonl"  # the CLI names the endpoint of the file's lines
        path.write_text(text_line("x") + text_line("y"))
        assert main(["batch", "submit", str(path), "--wait", "--poll-interval", "0.05",
                     "--url", live.url]) == 0
        assert "2/2 completed, 0 failed (completed)" in capsys.readouterr().out
        assert client.batches.list().data[0].endpoint == "/v1/completions"
        r = httpx.post(live.url + "/v1/batches", json={
            "input_file_id": uploaded.id, "endpoint": "/v1/embeddings",
            "completion_window": "24h"})
        assert r.status_code == 400 and "'/v1/completions'" in r.json()["error"]["message"]


def test_each_choice_of_a_line_counts_against_the_batch_concurrency(tmp_path: Path) -> None:
    """--max-batch-concurrency bounds the engine requests batches run, and a line asking for
    several choices runs one per choice: lines of 2 choices run one at a time under a limit
    of 3 (not 3 lines, 6 requests), and a line of 4 runs once nothing else does. Every line
    completes."""
    def line(i: int, n: int) -> str:
        return json.dumps({"custom_id": f"x{i}", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "scripted", "prompt": f"doc {i} " * 10, "n": n,
                                    "max_tokens": 12}}) + "\n"

    data = "".join(line(i, 4 if i == 4 else 2) for i in range(5)).encode()
    with batch_server(tmp_path / "data", token_delay_s=0.02, max_batch_concurrency=3) as live:
        client = live.client()
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        seen = []  # engine requests running, while lines of 2 run, then while the line of 4
        while client.batches.retrieve(batch.id).status not in ("completed", "failed"):
            seen.append(len(live.engine.active_request_ids))
            time.sleep(0.005)
        done = wait_finished(live.url, batch.id)
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    first_of_4 = seen.index(4)
    assert max(seen[:first_of_4]) == 2 and max(seen[first_of_4:]) == 4, seen


def test_files_are_listed_as_the_openai_client_pages_them(tmp_path: Path) -> None:
    with batch_server(tmp_path, token_delay_s=0.001) as live:
        client = live.client()
        inputs = [client.files.create(file=(f"in{i}.jsonl", jsonl(1)), purpose="batch").id
                  for i in range(5)]
        batch_id = submit(client, jsonl(2))
        batch = client.batches.retrieve(wait_finished(live.url, batch_id)["id"])
        every = [f.id for f in client.files.list()]  # the SDK follows has_more and after
        assert every[0] == batch.output_file_id and every[-5:] == inputs[::-1]
        assert len(every) == 7  # five inputs, the batch's input and its output
        assert [f.id for f in client.files.list(purpose="batch_output")] == [batch.output_file_id]
        pages = client.files.list(limit=2, order="asc")
        assert [f.id for f in pages.data] == inputs[:2] and pages.has_more
        assert [f.id for f in pages.iter_pages().__next__().data] == inputs[:2]
        assert [f.id for f in client.files.list(limit=2, order="asc", after=inputs[1]).data] == (
            inputs[2:4])
        client.files.delete(inputs[0])
        assert inputs[0] not in [f.id for f in client.files.list()]
        # the model, by name, as the SDK retrieves it
        assert client.models.retrieve("scripted").id == "scripted"
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
            client.models.retrieve("gpt-4")


def test_malformed_lines_fail_individually(tmp_path: Path) -> None:
    lines = [request_line("ok-1", "fine"), "{not json", json.dumps({"method": "POST"}),
             request_line("ok-1", "again"), request_line("url", "x").replace(
                 "/v1/chat/completions", "/v1/embeddings"),
             request_line("body", "x", temperature=9), request_line("big", "x", max_tokens=500),
             request_line("context", "y" * 400), "", request_line("ok-2", "also fine")]
    with batch_server(tmp_path, max_model_len=300, max_tokens_limit=100,
                      default_max_tokens=100) as live:
        client = live.client()
        batch_id = submit(client, ("\n".join(lines) + "\n").encode())
        wait_finished(live.url, batch_id)
        batch = client.batches.retrieve(batch_id)
        assert batch.status == "completed" and batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed,
                batch.request_counts.failed) == (9, 2, 7)
        assert [r["custom_id"] for r in lines_of(client, batch.output_file_id)] == [
            "ok-1", "ok-2"]
        *errors, refused = lines_of(client, batch.error_file_id)
        assert all(r["response"] is None and r["id"].startswith("batch_req_") for r in errors)
        assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
            (None, "bad_json"), (None, "missing_custom_id"), (None, "duplicate_custom_id"),
            ("url", "unsupported_url"), ("body", "bad_message"), ("big", "max_tokens_too_large")]
        assert errors[0]["error"]["message"].startswith("line 2: ")
        # A request the endpoint refused when it ran is its HTTP answer, as OpenAI writes it
        # (`error` is for failures with none).
        assert refused["custom_id"] == "context" and refused["error"] is None
        assert refused["response"]["status_code"] == 400
        assert refused["response"]["body"]["error"]["code"] == "context_length_exceeded"
        assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"
        listed = httpx.get(f"{live.url}/v1/batches/{batch_id}/errors", params={"limit": 2})
        assert listed.json()["has_more"] is True
        assert [(e["line"], e["custom_id"], e["code"]) for e in listed.json()["data"]] == [
            (2, None, "bad_json"), (3, None, "missing_custom_id")]
        assert httpx.get(f"{live.url}/v1/batches/batch_x/errors").status_code == 404


def test_owner_isolation(tmp_path: Path) -> None:
    alice, bob = "alice-key-123", "bob-key-4567"
    with batch_server(tmp_path, api_keys=(alice, bob)) as live:
        batch_id = submit(live.client(alice), jsonl(3))
        file_id = live.client(alice).batches.retrieve(batch_id).input_file_id
        other = live.client(bob)
        for call in (lambda: other.files.retrieve(file_id),
                     lambda: other.files.content(file_id),
                     lambda: other.batches.retrieve(batch_id),
                     lambda: other.batches.cancel(batch_id),
                     lambda: other.batches.create(input_file_id=file_id, completion_window="24h",
                                                  endpoint="/v1/chat/completions")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert list(other.batches.list()) == [] and list(other.files.list()) == []
        assert file_id in [f.id for f in live.client(alice).files.list()]
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong-key-000").batches.retrieve(batch_id)
        batch = wait_finished(live.url, batch_id, headers={"Authorization": f"Bearer {alice}"})
        assert batch["status"] == "completed"


def test_cancel_aborts_running_items_and_keeps_partial_results(tmp_path: Path) -> None:
    with batch_server(tmp_path, token_delay_s=0.03, max_batch_concurrency=2) as live:
        client = live.client()
        batch_id = submit(client, jsonl(40))
        while (client.batches.retrieve(batch_id).request_counts or
               pytest.fail("no counts")).completed < 3 or not live.engine.active_request_ids:
            time.sleep(0.005)  # until items are done and others running
        cancelled = client.batches.cancel(batch_id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
        batch = wait_finished(live.url, batch_id)
        assert batch["status"] == "cancelled" and batch["cancelled_at"]
        counts = batch["request_counts"]
        assert counts["total"] == 40 and 3 <= counts["completed"] < 40
        assert len(lines_of(client, batch["output_file_id"])) == counts["completed"]
        # the items it never ran (or stopped) are in its error file, as OpenAI lists them
        assert counts["failed"] == 40 - counts["completed"]
        unrun = lines_of(client, batch["error_file_id"])
        assert len(unrun) == counts["failed"] and all(
            line["response"] is None and line["error"]["code"] == "batch_cancelled"
            for line in unrun)
        ids = [line["custom_id"] for line in unrun + lines_of(client, batch["output_file_id"])]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 40  # each item once
        assert not live.engine.active_request_ids
        assert client.batches.cancel(batch_id).status == "cancelled"  # idempotent
        done_id = submit(client, jsonl(1))
        wait_finished(live.url, done_id)
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(done_id)


def test_upload_and_create_limits(tmp_path: Path) -> None:
    with batch_server(tmp_path, max_batch_file_bytes=2000, max_batch_items=5) as live:
        client, files_dir = live.client(), tmp_path / "files"

        def refused(status: int, code: str, **kwargs: Any) -> None:
            r = httpx.post(live.url + "/v1/files", **kwargs)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text

        refused(413, "too_large", files={"file": ("a.jsonl", b"x" * 3000)},
                data={"purpose": "batch"})
        refused(413, "too_many_items", files={"file": ("a.jsonl", b"{}\n" * 6)},
                data={"purpose": "batch"})
        refused(400, "bad_message", files={"file": ("a.jsonl", b"{}\n")},
                data={"purpose": "fine-tune"})
        refused(400, "bad_message", data={"purpose": "batch"}, files={"other": ("a", b"x")})
        refused(400, "bad_message", json={"purpose": "batch"})
        assert list(files_dir.iterdir()) == []  # refused uploads leave nothing behind

        file_id = client.files.create(file=("a.jsonl", b"\n{}\n\n" + b"{}\n" * 4),
                                      purpose="batch").id
        for kwargs, error in (({"endpoint": "/v1/embeddings"}, openai.BadRequestError),
                              ({"completion_window": "1h"}, openai.BadRequestError),
                              ({"input_file_id": "file-nope"}, openai.NotFoundError)):
            args: dict[str, Any] = {"input_file_id": file_id, "completion_window": "24h",
                                    "endpoint": "/v1/chat/completions", **kwargs}
            with pytest.raises(error):
                client.batches.create(**args)
        assert httpx.get(live.url + "/v1/batches?limit=0").status_code == 400


def test_stored_files_are_limited_per_key(tmp_path: Path) -> None:
    one = jsonl(3)

    def refused(client: openai.OpenAI, data: bytes) -> None:
        with pytest.raises(openai.APIStatusError) as error:
            client.files.create(file=("c.jsonl", data), purpose="batch")
        assert error.value.status_code == 413
        assert "--max-stored-file-bytes" in error.value.message

    with batch_server(tmp_path, max_stored_file_bytes=2 * len(one)) as live:
        client = live.client()
        first = client.files.create(file=("a.jsonl", one), purpose="batch")
        client.files.create(file=("b.jsonl", one), purpose="batch")
        refused(client, b"{}\n")  # no room left at all
        client.files.delete(first.id)  # room for one more like it, and no more
        refused(client, jsonl(4))  # found too large while it streams in
        assert client.files.create(file=("c.jsonl", one), purpose="batch").bytes == len(one)


def test_files_are_limited_in_number_per_key_and_none_is_empty(tmp_path: Path) -> None:
    # An empty file cost nothing of the stored bytes, and a key's files had no limit in
    # number: each one a file on disk and a row read at every start (found by a review).
    with batch_server(tmp_path, max_files_per_key=2, max_stored_file_bytes=10_000) as live:
        client = live.client()
        with pytest.raises(openai.BadRequestError, match="empty"):
            client.files.create(file=("e.jsonl", b""), purpose="batch")
        first = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
        client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
        with pytest.raises(openai.RateLimitError, match="--max-files-per-key"):
            client.files.create(file=("c.jsonl", b"{}\n"), purpose="batch")
        assert len(client.files.list().data) == 2
        client.files.delete(first.id)
        client.files.create(file=("c.jsonl", b"{}\n"), purpose="batch")
    assert len(list((tmp_path / "files").iterdir())) == 2


def test_batches_cannot_take_a_key_past_its_files(tmp_path: Path) -> None:
    """Each finished batch keeps its output and error files: batches made again and again
    from one input took a key's files past --max-files-per-key without end (found by a
    review). A batch is refused once the key keeps that many; the running ones may finish."""
    with batch_server(tmp_path, max_files_per_key=3) as live:
        client = live.client()
        uploaded = client.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
        first = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        assert wait_finished(live.url, first.id)["status"] == "completed"
        second = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                       endpoint="/v1/chat/completions")
        assert wait_finished(live.url, second.id)["status"] == "completed"
        assert len(client.files.list().data) == 3  # the input and two outputs
        with pytest.raises(openai.RateLimitError, match="--max-files-per-key") as refused:
            client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                  endpoint="/v1/chat/completions")
        assert refused.value.code == "too_many_files"
        # (a refusal that holds until files are deleted: the openai client does not resend it)
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert len(client.batches.list().data) == 2 and len(client.files.list().data) == 3


def test_a_finished_batchs_items_go_with_its_last_result_file(tmp_path: Path) -> None:
    """A finished batch's items (custom ids, errors) stayed in the database for good, outside
    the key's quota: a key could run and clear away batches until the disk filled (found by
    a review). Deleting the last of its result files deletes them; the batch keeps its
    counts, and nothing else is touched."""
    bad = json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                      "body": {}})
    with batch_server(tmp_path) as live:
        client = live.client()
        batch_id = submit(client, jsonl(2) + (bad + "\n").encode())
        other_id = submit(client, jsonl(1) + (bad + "\n").encode())
        for b in (batch_id, other_id):
            wait_finished(live.url, b)
        batch = client.batches.retrieve(batch_id)
        assert batch.output_file_id and batch.error_file_id

        def errors() -> list[dict[str, Any]]:
            listed: list[dict[str, Any]] = httpx.get(
                f"{live.url}/v1/batches/{batch_id}/errors").json()["data"]
            return listed

        def items(b: str) -> int:
            store = BatchStore(tmp_path / "batches.sqlite3")
            try:
                with store.db.locked() as db:
                    (n,) = db.execute("SELECT COUNT(*) FROM items WHERE batch_id = ?",
                                      (b,)).fetchone()
                return int(n)
            finally:
                store.close()

        client.files.delete(batch.output_file_id)
        assert [e["custom_id"] for e in errors()] == ["bad"] and items(batch_id) == 3
        client.files.delete(batch.error_file_id)
        assert errors() == [] and items(batch_id) == 0
        kept = client.batches.retrieve(batch_id)
        assert kept.status == "completed" and kept.request_counts is not None
        assert (kept.request_counts.total, kept.request_counts.completed,
                kept.request_counts.failed) == (3, 2, 1)
        assert items(other_id) == 2  # another batch's are its own
    # (check_stores: the integrity checks hold over a batch without its items)


def test_uploads_in_flight_together_cannot_pass_the_stored_bytes_limit(tmp_path: Path) -> None:
    """Two uploads that each fit alone stream in at the same time: one is kept, the other is
    refused at the end, and nothing of it stays on disk."""
    one = jsonl(3)
    boundary = "antiphon-test"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"a.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def slow_body() -> Iterator[bytes]:
        yield head + one[:10]
        time.sleep(0.5)  # both uploads are past the first check and streaming now
        yield one[10:] + tail

    with batch_server(tmp_path, max_stored_file_bytes=len(one) * 3 // 2) as live:
        def upload() -> httpx.Response:
            return httpx.post(live.url + "/v1/files", content=slow_body(), headers={
                "content-type": f"multipart/form-data; boundary={boundary}"}, timeout=30)

        with ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(lambda _: upload(), range(2)))
        assert sorted(r.status_code for r in responses) == [200, 413], [r.text for r in responses]
        refused = next(r for r in responses if r.status_code == 413)
        assert "--max-stored-file-bytes" in refused.json()["error"]["message"]
        kept = next(r for r in responses if r.status_code == 200).json()
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f"{kept['id']}.jsonl"]
        assert live.client().files.retrieve(kept["id"]).bytes == len(one)


def test_empty_input_fails_the_batch(tmp_path: Path) -> None:
    with batch_server(tmp_path) as live:
        client = live.client()
        batch_id = submit(client, b"\n \n")
        batch = wait_finished(live.url, batch_id)
        assert batch["status"] == "failed" and batch["failed_at"]
        assert batch["errors"]["data"][0]["code"] == "invalid_file"


def test_cli_submit_wait_status_results_cancel(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(12))
    with batch_server(tmp_path / "data", token_delay_s=0.005) as live:
        url = ["--url", live.url]
        assert main(["batch", "submit", str(path), "--wait", "--poll-interval", "0.05",
                     *url]) == 0
        out = capsys.readouterr().out
        assert "12/12 completed, 0 failed (completed)" in out
        batch_id = out.split()[1]
        results = tmp_path / "docs.results.jsonl"
        assert len(results.read_text().splitlines()) == 12
        assert main(["batch", "status", batch_id, *url]) == 0
        assert "[" + "#" * 30 + "] 12/12 completed" in capsys.readouterr().out
        assert main(["batch", "results", batch_id, "--out", str(tmp_path / "r.jsonl"),
                     *url]) == 0
        assert (tmp_path / "r.jsonl").read_bytes() == results.read_bytes()
        assert main(["batch", "cancel", batch_id, *url]) == 1
        assert "batch_not_cancellable" in capsys.readouterr().err
        assert main(["batch", "status", "batch_nope", *url]) == 1
        assert "HTTP 404: batch_not_found" in capsys.readouterr().err

        mixed = tmp_path / "mixed.jsonl"  # a line that is not JSON fails alone
        mixed.write_bytes(jsonl(3) + b"{not json\n")
        assert main(["batch", "submit", str(mixed), "--wait", "--poll-interval", "0.05",
                     *url]) == 3
        out = capsys.readouterr().out
        assert "3/4 completed, 1 failed (completed)" in out
        assert "1 of 4 items failed; their errors are in the results" in out
        assert len((tmp_path / "mixed.results.jsonl").read_text().splitlines()) == 4
        assert main(["batch", "status", out.split()[1], "--wait", *url]) == 3
        assert main(["batch", "status", out.split()[1], *url]) == 0  # a look, not a wait


def test_cli_results_of_a_batch_that_failed_before_any_item_ran(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Such a batch has no result files: the download wrote an empty file over the results
    an earlier download had left there, and `results` exited 0."""
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n \n")  # no requests: the batch fails
    earlier = tmp_path / "docs.results.jsonl"
    earlier.write_text('{"custom_id": "a"}\n')
    with batch_server(tmp_path / "data") as live:
        url = ["--url", live.url]
        assert main(["batch", "submit", str(path), "--wait", "--poll-interval", "0.05",
                     *url]) == 1
        out = capsys.readouterr().out
        assert "no results: the batch failed before any item ran" in out
        assert earlier.read_text() == '{"custom_id": "a"}\n'
        assert main(["batch", "results", out.split()[1], "--out", str(earlier), *url]) == 1
        assert earlier.read_text() == '{"custom_id": "a"}\n'


def is_mid_batch(url: str, batch_id: str, min_completed: int) -> bool:
    """At least `min_completed` items answered and some running on the engine right now (an
    item takes 80 ms, so they are still running when the kill lands a moment later)."""
    counts = httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]
    return (counts["completed"] >= min_completed
            and httpx.get(url + "/healthz").json()["num_unfinished_requests"] > 0)


def test_kill_9_mid_batch_resumes_without_losing_or_repeating_items(tmp_path: Path) -> None:
    n = 200
    cmd = [sys.executable, "-m", "tests.batchserver", "--data-dir", str(tmp_path),
           "--token-delay", "0.02", "--concurrency", "8"]
    env = {"PYTHONPATH": str(ROOT)}
    db = tmp_path / "batches.sqlite3"
    first = ServerProcess(cmd, log_path=tmp_path / "first.log", start_timeout_s=60, env=env)
    first.start()
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        batch_id = submit(client, jsonl(n))
        deadline = time.monotonic() + 30
        while not is_mid_batch(first.url, batch_id, n // 5):
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.005)
    finally:
        first.stop(signal.SIGKILL)
    store = BatchStore(db)
    at_kill = store.get_batch("local", batch_id)
    store.close()
    assert at_kill is not None and at_kill.status == BatchStatus.IN_PROGRESS
    assert n // 5 <= at_kill.counts.completed < n

    with ServerProcess(cmd, log_path=tmp_path / "second.log", start_timeout_s=60,
                       env=env) as second:
        batch = wait_finished(second.url, batch_id)
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
        out = lines_of(client, batch["output_file_id"])
    assert batch["status"] == "completed" and batch["error_file_id"] is None
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
    custom_ids = [r["custom_id"] for r in out]
    assert len(out) == n and sorted(custom_ids) == sorted(f"item-{i}" for i in range(n))
    for r in out:
        i = r["custom_id"].removeprefix("item-")
        assert r["response"]["body"]["choices"][0]["message"]["content"] == f"You said: doc {i}"
    store = BatchStore(db)
    counts = store.commit_counts(batch_id)
    store.close()
    assert len(counts) == n and all(commits == 1 for _, commits in counts.values())
    rerun = [i for i, (attempts, _) in counts.items() if attempts > 1]
    assert rerun, "no item was in flight at the kill"  # those ran again, answered once
    assert not list((tmp_path / "files").glob("*.part"))
    check_stores(tmp_path)
    assert os.path.getsize(tmp_path / "files" / (batch["output_file_id"] + ".jsonl")) > 0


def submit_until_a_fifth_is_done(url: str, n: int) -> str:
    """Submit a batch of `n` items; return its id once a fifth of them is done."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    batch_id = submit(client, jsonl(n))
    deadline = time.monotonic() + 30
    while not is_mid_batch(url, batch_id, n // 5):
        assert time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.005)
    return batch_id


def test_a_dead_engine_stops_the_server_and_its_batch_resumes_after_the_restart(
        tmp_path: Path) -> None:
    """An engine that dies for good (vLLM's process killed for memory, say) shuts the server
    down (`antiphon serve` then exits 1, for a supervisor to restart it) instead of leaving it
    up to fail every request: before, the runner kept starting the batch's items into the dead
    engine until each had used up its attempts, and the batch completed with them failed."""
    n = 40
    engine = ScriptedEngine(token_delay_s=0.02)
    with running_server(scripted_config(tmp_path), engine) as (url, server):
        batch_id = submit_until_a_fifth_is_done(url, n)
        engine.die()
        deadline = time.monotonic() + 10
        while not server.should_exit:
            assert time.monotonic() < deadline, "the server did not shut down"
            time.sleep(0.01)
        assert server.exit_status == 1
    store = BatchStore(tmp_path / "batches.sqlite3")
    at_death = store.get_batch("local", batch_id)
    store.close()
    assert at_death is not None and at_death.status == BatchStatus.IN_PROGRESS
    assert n // 5 <= at_death.counts.completed < n and at_death.counts.failed == 0

    with batch_server(tmp_path, token_delay_s=0.001) as live:
        batch = wait_finished(live.url, batch_id)
        out = lines_of(live.client(), batch["output_file_id"])
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert sorted(r["custom_id"] for r in out) == sorted(f"item-{i}" for i in range(n))


def test_items_the_engine_fails_as_it_stops_with_the_server_are_not_held_against_them(
        tmp_path: Path) -> None:
    """Ctrl-C in a terminal, or systemd's default KillMode, signals vLLM's engine processes
    with the server, and they stop at once: the items they were running failed. Those starts
    counted towards the three an item gets, so three such restarts failed a batch's items."""
    n = 40
    engine = ScriptedEngine(token_delay_s=0.02)
    with running_server(scripted_config(tmp_path), engine) as (url, server):
        batch_id = submit_until_a_fifth_is_done(url, n)
        server.handle_exit(signal.SIGINT, None)  # the server's share of the signal
        engine.die()  # the engine's
    assert server.exit_status == 0  # the engine stopped on the signal: no failure
    store = BatchStore(tmp_path / "batches.sqlite3")
    try:
        pending = store.pending_items(batch_id, n)
    finally:
        store.close()
    assert pending and all(item.num_attempts == 0 for item in pending), pending


class PoisonedEngine(ScriptedEngine):
    """Dies, as vLLM's engine process would, whenever it runs a prompt holding "poison"."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: Any) -> Any:
        async for delta in super().generate(request_id, prompt_token_ids, params):
            if "poison" in self.decode(prompt_token_ids):
                self.die()
            yield delta


def test_a_request_that_kills_the_engine_fails_alone(tmp_path: Path) -> None:
    """A batch line that crashes the engine every time it runs: the server restarts after
    each crash (as a supervisor would), the line fails after its attempts, and every other
    line is answered. Before, the items running beside it at each crash were the same ones
    each time (the lowest pending lines), and failed with it."""
    n = 12
    lines = [request_line(f"item-{i}", "poison" if i == 2 else f"doc {i}") for i in range(n)]
    batch_id, batch = None, {}
    for _restart in range(ServerConfig().max_batch_item_attempts + 2):
        engine = PoisonedEngine(token_delay_s=0.02)
        with running_server(scripted_config(tmp_path), engine) as (url, server):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            if batch_id is None:
                batch_id = submit(client, "".join(line + "\n" for line in lines).encode())
            deadline = time.monotonic() + 30
            while not server.should_exit:  # until the engine dies and the server shuts down
                with contextlib.suppress(httpx.TransportError):  # it is shutting down
                    batch = httpx.get(f"{url}/v1/batches/{batch_id}").json()
                if batch.get("status") in FINISHED:
                    break
                assert time.monotonic() < deadline, "neither finished nor crashed"
                time.sleep(0.02)
        if batch.get("status") in FINISHED:
            break
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": n, "completed": n - 1, "failed": 1}
    check_stores(tmp_path)


def test_lines_no_part_of_the_server_could_use_fail_alone(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    lines = [request_line("ok-1", "fine"),
             '{"custom_id": "deep", "method": "POST", "x": ' + deep + "}",
             '{"custom_id": "digits", "x": 1' + "0" * 5000 + "}",
             request_line("surrogate", "a\ud800b"),
             request_line("seed", "x", seed=2**70),
             request_line("slo", "x", vllm_xargs={"ttft_slo_s": -1}),
             json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/chat/completions"}),
             # deep enough for Python's JSON parser, too deep for the one an item runs from
             # (it failed when it ran, was taken for a crash and ran three times)
             request_line("nested", "x", tools=[{"type": "function", "function": {
                 "name": "f", "parameters": json.loads('{"a": ' * 300 + "1" + "}" * 300)}}]),
             request_line("ok-2", "also fine")]
    with batch_server(tmp_path) as live:
        client = live.client()
        batch = wait_finished(live.url, submit(client, ("\n".join(lines) + "\n").encode()))
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 9, "completed": 2, "failed": 7}
        errors = [(r["custom_id"], r["error"]["code"], r["error"]["message"].split(":")[0])
                  for r in lines_of(client, batch["error_file_id"])]
        assert errors == [
            (None, "bad_json", "line 2"), (None, "bad_json", "line 3"),
            (None, "bad_json", "line 4"), ("seed", "bad_message", "line 5"),
            ("slo", "bad_message", "line 6"), ("nobody", "bad_message", "line 7"),
            ("nested", "bad_json", "line 8")]
        assert len(live.engine.request_prompts) == 2


def test_lines_asking_for_a_session_or_rt_work_are_refused(tmp_path: Path) -> None:
    """A batch line runs as BE work in no session: one that asks otherwise fails, where it ran
    as a plain BE request (a session that did not exist, too), its ask unheeded."""
    lines = [request_line("session", "x", vllm_xargs={"session_id": "s_nowhere"}),
             request_line("rt", "x", vllm_xargs={"request_class": "rt"}),
             request_line("be", "x", vllm_xargs={"request_class": "be"}),
             request_line("none", "x", vllm_xargs={"session_id": None})]  # (no session)
    text = json.dumps({"custom_id": "text-rt", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "scripted", "prompt": "x",
                                "vllm_xargs": {"request_class": "rt"}}})
    with batch_server(tmp_path) as live:
        client = live.client()
        batch = wait_finished(live.url, submit(client, ("\n".join(lines) + "\n").encode()))
        assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
        assert [(r["custom_id"], r["error"]["code"], r["error"]["message"].split(":")[1])
                for r in lines_of(client, batch["error_file_id"])] == [
            ("session", "bad_message", " vllm_xargs.session_id"),
            ("rt", "bad_message", " vllm_xargs.request_class")]
        uploaded = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                        completion_window="24h")
        batch = wait_finished(live.url, created.id)
        assert [r["error"]["code"] for r in lines_of(client, batch["error_file_id"])] == [
            "bad_message"]


def test_uploads_that_end_early_or_hide_a_line_are_refused(tmp_path: Path) -> None:
    with batch_server(tmp_path, max_batch_items=5) as live:
        def refused(body: bytes, headers: dict[str, str]) -> tuple[int, str]:
            r = httpx.post(live.url + "/v1/files", content=body, headers=headers)
            return r.status_code, r.json()["error"]["code"]

        lines = b"\n".join(request_line(f"i{i}", "x").encode() for i in range(6))  # no last \n
        files = {"file": ("a.jsonl", lines)}
        r = httpx.post(live.url + "/v1/files", files=files, data={"purpose": "batch"})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "too_many_items")
        boundary = "b0undary"
        cut = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
               f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"a.jsonl\"\r\n\r\n").encode() + lines[:150]
        assert refused(cut, {"content-type": f"multipart/form-data; boundary={boundary}"}) == (
            400, "bad_message")
        assert list((tmp_path / "files").iterdir()) == []


def test_files_can_be_deleted_once_no_running_batch_reads_them(tmp_path: Path) -> None:
    with batch_server(tmp_path, token_delay_s=0.02) as live:
        client = live.client()
        batch_id = submit(client, jsonl(6))
        input_id = client.batches.retrieve(batch_id).input_file_id
        with pytest.raises(openai.ConflictError, match="still running"):
            client.files.delete(input_id)
        batch = wait_finished(live.url, batch_id)
        deleted = client.files.delete(batch["output_file_id"])
        assert (deleted.id, deleted.deleted) == (batch["output_file_id"], True)
        with pytest.raises(openai.NotFoundError):
            client.files.content(batch["output_file_id"])
        assert client.files.delete(input_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.delete(input_id)
        assert list((tmp_path / "files").iterdir()) == []
        assert client.batches.retrieve(batch_id).status == "completed"


def test_batches_too_are_limited_per_key(tmp_path: Path) -> None:
    """A key's batches write results, which count against its stored bytes: with no room
    left, no batch is created (before, any number could be created from one input file, each
    writing its results past the limit); and a key has at most --max-unfinished-batches
    batches not finished."""
    one = jsonl(3)
    with batch_server(tmp_path, token_delay_s=0.05, max_stored_file_bytes=len(one),
                      max_unfinished_batches=2) as live:
        client = live.client()
        file_id = client.files.create(file=("a.jsonl", one), purpose="batch").id
        with pytest.raises(openai.APIStatusError) as full:
            client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        assert full.value.status_code == 413 and "results included" in full.value.message
    with batch_server(tmp_path / "two", token_delay_s=0.2, max_unfinished_batches=2) as live:
        client = live.client()
        file_id = client.files.create(file=("a.jsonl", jsonl(4)), purpose="batch").id
        batches = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as busy:
            client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        assert "--max-unfinished-batches" in busy.value.message
        client.batches.cancel(batches[0])
        wait_finished(live.url, batches[0])
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # room again
        assert len(client.batches.list().data) == 3


def test_a_file_gone_from_disk_is_not_found(tmp_path: Path) -> None:
    """Its content asked for as it is deleted: a 404, not a 500 (the response opens the file
    before it starts; one deleted while it streams still reads to its end)."""
    with batch_server(tmp_path) as live:
        uploaded = httpx.post(live.url + "/v1/files", data={"purpose": "batch"},
                              files={"file": ("a.jsonl", jsonl(1))}).json()
        got = httpx.get(f"{live.url}/v1/files/{uploaded['id']}/content")
        assert (got.status_code, got.content) == (200, jsonl(1))
        assert got.headers["content-length"] == str(len(jsonl(1)))
        next((tmp_path / "files").glob(uploaded["id"] + "*")).unlink()  # deleted meanwhile
        got = httpx.get(f"{live.url}/v1/files/{uploaded['id']}/content")
        assert (got.status_code, got.json()["error"]["code"]) == (404, "file_not_found")
        assert httpx.delete(f"{live.url}/v1/files/{uploaded['id']}").status_code == 200


def test_a_refused_submit_keeps_no_upload(tmp_path: Path) -> None:
    # Its upload stayed stored, counted against the key's --max-stored-file-bytes: each
    # retry of a refused submit took more of it.
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(5))
    with batch_server(tmp_path / "data", token_delay_s=0.2, max_unfinished_batches=1) as live:
        submit(live.client(), jsonl(5))  # the key's one unfinished batch
        for _ in range(3):
            assert main(["batch", "submit", str(path), "--url", live.url]) == 1
        assert len(httpx.get(live.url + "/v1/files").json()["data"]) == 1
        for b in httpx.get(live.url + "/v1/batches").json()["data"]:
            httpx.post(f"{live.url}/v1/batches/{b['id']}/cancel")


def test_a_file_deleted_as_its_batch_is_created_gives_one_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete that lands between the create's look-up of the file and its insert: the
    create is refused (file_not_found), not a batch that fails on a file gone from disk."""
    with batch_server(tmp_path) as live:
        client = live.client()
        uploaded = client.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
        stored = BatchStore.stored

        def delete_then_count(store: BatchStore, owner: str) -> tuple[int, int]:
            assert httpx.delete(f"{live.url}/v1/files/{uploaded.id}").status_code == 200
            return stored(store, owner)

        monkeypatch.setattr(BatchStore, "stored", delete_then_count)
        with pytest.raises(openai.NotFoundError) as refused:
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        assert refused.value.body["code"] == "file_not_found"  # type: ignore[index]
        assert client.batches.list().data == []


BOUNDARY = "antiphon-test"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def form_part(name: str, value: bytes, filename: str | None = None) -> bytes:
    named = f'name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; {named}\r\n\r\n".encode()
            + value + b"\r\n")


def in_chunks(data: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    """`data` as a body without Content-Length (httpx sends an iterator chunked)."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_an_upload_body_is_bounded_also_when_chunked(tmp_path: Path) -> None:
    """A body past the file's limit and the form's room is refused by its Content-Length; sent
    chunked, it was read to its end however long: after the closing boundary, or in short
    form fields sent again and again (their number is bounded too)."""
    one = request_line("a", "hi").encode() + b"\n"
    head = form_part("purpose", b"batch") + form_part("file", one, "a.jsonl")
    end = f"--{BOUNDARY}--\r\n".encode()
    with batch_server(tmp_path, max_batch_file_bytes=1000) as live:
        def refused(body: bytes | Iterator[bytes]) -> tuple[int, str]:
            r = httpx.post(live.url + "/v1/files", content=body, headers=MULTIPART)
            return r.status_code, r.json().get("error", {}).get("message", "")

        too_large, too_many = "file exceeds 1000 bytes", "more than 8 form fields besides the file"
        epilogue = head + end + b"z" * 300_000
        assert refused(epilogue) == (413, too_large)  # by its Content-Length
        assert refused(in_chunks(epilogue)) == (413, too_large)
        padded = head + form_part("x", b"y" * 900) * 300 + end  # ~270 KiB, each field < 1 KiB
        assert refused(padded) == (413, too_large)
        # by the parts' number, or by the bytes where the first chunk read holds the room
        assert refused(in_chunks(padded)) in ((413, too_many), (413, too_large))
        assert refused(head + form_part("x", b"y") * 8 + end) == (413, too_many)
        assert list((tmp_path / "files").iterdir()) == []
        for body in (head + end, head + form_part("x", b"y") * 7 + end):  # 9 parts at most
            kept = httpx.post(live.url + "/v1/files", content=in_chunks(body),
                              headers=MULTIPART)
            assert kept.status_code == 200 and kept.json()["bytes"] == len(one), kept.text


def test_uploads_in_flight_reserve_their_room_before_they_stream(tmp_path: Path) -> None:
    """Each upload of a key in flight had the key's whole room: N of them put N times its
    --max-stored-file-bytes on disk before the last check refused all but one. Each now
    reserves its room before it streams: a chunked one what a file may take, a sized one its
    Content-Length, so small uploads still go in together."""
    one = jsonl(40)
    body = form_part("purpose", b"batch") + form_part("file", one, "a.jsonl") + (
        f"--{BOUNDARY}--\r\n".encode())
    release = threading.Event()

    def held(data: bytes) -> Iterator[bytes]:
        yield data[:-100]
        release.wait(10)
        yield data[-100:]

    def part_bytes() -> int:
        return sum(p.stat().st_size for p in (tmp_path / "files").glob("*.part"))

    quota = 2 * len(body) + 100  # two sized uploads; one chunked (a file may take it all)
    with batch_server(tmp_path, max_stored_file_bytes=quota) as live:
        def upload(sized: bool) -> httpx.Response:
            length = {"content-length": str(len(body))} if sized else {}
            return httpx.post(live.url + "/v1/files", content=held(body),
                              headers={**MULTIPART, **length}, timeout=30)

        for sized, num_kept in ((False, 1), (True, 2)):
            release.clear()
            with ThreadPoolExecutor(4) as pool:
                posts = [pool.submit(upload, sized) for _ in range(4)]
                deadline = time.monotonic() + 10
                while part_bytes() < len(body) - 1000 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)  # the others have had their chance to stream too
                on_disk = part_bytes()
                release.set()
                responses = [p.result() for p in posts]
            assert on_disk <= quota, f"{on_disk} bytes of one key's uploads on disk"
            statuses = sorted(r.status_code for r in responses)
            assert statuses == [200] * num_kept + [413] * (4 - num_kept), statuses
            refused = next(r for r in responses if r.status_code == 413)
            assert "--max-stored-file-bytes" in refused.json()["error"]["message"]
            for kept in (r for r in responses if r.status_code == 200):
                assert live.client().files.delete(kept.json()["id"]).deleted


def test_a_file_named_only_by_its_extended_filename_is_a_file(tmp_path: Path) -> None:
    # python-multipart drops `filename*`: the file was taken for a form field, and refused as
    # one too long (or as no file at all).
    one = jsonl(40)
    body = (form_part("purpose", b"batch")
            + (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
               "filename*=UTF-8''na%C3%AFve.jsonl\r\n\r\n").encode() + one + b"\r\n"
            + f"--{BOUNDARY}--\r\n".encode())
    assert len(one) > 1024
    with batch_server(tmp_path) as live:
        r = httpx.post(live.url + "/v1/files", content=body, headers=MULTIPART)
        assert r.status_code == 200, r.text
        assert r.json()["filename"] == "na\u00efve.jsonl" and r.json()["bytes"] == len(one)


def test_an_extended_filename_in_another_charset_reads_as_utf8(tmp_path: Path) -> None:
    """A charset other than RFC 5987's two decoded the name with that codec: utf-7 and
    unicode_escape gave lone surrogates, which the file's row could not hold (500)."""
    one = jsonl(2)
    with batch_server(tmp_path) as live:
        for charset, quoted, name in (("utf-7", "%2B2AA-", "+2AA-"),
                                      ("unicode_escape", "%5Cud800", "\\ud800"),
                                      ("no-such-codec", "a%C3%AF", "a\u00ef"),
                                      ("ISO-8859-1", "a%EF", "a\u00ef")):
            body = (form_part("purpose", b"batch")
                    + (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
                       f"filename*={charset}''{quoted}\r\n\r\n").encode() + one + b"\r\n"
                    + f"--{BOUNDARY}--\r\n".encode())
            r = httpx.post(live.url + "/v1/files", content=body, headers=MULTIPART)
            assert r.status_code == 200, r.text
            assert r.json()["filename"] == name, charset


def test_a_form_field_too_long_is_not_reported_as_files_full(tmp_path: Path) -> None:
    """With less room left than a file may take, every `too_large` of an upload said the
    key's files were full, also that of a form field too long."""
    one = jsonl(2)
    body = (form_part("purpose", b"b" * 2000) + form_part("file", one, "a.jsonl")
            + f"--{BOUNDARY}--\r\n".encode())
    with batch_server(tmp_path, max_stored_file_bytes=10 * len(one)) as live:
        r = httpx.post(live.url + "/v1/files", content=body, headers=MULTIPART)
        assert r.status_code == 413
        assert r.json()["error"]["message"] == "form field 'purpose' is too long", r.text


def test_a_file_too_large_for_any_key_is_not_called_files_full(tmp_path: Path) -> None:
    """A key near its stored bytes sending a file past --max-batch-file-bytes was told only
    to delete files, which could not help (found by a review). A body too large for a file
    of any key says so; one whose file the stream cannot tell names both limits."""
    one = jsonl(6)
    with batch_server(tmp_path, max_batch_file_bytes=2000,
                      max_stored_file_bytes=len(one) + 1500) as live:
        live.client().files.create(file=("a.jsonl", one), purpose="batch")  # 1,500 left
        huge = httpx.post(live.url + "/v1/files", files={"file": ("b.jsonl", b"x" * 100_000)},
                          data={"purpose": "batch"})
        assert huge.status_code == 413
        assert huge.json()["error"]["message"] == "file exceeds 2000 bytes", huge.text
        unsure = httpx.post(live.url + "/v1/files", files={"file": ("c.jsonl", b"x" * 5000)},
                            data={"purpose": "batch"})
        assert unsure.status_code == 413
        message = unsure.json()["error"]["message"]
        assert "--max-stored-file-bytes" in message and "--max-batch-file-bytes" in message


def test_a_blank_line_longer_than_a_frame_is_no_item(tmp_path: Path) -> None:
    """The upload counts lines holding more than whitespace, and the batch skipped blank
    lines, but one longer than --max-frame-bytes became a failed item, which pushed the
    last request of a file at --max-batch-items past it (found by a review)."""
    lines = [" " * 10_000] + [request_line(f"ok-{i}", "x") for i in range(3)] + ["\t" * 9000]
    with batch_server(tmp_path, max_frame_bytes=8192, max_batch_items=3) as live:
        client = live.client()
        batch = wait_finished(live.url, submit(client, ("\n".join(lines) + "\n").encode()))
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
