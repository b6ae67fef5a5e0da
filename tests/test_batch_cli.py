"""`antiphon batch` watching a batch across a server restart, with a stand-in client (no
server): the CLI against a live one is in test_batches.py."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import pytest

from antiphon.batch_cli import BatchCliError, ServerUnreachableError, watch


class Replies:
    """A client whose `get` answers from a script: a batch, or an error to raise."""

    def __init__(self, replies: Iterable[dict[str, Any] | BatchCliError]) -> None:
        self.replies = iter(replies)

    def get(self, batch_id: str) -> dict[str, Any]:
        reply = next(self.replies)
        if isinstance(reply, BatchCliError):
            raise reply
        return reply


def batch(status: str, completed: int) -> dict[str, Any]:
    return {"id": "batch_1", "status": status,
            "request_counts": {"total": 200, "completed": completed, "failed": 0}}


def test_watching_goes_on_while_the_server_restarts() -> None:
    down = ServerUnreachableError("cannot reach the server: connection refused")
    client = Replies([batch("in_progress", 80), down, down,
                      batch("in_progress", 120), batch("completed", 200)])
    out = io.StringIO()
    finished = watch(client, "batch_1", 0.0, out, max_unreachable_s=60.0)
    assert finished["status"] == "completed"
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("80/200 completed, 0 failed (in_progress)")
    assert lines[1] == ("cannot reach the server: connection refused; retrying for up to 60 s")
    assert lines[2].startswith("the server answers again after")
    assert lines[3].endswith("120/200 completed, 0 failed (in_progress)")
    assert lines[4].endswith("200/200 completed, 0 failed (completed)")


def test_watching_gives_up_after_the_unreachable_limit() -> None:
    down = ServerUnreachableError("cannot reach the server: connection refused")
    client = Replies([batch("in_progress", 80), down, down, down])
    with pytest.raises(ServerUnreachableError):
        watch(client, "batch_1", 0.01, io.StringIO(), max_unreachable_s=0.0)


def test_a_refusal_is_not_retried() -> None:
    client = Replies([BatchCliError("HTTP 404: batch_not_found: no batch batch_1")])
    with pytest.raises(BatchCliError, match="batch_not_found"):
        watch(client, "batch_1", 0.0, io.StringIO())


def _client(handler: Any) -> Any:
    import httpx

    from antiphon.batch_cli import BatchClient

    client = BatchClient("http://server", None)
    client.http = httpx.Client(base_url="http://server/v1", transport=httpx.MockTransport(handler))
    return client


def test_a_failed_download_keeps_the_results_already_there(tmp_path: Any) -> None:
    import httpx

    out = tmp_path / "b.results.jsonl"
    out.write_text('{"custom_id": "a"}\n')  # an earlier, whole download

    def gone(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"code": "file_not_found", "message": "x"}})

    with pytest.raises(BatchCliError):
        _client(gone).download({"output_file_id": "file-" + "0" * 24, "error_file_id": None},
                               out)
    assert out.read_text() == '{"custom_id": "a"}\n'
    assert list(tmp_path.iterdir()) == [out]


def test_an_error_file_that_fails_leaves_no_half_results(tmp_path: Any) -> None:
    import httpx

    out = tmp_path / "b.results.jsonl"

    def output_only(request: httpx.Request) -> httpx.Response:
        if "file-0" in request.url.path:
            return httpx.Response(200, content=b'{"custom_id": "a"}\n')
        return httpx.Response(404, json={"error": {"code": "file_not_found", "message": "x"}})

    with pytest.raises(BatchCliError):
        _client(output_only).download({"output_file_id": "file-0" + "0" * 23,
                                       "error_file_id": "file-1" + "0" * 23}, out)
    assert list(tmp_path.iterdir()) == []


def test_the_endpoint_is_the_first_url_a_batch_may_have(tmp_path: Any) -> None:
    """A typo in the first line's url fails that line when the batch runs, not the whole
    submission; a first line nested past Python's recursion limit is skipped, not a
    traceback."""
    from antiphon.batch_cli import first_url

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        "[" * 100_000,
        '{"custom_id": "a", "url": "/v1/chat/completion"}',
        "not json",
        '{"custom_id": "b", "url": "/v1/completions"}',
        '{"custom_id": "c", "url": "/v1/chat/completions"}']) + "\n")
    assert first_url(path) == "/v1/completions"
    path.write_text('{"url": "/v1/embeddings"}\n')
    assert first_url(path) is None  # the CLI then asks for chat completions


def test_ctrl_c_while_submitting_says_what_the_server_may_keep(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the file uploads, or while the batch is created, exits 130 with a line on
    what the server may hold (it was a traceback)."""
    import argparse

    import httpx

    from antiphon.batch_cli import EXIT_STOPPED, _submit

    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "url": "/v1/chat/completions"}\n')
    args = argparse.Namespace(file=str(path), endpoint=None, wait=False)
    for stop_at, said in (("/v1/files", "stopped while uploading"),
                          ("/v1/batches", "it may run (GET /v1/batches")):
        def handler(request: httpx.Request, stop_at: str = stop_at) -> httpx.Response:
            if request.url.path == stop_at:
                raise KeyboardInterrupt
            return httpx.Response(200, json={"id": "file-" + "0" * 24, "bytes": 10})

        assert _submit(_client(handler), args) == EXIT_STOPPED
        assert said in capsys.readouterr().err


