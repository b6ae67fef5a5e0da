"""Streaming multipart/form-data uploads: the one file part goes straight to a `FileWriter` as
its bytes arrive, so the size and line limits hold before anything is buffered."""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.file_store import FileTooLarge, FileWriter
from antiphon.server.http import declared_body_bytes

FILE_FIELD = "file"
_MAX_FIELD_BYTES = 1024  # form fields besides the file ("purpose") are short
_MAX_FIELDS = 8
_MAX_PARTS = _MAX_FIELDS + 1  # the fields and the file
# Body bytes besides the file's: boundaries, part headers, the other fields.
MAX_FORM_OVERHEAD_BYTES = 64 * 1024
# RFC 5987's extended parameter, `filename*=charset'language'percent-encoded`, which
# python-multipart's header parser drops.
_EXTENDED_FILENAME = re.compile(rb"(?:^|;)\s*filename\*\s*=\s*([^';\s]*)'[^';]*'([^;\s]*)", re.I)
# The charsets of an extended file name (RFC 5987), as Python names their codecs.
_FILENAME_CHARSETS = {"utf-8": "utf-8", "iso-8859-1": "iso-8859-1"}


@dataclasses.dataclass(frozen=True)
class Upload:
    filename: str  # as the client named it, at most 255 characters
    fields: dict[str, str]  # the other form fields
    num_bytes: int
    num_lines: int  # lines with anything but whitespace


class _LineCounter:
    """Counts non-blank lines of a byte stream fed in arbitrary pieces."""

    def __init__(self) -> None:
        self.num_lines = 0
        self._is_open_line_blank = True

    def feed(self, data: bytes) -> None:
        *ended, rest = data.split(b"\n")
        for piece in ended:
            if not (self._is_open_line_blank and not piece.strip()):
                self.num_lines += 1
            self._is_open_line_blank = True
        self._is_open_line_blank = self._is_open_line_blank and not rest.strip()

    def finish(self) -> int:
        return self.num_lines + (0 if self._is_open_line_blank else 1)


class _Receiver:
    """python-multipart callbacks: file bytes to the writer, other fields to a dict."""

    def __init__(self, writer: FileWriter, max_lines: int) -> None:
        self.writer = writer
        self.max_lines = max_lines
        self.lines = _LineCounter()
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._name = ""
        self._is_file = False
        self._value = bytearray()
        self.is_complete = False  # the closing boundary arrived
        self.num_parts = 0

    def on_end(self) -> None:
        self.is_complete = True

    def on_part_begin(self) -> None:
        # Counted here, not as fields kept: a field sent again replaces its value, and each
        # part costs parsing all the same. A body too large in parts: 413, as in bytes.
        self.num_parts += 1
        if self.num_parts > _MAX_PARTS:
            raise ApiError(ErrorCode.TOO_LARGE,
                           f"more than {_MAX_FIELDS} form fields besides the file")
        self._disposition, self._is_file, self._value = b"", False, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = _filename(self._disposition, options)
        if filename is None:
            return
        if self._name != FILE_FIELD or self.filename is not None:
            raise ApiError(ErrorCode.BAD_MESSAGE,
                           f"send exactly one file, in the form field {FILE_FIELD!r}")
        self.filename = filename[:255]
        self._is_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self._is_file:
            self.writer.write(piece)
            self.lines.feed(piece)
            if self.lines.num_lines > self.max_lines:
                raise ApiError(ErrorCode.TOO_MANY_ITEMS,
                               f"file has more than {self.max_lines} lines")
        else:
            self._value += piece
            if len(self._value) > _MAX_FIELD_BYTES:
                raise ApiError(ErrorCode.TOO_LARGE, f"form field {self._name!r} is too long")

    def on_part_end(self) -> None:
        if not self._is_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


def _check_body_bytes(num_bytes: int, max_file_bytes: int | None) -> None:
    """Raises `FileTooLarge` for a body of `num_bytes` past the file's and the form's room."""
    if max_file_bytes is not None and num_bytes > max_file_bytes + MAX_FORM_OVERHEAD_BYTES:
        raise FileTooLarge(max_file_bytes)


async def receive_upload(request: Request, writer: FileWriter, max_lines: int) -> Upload:
    """Stream the request's multipart body: its file part into `writer` (which enforces the
    byte limit), its other fields into `Upload.fields`. Raises `ApiError` on a malformed body,
    a missing file, more than `max_lines` lines, or more bytes than the writer takes
    (`FileTooLarge`, also for a body past the writer's bytes and `MAX_FORM_OVERHEAD_BYTES`,
    whether its Content-Length says so or it is chunked and streams past them)."""
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(ErrorCode.BAD_MESSAGE, "expected a multipart/form-data body")
    _check_body_bytes(declared_body_bytes(request) or 0, writer.max_bytes)
    r = _Receiver(writer, max_lines)
    parser = MultipartParser(boundary, {
        "on_part_begin": r.on_part_begin, "on_part_data": r.on_part_data,
        "on_part_end": r.on_part_end, "on_header_field": r.on_header_field,
        "on_header_value": r.on_header_value, "on_header_end": r.on_header_end,
        "on_headers_finished": r.on_headers_finished, "on_end": r.on_end})
    try:
        num_body_bytes = 0
        async for chunk in request.stream():
            # A chunked body has no Content-Length to refuse it by: parts besides the file,
            # and whatever follows the closing boundary, are read and dropped, so count them.
            num_body_bytes += len(chunk)
            _check_body_bytes(num_body_bytes, writer.max_bytes)
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as exc:
        raise ApiError(ErrorCode.BAD_MESSAGE, f"malformed multipart body: {exc}") from None
    if not r.is_complete:
        raise ApiError(ErrorCode.BAD_MESSAGE,
                       "malformed multipart body: it ends before its closing boundary")
    if r.filename is None:
        raise ApiError(ErrorCode.BAD_MESSAGE, f"no file in the form field {FILE_FIELD!r}")
    num_lines = r.lines.finish()  # the last line, if no newline ends it, counts here
    if num_lines > max_lines:
        raise ApiError(ErrorCode.TOO_MANY_ITEMS, f"file has more than {max_lines} lines")
    return Upload(r.filename, r.fields, writer.num_bytes, num_lines)


def _filename(disposition: bytes, options: dict[bytes, bytes]) -> str | None:
    """The part's file name: `filename`, or else the extended `filename*` some clients send
    alone for a name outside ASCII (requests on urllib3 1.x); None for a plain form field."""
    if b"filename" in options:
        return options[b"filename"].decode("utf-8", "replace")
    extended = _EXTENDED_FILENAME.search(disposition)
    if extended is None:
        return None
    # RFC 5987 allows UTF-8 and ISO-8859-1; another codec can decode to lone surrogates
    # (utf-7's "+2AA-", unicode_escape's "\ud800"), which the file's database row cannot
    # hold: its upload failed with an internal error. Other charsets read as UTF-8.
    charset = extended.group(1).decode("ascii", "replace").lower()
    quoted = extended.group(2).decode("ascii", "replace")
    return urllib.parse.unquote(quoted, encoding=_FILENAME_CHARSETS.get(charset, "utf-8"),
                                errors="replace")
