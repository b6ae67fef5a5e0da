"""The engine interface the server talks to, and the errors it raises.

The server never touches vLLM types: it renders a conversation to token ids, submits them with
`GenerationParams`, and reads `Delta`s. `vllm_engine.VllmEngine` is the implementation that
runs vLLM; `scripted.ScriptedEngine` the one tests and examples run without a model.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from antiphon.engine_ext.types import (
    ChatContext,
    ChatTurn,
    Delta,
    EngineHealth,
    GenerationParams,
    ToolSpec,
)


class EngineRequestError(ValueError):
    """The engine refused a request as invalid (the caller's fault, not the engine's)."""


class EngineDeadError(RuntimeError):
    """The engine process has failed; no further requests can be served."""


class EngineRequestFailedError(RuntimeError):
    """The engine failed one request (its own fault, not the caller's); it serves others."""


class Engine(abc.ABC):
    """What the server needs from a model engine."""

    model_name: str
    max_model_len: int

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start serving; returns when the engine accepts requests."""

    def stop_starting(self) -> None:
        """A stop was asked for while `start` runs (called in a signal handler, while `start`
        may block the event loop): make `start` end soon, failing or cancelled. An engine
        whose start does not block is cancelled in time as it is."""
        return None

    @abc.abstractmethod
    def render_chat(self, turns: Sequence[ChatTurn], *, open_reply: bool = True,
                    tools: Sequence[ToolSpec] = ()) -> list[int]:
        """Prompt token ids for a conversation, ending with the assistant's turn opened (or,
        without `open_reply`, with the last turn closed: the context a next turn extends),
        with `tools` offered to the model (in its template's own way where it has one, else
        in the Hermes format: `tool_calls.hermes_turns`). Raises `EngineRequestError` where
        the template refuses the conversation."""

    @abc.abstractmethod
    def count_tokens(self, text: str) -> int:
        """Number of tokens of a plain text (no special tokens)."""

    @abc.abstractmethod
    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain-text prompt (a text completion's), with the special tokens
        the tokenizer adds to one (a BOS, for models that have one), as vLLM encodes it."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's string as the tokenizer's vocabulary has it (vLLM's `/tokenize`
        `token_strs`); here, each one decoded alone."""
        return [self.decode([token]) for token in token_ids]

    special_token_ids: frozenset[int] = frozenset()  # left off the end of a reply's context
    vocab_size: int | None = None  # token ids run from 0 to vocab_size - 1 (None: unknown)
    # The model's own sampling defaults (generation_config.json, as vLLM reads them):
    # `GenerationParams` fields a request that does not set them gets.
    sampling_defaults: Mapping[str, float] = MappingProxyType({})

    def continue_chat(self, turns: Sequence[ChatTurn], context: ChatContext | None, *,
                      open_reply: bool = True, tools: Sequence[ToolSpec] = ()) -> list[int]:
        """`render_chat(turns)`, but extending `context` (the exact tokens up to the reply
        `turns[context.num_messages - 1]`) where that gives the same text, so the previous
        turn's KV is reused token for token; the rendered prompt otherwise."""
        rendered = self.render_chat(turns, open_reply=open_reply, tools=tools)
        end = 0 if context is None else context.num_messages
        if context is None or not 0 < end <= len(turns) or turns[end - 1].role != "assistant":
            return rendered
        # the reply's prompt, as text renders it
        before = self.render_chat(turns[:end - 1], tools=tools)
        emptied = self.render_chat([*turns[:end - 1], ChatTurn("assistant", ""), *turns[end:]],
                                   open_reply=open_reply, tools=tools)
        if emptied[:len(before)] != before:
            return rendered  # the template does not render the history as a prefix
        extended = [*context.token_ids, *emptied[len(before):]]
        return extended if self.decode(extended) == self.decode(rendered) else rendered

    def context_tokens(self, prompt_token_ids: Sequence[int],
                       output_token_ids: Sequence[int]) -> tuple[int, ...]:
        """`ChatContext.token_ids` of a reply generated as `output_token_ids` from
        `prompt_token_ids`."""
        output = list(output_token_ids)
        while output and output[-1] in self.special_token_ids:
            output.pop()
        return (*prompt_token_ids, *output)

    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[Delta, None]:
        """Stream the output of one request. Cancelling the iteration aborts the request and
        frees its KV pages. Raises `EngineRequestError` or `EngineDeadError`."""

    @abc.abstractmethod
    async def health(self) -> EngineHealth: ...

    @property
    def is_dead(self) -> bool:
        """The engine failed for good (its process died): every request now fails, and only
        a new engine serves again."""
        return False

    async def scheduler_stats(self) -> dict[str, Any]:
        """Scheduler counters; engines without a scheduler of their own report none."""
        return {}

    async def advise(self, session_id: str, context_token_ids: list[int],
                     expected_arrival_s: float | None,
                     cache_salt: str | None = None, priority: int = 0) -> int | None:
        """A turn of `session_id`, whose conversation so far is `context_token_ids`, is
        coming: prefetch its KV (that of requests with `cache_salt`), ahead of advisories of
        lower `priority`. Returns the context tokens the KV tiers hold, None when the engine
        keeps no tiers."""
        return None

    async def forget(self, session_id: str, chains: Sequence[Sequence[int]],
                     cache_salt: str | None = None,
                     keep: Sequence[Sequence[int]] | None = None) -> int | None:
        """`session_id` was deleted: erase from the KV tiers every chunk of the token
        sequences it ran (`chains`, with `cache_salt`), and drop its advisory. With `keep`,
        the session lives on and `chains` are old ones: every chunk of them but those of
        `keep` (its advisory stays). Returns the chunk-layers erased, None when the engine
        keeps no tiers. Raises (`ErasureIncomplete`, or what the engine raised) when the KV
        may not all be off the disk: the caller keeps the erasure, to run it again."""
        return None

    async def tiering_stats(self) -> dict[str, Any]:
        """KV tier counters (tokens served per tier, advisories, occupancy); {} without."""
        return {}

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and its processes; idempotent."""

