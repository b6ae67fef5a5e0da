"""OpenAI-compatible Batch API: `/v1/files` (upload, metadata, download) and `/v1/batches`
(create, get, list, cancel). The routes validate, record and wake the runner; the work happens
in `BatchRunner`. Files and batches belong to the caller's owner id; others get 404."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from antiphon.server.batch_endpoints import ENDPOINTS
from antiphon.server.batch_store import InputFileGone
from antiphon.server.batch_types import (
    COMPLETION_WINDOWS_S,
    Batch,
    BatchStatus,
    FileRecord,
    ItemState,
    new_file_id,
)
from antiphon.server.context import AppContext
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.file_store import FileTooLarge
from antiphon.server.http import authorize, declared_body_bytes, read_model
from antiphon.server.uploads import MAX_FORM_OVERHEAD_BYTES, receive_upload

router = APIRouter()
INPUT_PURPOSE = "batch"


class NewBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None


def _ctx(request: Request) -> AppContext:
    return request.app.state.ctx


async def _file(ctx: AppContext, owner: str, file_id: str) -> FileRecord:
    record = await asyncio.to_thread(ctx.batch_store.get_file, owner, file_id)
    if record is None:
        raise ApiError(ErrorCode.FILE_NOT_FOUND, f"no file {file_id}")
    return record


async def _batch(ctx: AppContext, owner: str, batch_id: str) -> Batch:
    batch = await asyncio.to_thread(ctx.batch_store.get_batch, owner, batch_id)
    if batch is None:
        raise ApiError(ErrorCode.BATCH_NOT_FOUND, f"no batch {batch_id}")
    return batch


def _files_full(stored: int, most: int, in_flight: int = 0,
                file_limit: int | None = None) -> ApiError:
    """`too_large` for a key whose stored files leave no room; with `file_limit`, for an
    upload past the room they leave, which may be past a file's limit too."""
    uploading = f" (and holds {in_flight} more for its uploads in flight)" if in_flight else ""
    also = "" if file_limit is None else (
        f"; a file may have at most {file_limit} bytes (--max-batch-file-bytes) whatever "
        "the key stores")
    return ApiError(ErrorCode.TOO_LARGE, (
        f"this API key stores {stored} bytes of files{uploading} and may store {most} "
        "(--max-stored-file-bytes), results included: delete some first "
        f"(DELETE /v1/files/ID){also}"))


def _check_num_files(num_files: int, most: int) -> None:
    if num_files >= most:
        raise ApiError(ErrorCode.TOO_MANY_FILES, (
            f"this API key keeps {num_files} files, the most it may keep "
            "(--max-files-per-key), results included: delete some first "
            "(DELETE /v1/files/ID)"))


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    """Multipart upload (`file`, `purpose=batch`), streamed to disk under a new id. Each
    upload reserves its room of the key's `--max-stored-file-bytes` before it streams (the
    file's limit, or less: its Content-Length, the room left) and may write no more, so the
    key's uploads in flight together stay within it; the key's stored bytes are checked again
    under the key's lock before the file is kept (batch results may have grown them)."""
    ctx, owner = _ctx(request), authorize(request)
    limits = ctx.config.server
    most = limits.max_stored_file_bytes
    in_flight = ctx.files.uploads_in_flight
    async with ctx.upload_locks[owner]:  # a file kept meanwhile is in `stored`, or reserved
        stored, num_files = await asyncio.to_thread(ctx.batch_store.stored, owner)
        _check_num_files(num_files, limits.max_files_per_key)
        reserved = in_flight.num_reserved(owner)
        room = most - stored - reserved
        if room <= 0:
            raise _files_full(stored, most, reserved)
        max_bytes = min(limits.max_batch_file_bytes, room,
                        declared_body_bytes(request) or limits.max_batch_file_bytes)
        in_flight.reserve(owner, max_bytes)
    try:
        record = await _receive_file(request, ctx, owner, max_bytes)
    except FileTooLarge as err:  # (not a form field too long: that is the client's fault)
        file_limit = limits.max_batch_file_bytes
        if room >= file_limit:
            raise
        declared = declared_body_bytes(request)
        if declared is not None and declared > file_limit + MAX_FORM_OVERHEAD_BYTES:
            raise FileTooLarge(file_limit) from err  # (too large for any key: no use deleting)
        # The stream stopped at the key's room; whether the file is also past a file's limit
        # is not known then (told only "delete some first", a key near its limit deleted
        # files for an upload too large for any).
        raise _files_full(stored, most, reserved, file_limit) from err
    finally:  # after the file is kept or gone
        in_flight.release(owner, max_bytes)
    return record.to_json()


