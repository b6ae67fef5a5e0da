"""Plain records of the Batch API: files, batches, items and their results, and their OpenAI
JSON shapes. No I/O here."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import secrets
from typing import Any

from antiphon.server.errors import ErrorCode

CHAT_ENDPOINT = "/v1/chat/completions"
TEXT_ENDPOINT = "/v1/completions"  # (a batch's endpoints: `batch_endpoints.ENDPOINTS`)
# OpenAI accepts only a 24-hour completion window.
COMPLETION_WINDOWS_S = {"24h": 24 * 3600.0}
FILE_ID_RE = re.compile(r"^file-[0-9a-f]{24}$")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BatchStatus(enum.StrEnum):
    """A batch's life, in order::

        validating -> in_progress -> finalizing -> completed
                 \\-> failed      \\-> finalizing -> expired
        (validating | in_progress) -> cancelling -> cancelled
    """

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return _ORDER.index(self) >= _ORDER.index(BatchStatus.COMPLETED)


_ORDER = list(BatchStatus)


class ItemState(enum.IntEnum):
    """One line of a batch. SUCCEEDED and FAILED are committed results (written exactly once);
    SKIPPED marks lines a cancelled batch never ran."""

    PENDING = 0
    SUCCEEDED = 1
    FAILED = 2
    SKIPPED = 3


@dataclasses.dataclass(frozen=True)
class FileRecord:
    file_id: str
    owner: str
    purpose: str  # "batch" (uploaded), "batch_output" (generated)
    filename: str  # as the client named it; never used as a path
    num_bytes: int
    created_at: float  # unix seconds

    def to_json(self) -> dict[str, Any]:
        return {"id": self.file_id, "object": "file", "bytes": self.num_bytes,
                "created_at": int(self.created_at), "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclasses.dataclass(frozen=True)
class InputItem:
    """One line of an input file after validation: a request to run, or a failure to report."""

    line_index: int  # 0-based line number in the input file
    custom_id: str | None  # None when the line has none
    body: str | None  # the request body as JSON; None when the line failed validation
    error: tuple[ErrorCode, str] | None = None


@dataclasses.dataclass(frozen=True)
class PendingItem:
    line_index: int
    custom_id: str
    body: str  # chat completion request, JSON
    num_attempts: int  # times it was started before (a crash or restart interrupted those)


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """The committed answer of one item: a response body or an error."""

    request_id: str | None  # engine request id; None when the item never ran
    response: str | None  # chat.completion object, JSON, when the item succeeded
    error_code: str | None = None
    error_message: str | None = None
    # The HTTP status the endpoint refused the request with (a 4xx); None for a failure
    # that is no HTTP answer (a line that failed its check, an expired batch, attempts spent)
    status_code: int | None = None

    @property
    def state(self) -> ItemState:
        return ItemState.SUCCEEDED if self.response is not None else ItemState.FAILED

    def to_line(self, batch_id: str, line_index: int, custom_id: str | None) -> str:
        """The item's line in the output (success) or error file, as OpenAI writes it."""
        item_id = "batch_req_" + (self.request_id or f"{batch_id[6:]}_{line_index}")
        record: dict[str, Any] = {"id": item_id, "custom_id": custom_id}
        if self.response is not None:
            record["response"] = {"status_code": 200, "request_id": self.request_id,
                                  "body": json.loads(self.response)}
            record["error"] = None
        elif self.status_code is not None:  # as OpenAI: the endpoint's own answer
            record["response"] = {"status_code": self.status_code, "request_id": item_id,
                                  "body": {"error": {"message": self.error_message,
                                                     "type": "invalid_request_error",
                                                     "param": None, "code": self.error_code}}}
            record["error"] = None
        else:  # `error` is for failures with no HTTP answer
            record["response"] = None
            record["error"] = {"code": self.error_code, "message": self.error_message}
        return json.dumps(record, ensure_ascii=False) + "\n"


@dataclasses.dataclass(frozen=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def num_pending(self) -> int:
        return self.total - self.completed - self.failed


@dataclasses.dataclass(frozen=True)
class Batch:
    batch_id: str
    owner: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    status: BatchStatus
    final_status: BatchStatus | None  # where finalizing or cancelling ends
    times: dict[str, float]  # "<status>_at" -> unix seconds, plus created_at and expires_at
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # why a batch failed as a whole
    counts: RequestCounts = RequestCounts()
    endpoint: str = CHAT_ENDPOINT  # every line's url

    def to_json(self) -> dict[str, Any]:
        stamp_names = ("created_at", "expires_at", "in_progress_at", "finalizing_at",
                       "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
        stamps = {name: int(self.times[name]) if name in self.times else None
                  for name in stamp_names}
        return {
            "id": self.batch_id, "object": "batch", "endpoint": self.endpoint,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.value, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, **stamps,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "request_counts": dataclasses.asdict(self.counts), "metadata": self.metadata,
        }
