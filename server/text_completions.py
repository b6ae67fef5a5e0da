"""OpenAI's legacy text completions (`/v1/completions`): a plain prompt, no chat template.

What `vllm bench serve`, lm-evaluation-harness and other tools built for OpenAI-compatible
servers send by default. A request holds one prompt or several (texts, or token ids), each with
`n` choices; RT by default, like a chat completion, with the same `vllm_xargs`
(`request_class`, `ttft_slo_s`, `tpot_slo_s`). Sessions are chat conversations, so
`vllm_xargs.session_id` is refused here.

`echo` gives each choice its prompt before its reply; with `logprobs` it gives the prompt
tokens' log probabilities too (what lm-evaluation-harness scores a continuation by). Those are
computed afresh: such a prompt is not served from cached KV.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated, Any, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from antiphon.engine_ext.types import RequestClass, TokenLogprob
from antiphon.server.chat import ChatService, Echo, Generation, total_usage
from antiphon.server.completions import (
    MAX_TOP_LOGPROBS,
    OpenAIMessage,
    StreamOptions,
    check_request,
    check_stream_options,
    refuse_unsupported,
    request_class_xarg,
    require_served_model,
    slo_overrides,
)
from antiphon.server.errors import ApiError, ErrorCode, over_limit
from antiphon.server.protocol import Sampling, StrictBool, StrictInt
from antiphon.server.tools import ToolDefinition

# Legacy parameters this server does not implement, with the values that ask for nothing.
UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1),
}
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


# A reply's length where the request names none: OpenAI's legacy completions (and vLLM's) stop
# at 16 tokens, and clients and scorers written for them count on it (a chat reply runs on).
DEFAULT_MAX_TOKENS = 16


class TextCompletionRequest(Sampling):
    """OpenAI's completion request with vLLM's sampling extensions (`Sampling`, `ignore_eos`).
    Unknown parameters are refused, as in a chat completion."""

    model_config = ConfigDict(extra="allow")  # checked by `_refuse_unsupported`
    model: str
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    """A text, or the prompt's token ids; or a list of several of either."""
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    """0 with `echo`: the prompt alone (and its logprobs), no reply; unset: 16."""
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    """Choices per prompt (with the prompts, `--max-choices` at most)."""
    echo: StrictBool | None = None
    """Each choice's text (and logprobs) begins with its prompt's."""
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """The chosen token's log probability and this many likeliest alternatives, per token."""
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, set(cls.model_fields), UNSUPPORTED_PARAMETERS)

    @model_validator(mode="after")
    def _no_tokens_only_for_an_echo(self) -> TextCompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for no reply: only with echo (the prompt "
                             "alone)")
        check_stream_options(self.stream, self.stream_options)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a text or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [cast(str | list[int], prompt)]
        return cast(list[str | list[int]], list(prompt))

    @property
    def num_choices(self) -> int:
        return len(self.prompts()) * (self.n or 1)

    def sampling(self) -> dict[str, Any]:
        given = super().sampling()
        if self.ignore_eos is not None:
            given["ignore_eos"] = self.ignore_eos
        if self.logprobs is not None:
            given["logprobs"] = self.logprobs
            given["stop_token_logprob"] = True
            if self.echo:
                given["prompt_logprobs"] = self.logprobs
        return given


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a plain prompt, or a conversation rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[OpenAIMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    """A plain prompt's BOS and the like (default true); messages get the template's (false,
    their default in vLLM: none added on top)."""
    return_token_strs: StrictBool | None = None
    """Also give each token's string (`token_strs`), as vLLM's does."""
    add_generation_prompt: StrictBool | None = None
    """Messages only: end with the assistant's turn opened, as a reply's prompt does (the
    default, as for null)."""
    tools: list[ToolDefinition] | None = None
    """Messages only: the tools offered, rendered as a chat completion renders them."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are for messages")
        if self.messages is not None and self.add_special_tokens:
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
        chat.check_tools(len(body.tools or ()))
        turns = [m.turn() for m in body.messages]
        for turn in turns:
            chat.check_content(turn.content, may_be_empty=True)
        tokens = chat.render(turns, open_reply=body.add_generation_prompt is not False,
                             tools=[t.spec() for t in body.tools or ()])
    else:
        assert body.prompt is not None
        chat.check_content(body.prompt, may_be_empty=True)
        tokens = chat.engine.encode_prompt(body.prompt, body.add_special_tokens is not False)
    return {"count": len(tokens), "max_model_len": chat.engine.max_model_len,
            "tokens": tokens, "token_strs": chat.engine.token_strings(tokens)
            if body.return_token_strs else None}


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
    """Every check of `body` that needs no tokenizer (model, `vllm_xargs`, choices, prompt
    sizes and token ids, max_tokens, stop sequences, logit_bias); raises `ApiError`."""
    require_served_model(chat, body.model)
    xargs = body.vllm_xargs or {}
    if xargs.get("session_id") is not None:
        raise ApiError(ErrorCode.BAD_MESSAGE, "vllm_xargs.session_id: sessions are chat "
                       "conversations; use /v1/chat/completions")
    check_request(chat, body, body.max_tokens, xargs)
    chat.check_choices(body.num_choices)
    for prompt in body.prompts():
        if isinstance(prompt, str):  # (blank is a prompt, as OpenAI's; none is refused below)
            chat.check_content(prompt, may_be_empty=True, what="the prompt", param="prompt")
        else:
            chat.check_in_vocabulary(prompt, "prompt")


def prepare_text_completion(chat: ChatService, body: TextCompletionRequest, owner: str,
                            request_class: RequestClass | None = None) -> list[Generation]:
    """The generations of `owner`'s for `body`, one per choice (prompt by prompt, `n` each),
    of `request_class` (else the one `vllm_xargs` names, else the owner's: RT but for a
    best-effort key); raises `ApiError` and changes nothing on bad input."""
    check_text_completion(chat, body)
    xargs = body.vllm_xargs or {}
    if request_class is None:
        request_class = request_class_xarg(xargs)
    request_id, n, prompts = secrets.token_hex(12), body.n or 1, body.prompts()
    # An echo alone (max_tokens 0) generates one token, as vLLM's does, which it does not give.
    # Unset, OpenAI's 16, kept under --max-tokens-limit (it refused a request naming none).
    max_tokens = (min(DEFAULT_MAX_TOKENS, chat.config.max_tokens_limit) if body.max_tokens is None
                  else 1 if body.max_tokens == 0 else body.max_tokens)
    gens: list[Generation] = []
    limit, logprob_tokens = chat.config.max_prompt_logprobs_tokens, 0
    for prompt_index, prompt in enumerate(prompts):
        tokens = chat.engine.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        what = "the prompt" if len(prompts) == 1 else f"prompt {prompt_index}"
        if body.echo and body.logprobs is not None:  # computed for every prompt and choice
            logprob_tokens += len(tokens) * n
            if logprob_tokens > limit:
                each = f" for each of {n} choices" if n > 1 else ""
                before = (f" after {logprob_tokens - len(tokens) * n} tokens of the prompts before "
                          "it" if logprob_tokens > len(tokens) * n else "")
                raise over_limit(f"{what} is {len(tokens)} tokens, its logprobs computed"
                                 f"{each}{before}; the logprobs of at most {limit} prompt "
                                 "tokens, over all prompts and choices, can be asked for "
                                 "(--max-prompt-logprobs-tokens)")
        gen = chat.prepare_prompt(request_id, tokens, max_tokens, request_class, owner=owner,
                                  what=what, **body.sampling(), **slo_overrides(chat, xargs))
        gen.index, gen.prompt_index = prompt_index * n, prompt_index
        if body.echo:
            text = prompt if isinstance(prompt, str) else chat.engine.decode(prompt)
            gen.echo = Echo(text, chat.engine.decode(tokens[:1]), only=body.max_tokens == 0)
        gens += gen.with_choices(n)
    return gens


def text_choice(gen: Generation, text: str, start: int = 0,
                finish_reason: str | None = None, *, opens: bool = False) -> dict[str, Any]:
    """A `text_completion` choice: `text`, with the logprobs of the output tokens from
    `start` on (None when the request asked for none, or there are none new). The choice's
    first (`opens`) gives its prompt first where the request asked for an echo."""
    echo = gen.echo if opens else None
    if gen.echo is not None and gen.echo.only:
        text, start = "", len(gen.token_logprobs)  # the prompt alone
    asked = gen.params.logprobs is not None
    return {"index": gen.index, "text": text if echo is None else echo.text + text,
            "logprobs": legacy_logprobs(gen, start, with_prompt=echo is not None) if asked and (
                echo is not None or len(gen.token_logprobs) > start) else None,
            "finish_reason": finish_reason}


def legacy_logprobs(gen: Generation, start: int = 0,
                    with_prompt: bool = False) -> dict[str, Any]:
    """The legacy completions' `logprobs` of output tokens from `start` on, after the
    prompt's (`with_prompt`, for an echo): their texts, log probabilities, likeliest
    alternatives (with the chosen token, as OpenAI gives it) and offsets in the choice's
    text. The prompt's first token has no logprob (null), as in OpenAI's and vLLM's."""
    # (token, logprob, alternatives, offset) of each token listed
    entries: list[tuple[str, float | None, dict[str, float] | None, int]] = []

    def add(tokens: Sequence[TokenLogprob | None], offset: int) -> None:
        for t in tokens:
            assert t is not None  # only a prompt's first token has none, listed apart
            entries.append((t.token, t.logprob, {**dict(t.top), t.token: t.logprob}, offset))
            offset += len(t.token)

    echo = gen.echo
    if with_prompt and echo is not None:
        entries.append((echo.first_token, None, None, 0))
        add(gen.prompt_logprobs[1:], len(echo.first_token))
    add(gen.token_logprobs[start:], (len(echo.text) if echo is not None else 0)
        + sum(len(t.token) for t in gen.token_logprobs[:start]))
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def text_completion_object(gens: Sequence[Generation], model: str) -> dict[str, Any]:
    """The non-streaming `text_completion` response of a request's finished choices."""
    return {"id": "cmpl-" + gens[0].request_id, "object": "text_completion",
            "created": gens[0].created, "model": model,
            "choices": [text_choice(g, g.text, 0, g.finish_reason, opens=True) for g in gens],
            "usage": total_usage(gens)}