async def _receive_file(request: Request, ctx: AppContext, owner: str,
                        max_bytes: int) -> FileRecord:
    """Stream the upload into a new file of at most `max_bytes` and keep it, if the key's
    stored bytes, checked under its lock, have room for it still."""
    limits = ctx.config.server
    file_id = new_file_id()
    with ctx.files.create(file_id, max_bytes) as writer:
        upload = await receive_upload(request, writer, limits.max_batch_items)
        if upload.fields.get("purpose") != INPUT_PURPOSE:
            raise ApiError(ErrorCode.BAD_MESSAGE, f"purpose must be {INPUT_PURPOSE!r}")
        if upload.num_bytes == 0:  # (free of the stored bytes: files without end)
            raise ApiError(ErrorCode.INVALID_FILE, "the file is empty", param="file")
        record = FileRecord(file_id, owner, INPUT_PURPOSE, upload.filename, upload.num_bytes,
                            time.time())
        async with ctx.upload_locks[owner]:
            stored, num_files = await asyncio.to_thread(ctx.batch_store.stored, owner)
            _check_num_files(num_files, limits.max_files_per_key)
            most = limits.max_stored_file_bytes
            if stored + upload.num_bytes > most:  # batch results written meanwhile
                raise _files_full(stored, most)
            await asyncio.to_thread(writer.commit)
            try:
                await asyncio.to_thread(ctx.batch_store.add_file, record)
            except Exception:  # not registered (its transaction did not commit): not kept
                ctx.files.path(file_id).unlink(missing_ok=True)
                raise
    return record


