"""OpenAI's legacy text completions (`/v1/completions`): a plain prompt, no chat template.

What `vllm bench serve`, lm-evaluation-harness and other tools built for OpenAI-compatible
servers send by default. One prompt per request (a text, or its token ids); RT by default, like
a chat completion, with the same `vllm_xargs` (`request_class`, `ttft_slo_s`, `tpot_slo_s`).
Sessions are chat conversations, so `vllm_xargs.session_id` is refused here.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from antiphon.engine_ext.types import ChatTurn, RequestClass
from antiphon.server.chat import ChatService, Generation
from antiphon.server.completions import (
    MAX_TOP_LOGPROBS,
    OpenAIMessage,
    StreamOptions,
    check_request,
    refuse_unsupported,
    request_class_xarg,
    require_served_model,
    slo_overrides,
)
from antiphon.server.errors import ApiError, ErrorCode, over_limit
from antiphon.server.protocol import Sampling, StrictBool, StrictInt

# Legacy parameters this server does not implement, with the values that ask for nothing.
UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}
TokenId = Annotated[StrictInt, Field(ge=0)]


class TextCompletionRequest(Sampling):
    """OpenAI's completion request with vLLM's sampling extensions (`Sampling`, `ignore_eos`).
    Unknown parameters are refused, as in a chat completion."""

    model_config = ConfigDict(extra="allow")  # checked by `_refuse_unsupported`
    model: str
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenId], Field(min_length=1)]
    """A text, a list holding one text, or the prompt's token ids."""
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    n: Literal[1] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """The chosen token's log probability and this many likeliest alternatives, per token."""
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("prompt"), list) and len(
                data["prompt"]) > 1 and all(isinstance(p, str) for p in data["prompt"]):
            raise ValueError("prompt: one prompt per request (send several as separate "
                             "requests, or as a batch)")
        return refuse_unsupported(data, set(cls.model_fields), UNSUPPORTED_PARAMETERS)

    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's token ids, where it was given as such (None: a text)."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], int):
            return [int(token) for token in self.prompt]
        return None

    def prompt_text(self) -> str:
        """The prompt's text (where it was not given as token ids)."""
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt[0])

    def sampling(self) -> dict[str, Any]:
        given = super().sampling()
        if self.ignore_eos is not None:
            given["ignore_eos"] = self.ignore_eos
        if self.logprobs is not None:
            given["logprobs"] = self.logprobs
        return given


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a plain prompt, or a conversation rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[OpenAIMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    """A plain prompt's BOS and the like (default true); not for messages (the template's)."""
    add_generation_prompt: StrictBool = True
    """Messages only: end with the assistant's turn opened, as a reply's prompt does."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and self.add_special_tokens is not None:
            raise ValueError("add_special_tokens is for a prompt; messages get the chat "
                             "template's")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: the text of token ids."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def tokenize(chat: ChatService, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's `/tokenize` answer; raises `ApiError` (unknown model, input over the limits)."""
    if body.model is not None:
        require_served_model(chat, body.model)
    if body.messages is not None:
        if len(body.messages) > chat.config.max_messages:
            raise over_limit(f"{len(body.messages)} messages; the limit is "
                             f"{chat.config.max_messages}")
        turns = []
        for m in body.messages:
            chat.check_content(m.text(), may_be_empty=True)
            turns.append(ChatTurn("system" if m.role == "developer" else m.role, m.text()))
        tokens = chat.engine.render_chat(turns, open_reply=body.add_generation_prompt)
    else:
        assert body.prompt is not None
        chat.check_content(body.prompt, may_be_empty=True)
        tokens = chat.engine.encode_prompt(body.prompt, body.add_special_tokens is not False)
    return {"count": len(tokens), "max_model_len": chat.engine.max_model_len,
            "tokens": tokens}


def detokenize(chat: ChatService, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's `/detokenize` answer; raises `ApiError`."""
    if body.model is not None:
        require_served_model(chat, body.model)
    if len(body.tokens) > chat.engine.max_model_len:
        raise over_limit(f"{len(body.tokens)} tokens; the model's context is "
                         f"{chat.engine.max_model_len}")
    chat.check_in_vocabulary(body.tokens, "tokens")
    return {"prompt": chat.engine.decode(body.tokens)}


def check_text_completion(chat: ChatService, body: TextCompletionRequest) -> None:
    """Every check of `body` that needs no tokenizer (model, `vllm_xargs`, prompt size and
    token ids, max_tokens, stop sequences, logit_bias); raises `ApiError`."""
    require_served_model(chat, body.model)
    xargs = body.vllm_xargs or {}
    if "session_id" in xargs:
        raise ApiError(ErrorCode.BAD_MESSAGE, "vllm_xargs.session_id: sessions are chat "
                       "conversations; use /v1/chat/completions")
    check_request(chat, body, body.max_tokens, xargs)
    prompt = body.prompt_token_ids()
    if prompt is None:
        chat.check_content(body.prompt_text())
    else:
        chat.check_in_vocabulary(prompt, "prompt")


def prepare_text_completion(chat: ChatService, body: TextCompletionRequest, owner: str,
                            request_class: RequestClass | None = None) -> Generation:
    """A generation of `owner`'s for `body`, of `request_class` (else the one `vllm_xargs`
    names, RT by default); raises `ApiError` and changes nothing on bad input."""
    check_text_completion(chat, body)
    xargs = body.vllm_xargs or {}
    if request_class is None:
        request_class = request_class_xarg(xargs)
    prompt = body.prompt_token_ids()
    if prompt is None:
        prompt = chat.engine.encode_prompt(body.prompt_text())
    return chat.prepare_prompt(secrets.token_hex(12), prompt, body.max_tokens, request_class,
                               owner=owner, **body.sampling(), **slo_overrides(chat, xargs))


def text_choice(gen: Generation, text: str, start: int = 0,
                finish_reason: str | None = None) -> dict[str, Any]:
    """A `text_completion` choice: `text`, with the logprobs of the output tokens from
    `start` on (None when the request asked for none, or there are none new)."""
    fresh = gen.params.logprobs is not None and len(gen.token_logprobs) > start
    return {"index": 0, "text": text,
            "logprobs": legacy_logprobs(gen, start) if fresh else None,
            "finish_reason": finish_reason}


def legacy_logprobs(gen: Generation, start: int = 0) -> dict[str, Any]:
    """The legacy completions' `logprobs` of output tokens from `start` on: their texts, log
    probabilities, likeliest alternatives (with the chosen token, as OpenAI gives it) and
    offsets in the reply's text."""
    tokens = gen.token_logprobs[start:]
    offset = sum(len(t.token) for t in gen.token_logprobs[:start])
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{**dict(t.top), t.token: t.logprob} for t in tokens],
            "text_offset": offsets}


def text_completion_object(gen: Generation, model: str) -> dict[str, Any]:
    """The non-streaming `text_completion` response of a finished generation."""
    return {"id": "cmpl-" + gen.request_id, "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [text_choice(gen, gen.text, 0, gen.finish_reason)],
            "usage": gen.usage()}