@pytest.mark.parametrize(("listed", "delete", "said"), [
    (False, 409, "the batch was created and runs"),
    (False, 200, "no batch was created"),
    (False, None, "the batch may have been created and may run"),
    # finished already (every line failed at once), so its upload could go: it was listed
    (True, 200, "the batch was created (batch_1, completed): do not submit it again")])
def test_a_batch_created_whose_answer_was_lost_is_not_called_a_failure(
        tmp_path: Any, listed: bool, delete: int | None, said: str) -> None:
    """The server created the batch and its answer was lost (a reset, a timeout): the CLI
    said only "cannot reach the server", and a user who submitted again ran every item
    twice. The key's batches, then deleting the upload, tell whether a batch reads it."""
    import argparse

    import httpx

    from antiphon.batch_cli import _submit

    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "url": "/v1/chat/completions"}\n')

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/batches" and request.method == "GET" and listed:
            return httpx.Response(200, json={"data": [
                {"id": "batch_1", "status": "completed", "input_file_id": "file-" + "0" * 24},
                {"id": "batch_0", "status": "completed", "input_file_id": "file-" + "1" * 24}]})
        if request.url.path == "/v1/batches":  # committed on the server; the answer lost
            raise httpx.ReadError("connection reset by peer")
        if request.method == "DELETE":
            if delete is None:
                raise httpx.ConnectError("connection refused")
            if delete == 409:
                return httpx.Response(409, json={"error": {"code": "file_in_use",
                                                           "message": "a batch reads it"}})
            return httpx.Response(200, json={"id": "file-" + "0" * 24, "deleted": True})
        return httpx.Response(200, json={"id": "file-" + "0" * 24, "bytes": 10})

    with pytest.raises(BatchCliError) as failed:
        _submit(_client(handler), argparse.Namespace(file=str(path), endpoint=None,
                                                     wait=False))
    assert "cannot reach the server" in str(failed.value) and said in str(failed.value)


def test_a_proxys_gateway_error_while_the_server_restarts_is_waited_out(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Behind a proxy a restarting server answers 502/503/504, not a refused connection: the
    # wait gave up at once with status 1 ("the batch did not complete") while the batch ran
    # on, and so did the download of a batch that had completed (found by a review).
    import argparse

    import httpx

    from antiphon import batch_cli

    done = {"id": "batch_1", "status": "completed", "output_file_id": "file-" + "0" * 24,
            "error_file_id": None, "request_counts": {"total": 2, "completed": 2, "failed": 0}}
    replies = iter([
        httpx.Response(200, json=batch("in_progress", 1)),
        httpx.Response(502, text="<html>502 Bad Gateway</html>"),
        httpx.Response(503, json={"error": {"code": "shutting_down", "message": "x"}}),
        httpx.Response(200, json=done),
        httpx.Response(504, text="<html>504 Gateway Time-out</html>"),  # the download
        httpx.Response(200, content=b'{"custom_id": "a"}\n{"custom_id": "b"}\n'),
    ])
    client = _client(lambda request: next(replies))
    monkeypatch.setattr(batch_cli, "BatchClient", lambda *args, **kwargs: client)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(batch_id="batch_1", wait=True, poll_interval=0.01,
                              max_unreachable_s=60.0, batch_func=batch_cli._status,
                              url="http://server", api_key=None)
    assert batch_cli.run(args) == batch_cli.EXIT_ALL_ANSWERED
    out = tmp_path / "b.results.jsonl"
    batch_cli._fetch(client, done, out, max_unreachable_s=60.0, poll_s=0.01)
    assert out.read_text().count("\n") == 2
    with pytest.raises(BatchCliError, match="HTTP 404"):  # a refusal is not waited out
        _client(lambda request: httpx.Response(404, json={"error": {
            "code": "batch_not_found", "message": "x"}})).get("batch_1")