@router.get("/v1/files")
async def list_files(request: Request, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     after: str | None = None, purpose: str | None = None,
                     order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    """The caller's files, newest first (or oldest, `order=asc`), a page at a time (`after` =
    last id seen), as OpenAI's `GET /v1/files`."""
    ctx, owner = _ctx(request), authorize(request)
    files = await asyncio.to_thread(ctx.batch_store.list_files, owner, limit + 1, after, purpose,
                                    order == "desc")
    return _list_page([(f.file_id, f.to_json()) for f in files], limit)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    return (await _file(ctx, owner, file_id)).to_json()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    """The file's bytes. Opened before the response starts: a delete that comes while it
    streams removes the name, and the open file still reads to its end."""
    ctx, owner = _ctx(request), authorize(request)
    await _file(ctx, owner, file_id)
    try:
        f = await asyncio.to_thread(open, ctx.files.path(file_id), "rb")
    except FileNotFoundError:  # deleted since: as if it never was
        raise ApiError(ErrorCode.FILE_NOT_FOUND, f"no file {file_id}") from None
    size = os.fstat(f.fileno()).st_size

    def blocks() -> Iterator[bytes]:  # read in a worker thread (StreamingResponse's way)
        with f:
            while block := f.read(1 << 16):
                yield block

    return StreamingResponse(blocks(), media_type="application/jsonl",
                             headers={"content-length": str(size)})


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    """Delete a file: an input no unfinished batch reads, or a finished batch's results
    (the batch keeps naming them; their content is gone)."""
    ctx, owner = _ctx(request), authorize(request)
    why_not = await asyncio.to_thread(ctx.batch_store.delete_file, owner, file_id)
    if why_not == "not found":
        raise ApiError(ErrorCode.FILE_NOT_FOUND, f"no file {file_id}")
    if why_not is not None:
        raise ApiError(ErrorCode.FILE_IN_USE,
                       f"file {file_id} is the input of a batch still running; cancel it first")
    await asyncio.to_thread(ctx.files.path(file_id).unlink, missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    body = await read_model(request, NewBatch)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(ErrorCode.UNSUPPORTED_URL, f"endpoint {body.endpoint!r} is not "
                       f"supported; use one of {', '.join(map(repr, ENDPOINTS))}")
    window_s = COMPLETION_WINDOWS_S.get(body.completion_window)
    if window_s is None:
        raise ApiError(ErrorCode.BAD_MESSAGE, "completion_window must be one of "
                       + ", ".join(map(repr, COMPLETION_WINDOWS_S)))
    input_file = await _file(ctx, owner, body.input_file_id)
    if input_file.purpose != INPUT_PURPOSE:
        raise ApiError(ErrorCode.INVALID_FILE,
                       f"file {input_file.file_id} has purpose {input_file.purpose!r}, not "
                       f"{INPUT_PURPOSE!r}")
    limits = ctx.config.server
    # A batch's results are files of the key's too: no room, no batch (nor one past the
    # key's files: batches made from one input again and again kept files without end).
    stored, num_files = await asyncio.to_thread(ctx.batch_store.stored, owner)
    if stored >= limits.max_stored_file_bytes:
        raise _files_full(stored, limits.max_stored_file_bytes)
    _check_num_files(num_files, limits.max_files_per_key)
    try:
        batch = await asyncio.to_thread(
            ctx.batch_store.create_batch, owner, input_file.file_id, body.completion_window,
            window_s, body.metadata, body.endpoint, limits.max_unfinished_batches)
    except InputFileGone:  # deleted since it was looked up
        raise ApiError(ErrorCode.FILE_NOT_FOUND, f"no file {input_file.file_id}") from None
    if batch is None:
        raise ApiError(ErrorCode.TOO_MANY_REQUESTS, (
            f"this API key has {limits.max_unfinished_batches} batches not finished "
            "(--max-unfinished-batches): wait for one to finish, or cancel one"))
    ctx.batches.notify()
    return batch.to_json()


@router.get("/v1/batches")
async def list_batches(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: str | None = None) -> dict[str, Any]:
    """The caller's batches, newest first, a page at a time (`after` = last id seen)."""
    ctx, owner = _ctx(request), authorize(request)
    batches = await asyncio.to_thread(ctx.batch_store.list_batches, owner, limit + 1, after)
    return _list_page([(b.batch_id, b.to_json()) for b in batches], limit)


def _list_page(rows: list[tuple[str, dict[str, Any]]], limit: int) -> dict[str, Any]:
    """OpenAI's list page of `rows` (id, object), read with one more than `limit` to tell
    whether more follow."""
    page = rows[:limit]
    return {"object": "list", "data": [obj for _, obj in page],
            "first_id": page[0][0] if page else None, "last_id": page[-1][0] if page else None,
            "has_more": len(rows) > limit}


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
    ctx, owner = _ctx(request), authorize(request)
    return (await _batch(ctx, owner, batch_id)).to_json()


@router.get("/v1/batches/{batch_id}/errors")
async def batch_errors(batch_id: str, request: Request,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
    """Antiphon's extension: the batch's failed items so far, in line order. Lines that failed
    validation are here as soon as the batch is in progress, before the error file exists;
    none once the finished batch's result files are all deleted (its items go with them)."""
    ctx, owner = _ctx(request), authorize(request)
    await _batch(ctx, owner, batch_id)

    def first_failures() -> list[dict[str, Any]]:
        failed = ctx.batch_store.results(batch_id, ItemState.FAILED, page_size=limit + 1)
        return [{"line": line_index + 1, "custom_id": custom_id, "code": result.error_code,
                 "message": result.error_message}
                for line_index, custom_id, result in itertools.islice(failed, limit + 1)]

    errors = await asyncio.to_thread(first_failures)
    return {"object": "list", "data": errors[:limit], "has_more": len(errors) > limit}


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """Stop starting items, abort running ones, and finalize with the results so far."""
    ctx, owner = _ctx(request), authorize(request)
    batch = await asyncio.to_thread(ctx.batch_store.request_cancel, owner, batch_id)
    if batch is None:
        raise ApiError(ErrorCode.BATCH_NOT_FOUND, f"no batch {batch_id}")
    if batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        raise ApiError(ErrorCode.BATCH_NOT_CANCELLABLE, f"batch {batch_id} is {batch.status}")
    ctx.batches.notify()
    return batch.to_json()
