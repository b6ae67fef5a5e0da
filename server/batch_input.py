"""Validation of a batch input file, line by line. Each line becomes a request to run or a failure
to report with a typed code; one bad line never fails the batch. Needs no tokenizer, so it can
run in a worker thread; checks that need one (context length) happen when the item runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from antiphon.server.batch_endpoints import ENDPOINTS
from antiphon.server.batch_types import CHAT_ENDPOINT, InputItem
from antiphon.server.chat import ChatService
from antiphon.server.errors import ApiError, ErrorCode, bad_message
from antiphon.server.protocol import parse_json


def read_items(path: Path, chat: ChatService, endpoint: str = CHAT_ENDPOINT) -> list[InputItem]:
    """Every non-blank line of the JSONL file at `path`, validated as a request to `endpoint`,
    in order, under the server's limits (`chat.config`): lines longer than `--max-frame-bytes`
    and lines after the first `--max-batch-items` fail. Raises OSError."""
    max_line_bytes, max_items = chat.config.max_frame_bytes, chat.config.max_batch_items
    items: list[InputItem] = []
    seen_custom_ids: set[str] = set()
    with path.open("rb") as f:
        for line_index, raw in enumerate(_lines(f, max_line_bytes)):
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise ApiError(ErrorCode.TOO_LARGE, f"the line is longer than "
                                   f"{max_line_bytes} bytes (--max-frame-bytes)")
                if len(items) >= max_items:
                    raise ApiError(ErrorCode.TOO_MANY_ITEMS, f"a batch holds at most "
                                   f"{max_items} requests (--max-batch-items)")
                data = _parse(raw)
            except ApiError as err:
                items.append(_failed(line_index, None, err))
                continue
            items.append(_check(line_index, data, chat, seen_custom_ids, endpoint))
    return items


def _check(line_index: int, data: dict[str, Any], chat: ChatService,
           seen_custom_ids: set[str], endpoint: str) -> InputItem:
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _failed(line_index, None, ApiError(
            ErrorCode.MISSING_CUSTOM_ID, "custom_id must be a non-empty string"))
    max_chars = chat.config.max_custom_id_chars
    if len(custom_id) > max_chars:
        return _failed(line_index, None, ApiError(ErrorCode.BAD_MESSAGE, (
            f"custom_id is longer than {max_chars} characters (--max-custom-id-chars)")))
    if custom_id in seen_custom_ids:
        # Not under that custom_id: a client matching results by it would take this error
        # for the answer of the line that holds it first.
        return _failed(line_index, None, ApiError(
            ErrorCode.DUPLICATE_CUSTOM_ID, f"custom_id {custom_id!r} is used by an earlier line"))
    seen_custom_ids.add(custom_id)
    try:
        body_text = _body_text(data, endpoint)
        ENDPOINTS[endpoint].check(chat, parse_body(body_text, endpoint))
    except ApiError as err:
        return _failed(line_index, custom_id, err)
    return InputItem(line_index, custom_id, body_text)


def _body_text(data: dict[str, Any], endpoint: str) -> str:
    """The line's request body, as the item keeps it; raises `ApiError` for a line that is
    not a request to `endpoint`."""
    if data.get("method") != "POST":
        raise ApiError(ErrorCode.BAD_MESSAGE, "method must be \"POST\"")
    if data.get("url") != endpoint:
        raise ApiError(ErrorCode.UNSUPPORTED_URL, f"url {data.get('url')!r} is not the "
                       f"batch's endpoint; use {endpoint!r}")
    if not isinstance(data.get("body"), dict):
        raise ApiError(ErrorCode.BAD_MESSAGE, "body must be a JSON object: the request")
    return json.dumps(data["body"], ensure_ascii=False)


def parse_body(body_text: str, endpoint: str) -> Any:
    """An item's request body (`InputItem.body`) as `endpoint`'s request model, parsed from
    its text both when the line is checked and when it runs: the JSON parser nests less
    deeply than Python's, which read the line (a body it refused only at run time was taken
    for a crash and run again). Raises `bad_message`."""
    try:
        body = ENDPOINTS[endpoint].request.model_validate_json(body_text)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":  # (the text is JSON Python wrote)
            raise ApiError(ErrorCode.BAD_JSON, "body is nested too deeply") from None
        raise bad_message(exc.errors(), parent="body") from None
    if getattr(body, "stream", None):
        raise ApiError(ErrorCode.BAD_MESSAGE, "body.stream: streaming is not available in a batch")
    return body


def _parse(raw: bytes) -> dict[str, Any]:
    data = parse_json(raw, "the line")
    if not isinstance(data, dict):
        raise ApiError(ErrorCode.BAD_MESSAGE, "the line must be a JSON object")
    return data


def _failed(line_index: int, custom_id: str | None, err: ApiError) -> InputItem:
    return InputItem(line_index, custom_id, None,
                     (err.code, f"line {line_index + 1}: {err.message}"))


def _lines(f: IO[bytes], max_line_bytes: int) -> Iterator[bytes | None]:
    """The file's lines without their newline, reading at most `max_line_bytes + 2` bytes at
    a time; None stands for a line that is too long (its bytes are skipped), b"" for a blank
    one of any length (the upload's line count skips those: counted here, one pushed the
    last request of a file at `--max-batch-items` past it)."""
    while line := f.readline(max_line_bytes + 2):
        # Short of the read's size without a newline: the file's last line (a lone \r too).
        if line.endswith(b"\n") or len(line) <= max_line_bytes + 1:
            body = line.rstrip(b"\r\n")
            yield body if len(body) <= max_line_bytes or not body.strip() else None
            continue
        is_blank = not line.strip()
        while line and not line.endswith(b"\n"):  # skip the rest of an over-long line
            line = f.readline(max_line_bytes + 2)
            is_blank = is_blank and not line.strip()
        yield b"" if is_blank else None
