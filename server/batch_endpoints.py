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
)
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


ENDPOINTS: dict[str, BatchEndpoint] = {
    CHAT_ENDPOINT: BatchEndpoint(
        ChatCompletionRequest, completion_turns,
        lambda chat, body, owner: prepare_completion(chat, body, owner, RequestClass.BE),
        completion_object),
    TEXT_ENDPOINT: BatchEndpoint(
        TextCompletionRequest, check_text_completion,
        lambda chat, body, owner: prepare_text_completion(chat, body, owner, RequestClass.BE),
        text_completion_object),
}
