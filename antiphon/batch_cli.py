"""`antiphon batch ...`: submit a JSONL file of chat completion requests as a batch (BE) job,
watch it, fetch its results, cancel it. A plain HTTP client of a running server (httpx only)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

import httpx

from antiphon import env
from antiphon.server.batch_types import CHAT_ENDPOINT, TEXT_ENDPOINT

DEFAULT_URL = "http://127.0.0.1:8000"
BAR_WIDTH = 30
FINISHED = ("completed", "failed", "expired", "cancelled")
# Exit statuses of a wait for a batch: every item answered, the batch finished without
# answering all (failed, expired, cancelled; a refused request also exits 1), or it completed
# with some items failed (their errors are in the results).
EXIT_ALL_ANSWERED, EXIT_NOT_COMPLETED, EXIT_ITEMS_FAILED = 0, 1, 3
EXIT_STOPPED = 130  # Ctrl-C, as a shell reports it
# Answers that say the server is down or starting (a proxy's before it, or its own while it
# stops): waited out as no answer is, not taken for the batch's end
GATEWAY_ERRORS = frozenset({502, 503, 504})


class BatchCliError(Exception):
    """A request the server refused or could not answer; the message is for the user."""


class ServerUnreachableError(BatchCliError):
    """No answer at all (refused, reset, timed out): the server may be restarting."""


class BatchReader(Protocol):
    def get(self, batch_id: str) -> dict[str, Any]: ...


class BatchClient:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self.http = httpx.Client(base_url=url.rstrip("/") + "/v1", headers=headers,
                                 timeout=timeout_s)

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            return self._json("POST", "/files", data={"purpose": "batch"},
                              files={"file": (path.name, f, "application/jsonl")})

    def create(self, input_file_id: str, endpoint: str = CHAT_ENDPOINT) -> dict[str, Any]:
        return self._json("POST", "/batches", json={
            "input_file_id": input_file_id, "endpoint": endpoint, "completion_window": "24h"})

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/batches/{batch_id}")

    def list_batches(self) -> list[dict[str, Any]]:
        """The key's newest batches (up to 100), newest first."""
        return list(self._json("GET", "/batches", params={"limit": 100})["data"])

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/batches/{batch_id}/cancel")

    def download(self, batch: dict[str, Any], out: Path) -> int:
        """Write the batch's output lines, then its error lines, to `out`; returns lines.
        They land in `out` only once both are whole: a download that fails leaves `out` as
        it was (an earlier, whole download stays) and no half file."""
        num_lines = 0
        part = out.with_name(out.name + ".part")
        try:
            with part.open("wb") as f:
                for file_id in (batch["output_file_id"], batch["error_file_id"]):
                    if file_id is None:
                        continue
                    try:
                        with self.http.stream("GET", f"/files/{file_id}/content") as r:
                            _check(r)
                            for chunk in r.iter_bytes():
                                f.write(chunk)
                                num_lines += chunk.count(b"\n")
                    except httpx.TransportError as exc:
                        raise self._unreachable(exc) from None
            part.replace(out)
        finally:
            part.unlink(missing_ok=True)
        return num_lines

    def delete_file(self, file_id: str) -> None:
        self._json("DELETE", f"/files/{file_id}")

    def _unreachable(self, exc: Exception) -> ServerUnreachableError:
        return ServerUnreachableError(
            f"cannot reach the server at {self.url}: {exc} (--url names it, when it runs "
            "elsewhere or on another --port)")

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        _check(r)
        result: dict[str, Any] = r.json()
        return result


def _check(r: httpx.Response) -> None:
    if r.is_success:
        return
    r.read()
    try:
        error = r.json()["error"]
        detail = f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        detail = r.text[:200]
    if r.status_code in GATEWAY_ERRORS:  # no answer of the server's own, maybe
        raise ServerUnreachableError(f"HTTP {r.status_code}: {detail} (the server, or a "
                                     "proxy before it, may be restarting)")
    raise BatchCliError(f"HTTP {r.status_code}: {detail}")


def progress_line(batch: dict[str, Any]) -> str:
    """`[#####.....] 120/200 completed, 0 failed (in_progress)`."""
    counts = batch.get("request_counts") or {}
    total, done, failed = counts.get("total", 0), counts.get("completed", 0), counts.get(
        "failed", 0)
    filled = BAR_WIDTH * (done + failed) // total if total else 0
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return f"[{bar}] {done}/{total} completed, {failed} failed ({batch['status']})"


