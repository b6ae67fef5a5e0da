"""The endpoints a batch may name, and what each does with a line's body: its request model,
its checks before the batch runs (no tokenizer needed), its generation (as BE work) and its
response body."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from antiphon.engine_ext.types import RequestClass
from antiphon.server.batch_types import CHAT_ENDPOINT, TEXT_ENDPOINT
from antiphon.server.chat import ChatService, Generation
from antiphon.server.completions import (
    ChatCompletionRequest,
    completion_object,
    completion_turns,
    prepare_completion,
    request_class_xarg,
)
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.server.text_completions import (
    TextCompletionRequest,
    check_text_completion,
    prepare_text_completion,
    text_completion_object,
)


@dataclasses.dataclass(frozen=True)
class BatchEndpoint:
    request: type[ChatCompletionRequest] | type[TextCompletionRequest]  # a line's body
    check: Callable[[ChatService, Any], object]  # raises ApiError
    # (chat, body, owner) -> its choices' generations, as BE
    prepare: Callable[[ChatService, Any, str], list[Generation]]
    response: Callable[[list[Generation], str], dict[str, Any]]  # (finished choices, model)


def check_batch_line(body: ChatCompletionRequest | TextCompletionRequest) -> None:
    """What a batch line's `vllm_xargs` may not ask for, which a request sent alone may: a
    session (a line runs on its own, and its reply would not be kept in one) and RT work
    (batch items run as BE). Raises `ApiError` (either would otherwise go unheeded)."""
    xargs = body.vllm_xargs or {}
    if xargs.get("session_id") is not None:
        raise ApiError(ErrorCode.BAD_MESSAGE, "vllm_xargs.session_id: a batch line runs on its "
                       "own, in no session; send a session's turn alone",
                       param="vllm_xargs.session_id")
    if request_class_xarg(xargs) is RequestClass.RT:
        raise ApiError(ErrorCode.BAD_MESSAGE, "vllm_xargs.request_class: batch lines run as "
                       "best-effort (be) work; send a request that must be rt alone",
                       param="vllm_xargs.request_class")


def _check_chat_line(chat: ChatService, body: ChatCompletionRequest) -> None:
    check_batch_line(body)
    completion_turns(chat, body)


def _check_text_line(chat: ChatService, body: TextCompletionRequest) -> None:
    check_batch_line(body)
    check_text_completion(chat, body)


ENDPOINTS: dict[str, BatchEndpoint] = {
    CHAT_ENDPOINT: BatchEndpoint(
        ChatCompletionRequest, _check_chat_line,
        lambda chat, body, owner: prepare_completion(chat, body, owner, RequestClass.BE),
        completion_object),
    TEXT_ENDPOINT: BatchEndpoint(
        TextCompletionRequest, _check_text_line,
        lambda chat, body, owner: prepare_text_completion(chat, body, owner, RequestClass.BE),
        text_completion_object),
}
