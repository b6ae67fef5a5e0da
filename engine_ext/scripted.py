"""An engine that emits scripted tokens: a test double and a readable reference for `Engine`.

Tokens are whitespace-separated words; the prompt "tokenizer" counts one token per character so
context limits can be exercised with small inputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence

from antiphon.engine_ext.engine import (
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineRequestFailedError,
)
from antiphon.engine_ext.tool_calls import hermes_turns
from antiphon.engine_ext.types import (
    ChatTurn,
    Delta,
    EngineHealth,
    GenerationParams,
    TokenLogprob,
    ToolSpec,
)


def echo_reply(turns: Sequence[ChatTurn]) -> str:
    last_user = next((t.content for t in reversed(turns) if t.role == "user"), "")
    return f"You said: {last_user}"


def _logprobs(text: str, top: int | None) -> tuple[TokenLogprob, ...]:
    """The scripted reply is certain: each word has log probability 0, and the runners-up
    (when asked for) ever less likely ones."""
    if top is None:
        return ()
    return (TokenLogprob(text, 0.0, tuple((text if k == 0 else f"{text}~{k}", -float(4 * k))
                                          for k in range(top))),)


def _prompt_logprobs(prompt_token_ids: Sequence[int],
                     top: int | None) -> tuple[TokenLogprob | None, ...]:
    """As `_logprobs`, for each prompt "token" (character) after the first."""
    if top is None:
        return ()
    return (None, *(_logprobs(chr(c), top)[0] for c in prompt_token_ids[1:]))


class ScriptedEngine(Engine):
    def __init__(
        self,
        reply: Callable[[Sequence[ChatTurn]], str] = echo_reply,
        token_delay_s: float = 0.0,
        max_model_len: int = 4096,
        model_name: str = "scripted",
    ) -> None:
        self.reply = reply
        self.token_delay_s = token_delay_s
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.vocab_size = 0x110000  # its tokens are characters
        self.active_request_ids: set[str] = set()
        self.finished_request_ids: list[str] = []
        self.advisories: list[tuple[str, list[int], float | None]] = []
        self.advisory_priorities: list[int] = []
        self.forgotten: list[tuple[str, list[list[int]], str | None]] = []  # `forget` calls
        self.kept: list[list[list[int]] | None] = []  # their `keep`
        self.cache_salts: list[str | None] = []  # of each request, then each advisory
        self.params: list[GenerationParams] = []  # of each request, in order
        self.request_prompts: list[list[int]] = []  # of each request, in order (token ids)
        self._replies: dict[tuple[int, ...], str] = {}
        self._is_running = False
        self._is_dead = False
        self._fail_next = False

    def die(self) -> None:
        """Fail as vLLM does when its engine process dies: every request, running or new,
        raises `EngineDeadError` from now on."""
        self._is_dead = True

    def fail_next_request(self) -> None:
        """Fail the next request as vLLM fails one it cannot serve
        (`EngineRequestFailedError`), after its prompt was accepted; the engine serves on."""
        self._fail_next = True

    @property
    def is_dead(self) -> bool:
        return self._is_dead

    def _check_alive(self) -> None:
        if self._is_dead:
            raise EngineDeadError("the scripted engine died")

    async def start(self) -> None:
        self._is_running = True

    def render_chat(self, turns: Sequence[ChatTurn], *, open_reply: bool = True,
                    tools: Sequence[ToolSpec] = ()) -> list[int]:
        if not turns:  # as Hugging Face chat templates do
            raise ValueError("Cannot apply chat template to an empty conversation.")
        turns = hermes_turns(turns, tools)  # its template knows no tools
        text = "".join(f"<{t.role}>{t.content}\n" for t in turns)
        if not open_reply:
            return [ord(c) for c in text]
        ids = [ord(c) for c in text + "<assistant>"]
        self._replies[tuple(ids)] = self.reply(turns)
        return ids

    def count_tokens(self, text: str) -> int:
        return len(text)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        self._replies[tuple(ids)] = self.reply([ChatTurn("user", text)])
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(map(chr, token_ids))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[Delta, None]:
        self._check_alive()
        if self._fail_next:
            self._fail_next = False
            raise EngineRequestFailedError("the scripted engine failed the request")
        if request_id in self.active_request_ids:
            raise EngineRequestError(f"request {request_id} is already running")
        if len(prompt_token_ids) >= self.max_model_len:
            raise EngineRequestError("prompt is longer than the model context")
        self.cache_salts.append(params.cache_salt)
        self.params.append(params)
        self.request_prompts.append(list(prompt_token_ids))
        reply = self._replies.get(tuple(prompt_token_ids), "ok")
        stops = [at for at in (reply.find(stop) for stop in params.stop if stop) if at >= 0]
        if stops:  # as vLLM: the reply ends before its first stop string, which it leaves out
            reply = reply[:min(stops)]
        words = reply.split(" ")
        self.active_request_ids.add(request_id)
        try:
            for i, word in enumerate(words[: params.max_tokens]):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                self._check_alive()
                is_last = i == min(len(words), params.max_tokens) - 1
                reason = None
                if is_last:
                    reason = "stop" if len(words) <= params.max_tokens else "length"
                text = word if i == 0 else " " + word
                yield Delta(
                    text=text,
                    token_ids=tuple(map(ord, text)),  # its prompt "tokens" are characters
                    num_new_tokens=1,
                    finished=is_last,
                    finish_reason=reason,
                    num_prompt_tokens=len(prompt_token_ids),
                    logprobs=_logprobs(text, params.logprobs),
                    prompt_logprobs=(_prompt_logprobs(prompt_token_ids, params.prompt_logprobs)
                                     if i == 0 else ()),
                )
        finally:
            self.active_request_ids.discard(request_id)
            self.finished_request_ids.append(request_id)

    async def advise(self, session_id: str, context_token_ids: list[int],
                     expected_arrival_s: float | None,
                     cache_salt: str | None = None, priority: int = 0) -> int | None:
        """Recorded in `advisories` (and `advisory_priorities`); no KV tiers here, so None."""
        self.advisories.append((session_id, list(context_token_ids), expected_arrival_s))
        self.advisory_priorities.append(priority)
        self.cache_salts.append(cache_salt)
        return None

    async def health(self) -> EngineHealth:
        return EngineHealth(self._is_running and not self._is_dead, self.model_name,
                            len(self.active_request_ids))

    async def shutdown(self) -> None:
        self._is_running = False

    async def forget(self, session_id: str, chains: Sequence[Sequence[int]],
                     cache_salt: str | None = None,
                     keep: Sequence[Sequence[int]] | None = None) -> int | None:
        """Recorded in `forgotten` (and `keep` in `kept`); no KV tiers here, so None."""
        self._check_alive()
        self.forgotten.append((session_id, [list(c) for c in chains], cache_salt))
        self.kept.append(None if keep is None else [list(c) for c in keep])
        return None