def watch(client: BatchReader, batch_id: str, poll_s: float, out: TextIO,
          max_unreachable_s: float = 600.0) -> dict[str, Any]:
    """Poll until the batch finishes, redrawing one progress line in place on a terminal
    (one line per change elsewhere); returns the finished batch. While the server does not
    answer (a restart: jobs resume where they stopped) it keeps polling, for at most
    `max_unreachable_s` seconds in a row, then raises `ServerUnreachableError`."""
    is_tty, last = out.isatty(), ""
    unreachable_since: float | None = None
    while True:
        try:
            batch = client.get(batch_id)
        except ServerUnreachableError as exc:
            now = time.monotonic()
            if unreachable_since is None:
                unreachable_since = now
                out.write(("\n" if is_tty else "") + f"{exc}; retrying for up to "
                          f"{max_unreachable_s:.0f} s\n")
                out.flush()
                last = ""
            elif now - unreachable_since > max_unreachable_s:
                raise
            time.sleep(poll_s)
            continue
        if unreachable_since is not None:
            down_s = time.monotonic() - unreachable_since
            out.write(f"the server answers again after {down_s:.0f} s\n")
            unreachable_since = None
        line = progress_line(batch)
        if is_tty:
            out.write("\r" + line.ljust(len(last)))
        elif line != last:
            out.write(line + "\n")
        out.flush()
        last = line
        if batch["status"] in FINISHED:
            if is_tty:
                out.write("\n")
            return batch
        time.sleep(poll_s)


def _results_path(input_path: Path) -> Path:
    return input_path.with_name(input_path.stem + ".results.jsonl")


def first_url(path: Path) -> str | None:
    """The `url` of the file's first line that names an endpoint a batch may have (the
    endpoint of a batch of it): a line with a typo in its `url`, or one that is not JSON,
    fails alone when the batch runs, not the whole batch here."""
    with path.open("rb") as f:
        for line in f:
            try:
                url = json.loads(line).get("url") if line.strip() else None
            except (ValueError, AttributeError, RecursionError):  # not a request's JSON
                continue
            if url in (CHAT_ENDPOINT, TEXT_ENDPOINT):
                return str(url)
    return None


def _lost_create(client: BatchClient, file_id: str, exc: ServerUnreachableError) -> str:
    """What became of a batch whose creation got no answer (a reset, a timeout): the key's
    newest batches name it, if it was created; else deleting its upload tells, refused while
    a batch reads it (and allowed once a batch finished: looked up first, a batch whose lines
    all failed at once read as never created). A retry must not run every item twice."""
    try:
        made = [b for b in client.list_batches() if b.get("input_file_id") == file_id]
    except BatchCliError:
        made = []
    if made:
        return (f"{exc}; the batch was created ({made[0]['id']}, {made[0]['status']}): do not "
                f"submit it again (antiphon batch status {made[0]['id']})")
    try:
        client.delete_file(file_id)
    except BatchCliError as refused:
        if not isinstance(refused, ServerUnreachableError) and "file_in_use" in str(refused):
            return (f"{exc}; the batch was created and runs (its input {file_id} is in use: "
                    "GET /v1/batches lists it): do not submit it again")
        return (f"{exc}; the batch may have been created and may run (its input is {file_id}): "
                "GET /v1/batches lists the key's batches, look before submitting again")
    return f"{exc}; no batch was created (its upload was deleted)"


def _submit(client: BatchClient, args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise BatchCliError(f"no such file: {path}")
    endpoint = args.endpoint or first_url(path) or CHAT_ENDPOINT
    try:
        uploaded = client.upload(path)
    except KeyboardInterrupt:
        print("\nstopped while uploading: no batch was created (an upload the server had "
              "received whole is kept: GET /v1/files lists it)", file=sys.stderr)
        return EXIT_STOPPED
    try:
        batch = client.create(uploaded["id"], endpoint)
    except ServerUnreachableError as exc:  # the server may have created it, its answer lost
        raise BatchCliError(_lost_create(client, uploaded["id"], exc)) from None
    except BatchCliError:
        # Kept, the upload would count against the key's stored bytes with no batch to use it.
        with contextlib.suppress(BatchCliError):
            client.delete_file(uploaded["id"])
        raise
    except KeyboardInterrupt:
        print(f"\nstopped while the batch was being created: it may run (GET /v1/batches "
              f"lists the key's batches; its input is {uploaded['id']})", file=sys.stderr)
        return EXIT_STOPPED
    print(f"batch {batch['id']} created from {path} ({uploaded['bytes']} bytes)")
    if not args.wait:
        return 0
    watched = _watch(client, batch["id"], args)
    if watched is None:
        return EXIT_STOPPED
    _fetch(client, watched, _results_path(path), args.max_unreachable_s, args.poll_interval)
    return finished_status(watched)


def _watch(client: BatchClient, batch_id: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The batch once finished, its progress shown; None if the user stopped watching."""
    try:
        return watch(client, batch_id, args.poll_interval, sys.stdout, args.max_unreachable_s)
    except KeyboardInterrupt:
        print(f"\nstopped watching; the batch keeps running: antiphon batch status {batch_id}")
        return None


def finished_status(batch: dict[str, Any]) -> int:
    """The exit status for a finished batch (`EXIT_*`), said in a line when not 0."""
    if batch["status"] != "completed":
        print(f"batch {batch['id']} {batch['status']}")
        return EXIT_NOT_COMPLETED
    failed = (batch.get("request_counts") or {}).get("failed", 0)
    if failed:
        total = batch["request_counts"].get("total", 0)
        print(f"{failed} of {total} items failed; their errors are in the results")
        return EXIT_ITEMS_FAILED
    return EXIT_ALL_ANSWERED


def _fetch(client: BatchClient, batch: dict[str, Any], out: Path,
           max_unreachable_s: float = 0.0, poll_s: float = 0.5) -> None:
    """Download `batch`'s results into `out`, retrying while the server does not answer for
    at most `max_unreachable_s` seconds."""
    for error in (batch.get("errors") or {}).get("data", []):
        print(f"batch {batch['status']}: {error['code']}: {error['message']}")
    if batch["output_file_id"] is None and batch["error_file_id"] is None:
        # (a batch that failed or was cancelled before any item ran: an empty download
        # would take the place of an earlier one)
        print(f"no results: the batch {batch['status']} before any item ran")
        return
    give_up_at = time.monotonic() + max_unreachable_s
    while True:  # (a batch that completed is not called a failure for a restart meanwhile)
        try:
            num_lines = client.download(batch, out)
            break
        except ServerUnreachableError as exc:
            if time.monotonic() >= give_up_at:
                raise
            print(f"{exc}; retrying the download")
            time.sleep(poll_s)
    print(f"{num_lines} results written to {out}")


def _status(client: BatchClient, args: argparse.Namespace) -> int:
    if args.wait:
        watched = _watch(client, args.batch_id, args)
        if watched is None:
            return EXIT_STOPPED
        batch = watched
    else:
        batch = client.get(args.batch_id)
    print(f"{batch['id']}: {progress_line(batch)}")
    for name in ("output_file_id", "error_file_id"):
        if batch.get(name):
            print(f"  {name}: {batch[name]}")
    for error in (batch.get("errors") or {}).get("data", []):
        print(f"  {error['code']}: {error['message']}")
    return finished_status(batch) if args.wait else 0


def _results(client: BatchClient, args: argparse.Namespace) -> int:
    batch = client.get(args.batch_id)
    if batch["status"] not in FINISHED:
        raise BatchCliError(f"batch {batch['id']} is {batch['status']}; results come when it "
                            "finishes (antiphon batch submit --wait, or try again later)")
    _fetch(client, batch, Path(args.out or f"{batch['id']}.results.jsonl"))
    return finished_status(batch)  # (as a wait's: 0 only when every item was answered)


def _cancel(client: BatchClient, args: argparse.Namespace) -> int:
    print(progress_line(client.cancel(args.batch_id)))
    return 0


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would bury the bar
    keys = env.api_keys()
    client = BatchClient(args.url, args.api_key or (keys[0] if keys else None))
    try:
        return int(args.batch_func(client, args))
    except BatchCliError as exc:
        print(f"antiphon batch: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a local file: the input, or where the results go
        print(f"antiphon batch: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (a download leaves no part of its file)
        print("\nantiphon batch: stopped", file=sys.stderr)
        return EXIT_STOPPED


def add_batch_parser(commands: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=DEFAULT_URL, help=f"server (default {DEFAULT_URL})")
    common.add_argument("--api-key", help="API key (default: the first of ANTIPHON_API_KEYS)")
    batch = commands.add_parser("batch", help="run batch (BE) jobs on a running server")
    actions = batch.add_subparsers(dest="batch_command", required=True)
    submit = actions.add_parser("submit", parents=[common],
                                help="upload a JSONL file of requests and start a batch")
    submit.add_argument("file", help="JSONL: one {custom_id, method, url, body} per line")
    submit.add_argument("--endpoint", choices=(CHAT_ENDPOINT, TEXT_ENDPOINT),
                        help="what every line asks for (default: the first line's url)")
    submit.add_argument("--wait", action="store_true",
                        help="show progress until it finishes, then download the results "
                             "to FILE's name with .results.jsonl; exits 0 when every item "
                             "was answered, 3 when some failed, 1 when the batch did not "
                             "complete")
    _add_watch_options(submit)
    submit.set_defaults(batch_func=_submit)
    for name, func, text in (("status", _status, "show a batch's progress"),
                             ("results", _results, "download a finished batch's results"),
                             ("cancel", _cancel, "cancel a batch, keeping results so far")):
        action = actions.add_parser(name, parents=[common], help=text)
        action.add_argument("batch_id")
        action.set_defaults(batch_func=func)
        if name == "results":
            action.add_argument("--out", help="file to write (default ID.results.jsonl)")
        if name == "status":
            action.add_argument("--wait", action="store_true",
                                help="show progress until the batch finishes; exits as "
                                     "submit --wait does")
            _add_watch_options(action)
    batch.set_defaults(func=run)


def _seconds(text: str) -> float:
    """A command line's number of seconds: positive and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text!r}")
    return value


def _add_watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--poll-interval", type=_seconds, default=0.5, help="seconds (0.5)")
    parser.add_argument("--max-unreachable-s", type=_seconds, default=600.0,
                        help="while waiting, keep polling a server that does not answer, "
                             "or answers 502, 503 or 504 (a restart, behind a proxy too), "
                             "this long before giving up (600 s)")
