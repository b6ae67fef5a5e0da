"""Generation shared by every API: validate limits, render the prompt, stream, time, count.

`ChatService.prepare` turns a conversation into a `Generation` or raises a typed `ApiError`
without side effects; `ChatService.stream` runs it on the engine and yields text pieces while
filling in the generation's usage and timings.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from antiphon.engine_ext.engine import (
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineRequestFailedError,
)
from antiphon.engine_ext.types import (
    ChatContext,
    ChatTurn,
    Delta,
    GenerationParams,
    RequestClass,
    TokenLogprob,
    ToolSpec,
)
from antiphon.server.auth import ANONYMOUS_OWNER, Authenticator
from antiphon.server.config import ServerConfig
from antiphon.server.errors import ApiError, ErrorCode, over_limit
from antiphon.server.metrics import FinishedRequest, ServerMetrics
from antiphon.server.protocol import SEED_RANGE
from antiphon.server.tools import ToolUse
from antiphon.sessions.store import TurnUndo

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Echo:
    """A text completion's `echo`: the prompt's text, given before the reply's, and the text
    of its first token (the one token no logprob is computed for). `only`: the prompt alone
    (`max_tokens` 0): the one token generated to compute it is not given, nor counted."""

    text: str
    first_token: str
    only: bool = False


@dataclasses.dataclass
class Generation:
    """One request, or one choice of a request with several: its prompt, then its output and
    timings as they arrive."""

    request_id: str  # as the client knows it (a websocket client may choose it)
    prompt_token_ids: list[int]
    params: GenerationParams
    # The engine's id: unique, so that two clients choosing the same request id never share
    # one (vLLM aborts by id).
    engine_request_id: str = dataclasses.field(
        default_factory=lambda: "q_" + secrets.token_urlsafe(12))
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))  # unix seconds
    pieces: list[str] = dataclasses.field(default_factory=list)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    tier_tokens: tuple[int, int] | None = None  # (host, SSD) of the cached ones; None: no tiers
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # if asked
    # the prompt's, where asked (None for its first token)
    prompt_logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)
    index: int = 0  # its choice in the request's response
    prompt_index: int = 0  # which of the request's prompts it completes
    echo: Echo | None = None  # a text completion that gives its prompt before its reply
    context_start: int = 0  # a session turn: the session's first message its prompt renders
    replaces_reply: bool = False  # a session turn: its reply replaces the session's last one
    # a regenerate that leaves messages out: the session's first message the model sees from
    # its reply on (the window moves when the reply is committed; None: it does not move)
    window_moves_to: int | None = None
    tool_use: ToolUse | None = None  # a chat completion with tools: how its reply holds calls
    session_claim: str | None = None  # a session turn: its hold on the session (`claim`)
    # a session turn that committed messages (a user's, or tools' results): their role and
    # contents, and what else they changed of the session, to withdraw all of it if the
    # engine refuses the turn
    committed: tuple[str, tuple[str, ...]] | None = None
    committed_undo: TurnUndo | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (seconds); None with fewer than 2."""
        if self.first_token_at is None or self.last_token_at is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.num_output_tokens - 1)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object (`total_usage` of this generation alone)."""
        return total_usage([self])

    def another_choice(self, offset: int) -> Generation:
        """Another choice of the same prompt, `offset` after this one: as in vLLM, a set seed
        becomes seed + offset, so the choices differ and each repeats."""
        params = self.params
        if params.seed is not None:  # wrapped around within the engine's range
            low, high = SEED_RANGE
            params = dataclasses.replace(
                params, seed=low + (params.seed - low + offset) % (high - low + 1))
        return Generation(self.request_id, self.prompt_token_ids, params,
                          index=self.index + offset, prompt_index=self.prompt_index,
                          echo=self.echo, tool_use=self.tool_use)

    def with_choices(self, n: int) -> list[Generation]:
        """This generation and `n` - 1 more choices of its prompt."""
        return [self, *(self.another_choice(offset) for offset in range(1, n))]

    def logprobs(self, start: int = 0) -> dict[str, Any] | None:
        """OpenAI's `logprobs` of a choice, for the output tokens from `start` on; None when
        the request did not ask for them."""
        if self.params.logprobs is None:
            return None

        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [entry(t.token, t.logprob)
                            | {"top_logprobs": [entry(*top) for top in t.top]}
                            for t in self.token_logprobs[start:]],
                "refusal": None}

    def timings(self) -> dict[str, float | None]:
        end = self.last_token_at or time.perf_counter()
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "total_s": end - self.arrival}


def total_usage(gens: Sequence[Generation]) -> dict[str, Any]:
    """OpenAI's usage object of a request's choices: each prompt counted once, every
    choice's output. A prompt's cached tokens are those its least-served choice found cached:
    the KV it had before this request (its other choices find what the first computed).
    `cached_prompt_tokens` repeats `prompt_tokens_details`'s `cached_tokens` (where
    Antiphon's clients read it); `tier_prompt_tokens`, an engine with KV tiers only, says how
    many of them its tiers loaded: from the host arena, and from SSD (through it); the rest
    were in the device's prefix cache."""
    tokens: dict[int, int] = {}  # of each prompt (by its index)
    cached: dict[int, Generation] = {}  # its least-served choice
    for g in gens:
        tokens[g.prompt_index] = len(g.prompt_token_ids)
        least = cached.get(g.prompt_index)
        if least is None or g.num_cached_tokens < least.num_cached_tokens:
            cached[g.prompt_index] = g
    n_prompt = sum(tokens.values())
    n_cached = sum(g.num_cached_tokens for g in cached.values())
    n_output = sum(g.num_output_tokens for g in gens if not (g.echo and g.echo.only))
    usage: dict[str, Any] = {
        "prompt_tokens": n_prompt, "completion_tokens": n_output,
        "total_tokens": n_prompt + n_output, "prompt_tokens_details": {"cached_tokens": n_cached},
        "cached_prompt_tokens": n_cached}
    loads = [g.tier_tokens for g in cached.values() if g.tier_tokens is not None]
    if loads:
        usage["tier_prompt_tokens"] = {"host": sum(h for h, _ in loads),
                                       "ssd": sum(s for _, s in loads)}
    return usage


class ChatService:
    def __init__(self, engine: Engine, metrics: ServerMetrics, config: ServerConfig,
                 rt_slo_s: tuple[float, float] = (1.0, 0.1)) -> None:
        """`rt_slo_s`: the deployment's default (TTFT, TPOT) targets of RT requests."""
        self.engine = engine
        self.metrics = metrics
        self.config = config
        self.rt_slo_s = rt_slo_s
        self.best_effort_owners = frozenset(
            Authenticator.fingerprint(k) for k in config.best_effort_api_keys)
        self.is_draining = False  # shutting down: live replies finish, new turns are refused
        # The server was told to stop (a signal): engine failures from now on may be the
        # engine's processes stopping with it (the same signal), not the requests' doing.
        self.stop_requested = False
        # replies streaming to clients, by id(Generation), with how many blocks hold each
        # (a websocket turn's and its stream's) (batch items are not waited for)
        self._live: collections.Counter[int] = collections.Counter()
        self._none_live = asyncio.Event()
        self._none_live.set()
        # Set when a shutdown's drain ends with replies still streaming: REST responses
        # (`choices.stream_choices`) then end with a `shutting_down` error.
        self.cut_short = asyncio.Event()
        # Rendering and tokenizing a conversation (tens of ms for a long one, more for a turn
        # that cuts its window) runs off the event loop, where it held every stream's next
        # token: a thread for chat turns, completions and advisories, and one for batch items
        # (a batch's renders do not queue ahead of a turn's).
        self._render_threads = {
            cls: concurrent.futures.ThreadPoolExecutor(1, f"render-{cls.value}")
            for cls in RequestClass}

    async def off_loop(self, fn: Callable[..., T], *args: Any,
                       request_class: RequestClass = RequestClass.RT, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a render, a request's preparation) on the render thread of
        `request_class`."""
        return await asyncio.get_running_loop().run_in_executor(
            self._render_threads[request_class], functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Let the render threads go (what they run finishes)."""
        for pool in self._render_threads.values():
            pool.shutdown(wait=False)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests may give the served model: its own, then `--model-aliases`."""
        return (self.engine.model_name,
                *(a for a in self.config.model_aliases if a != self.engine.model_name))

    def check_stop(self, stop: Sequence[str]) -> None:
        """Raises `too_large` past `--max-stop-sequences` stop sequences, or for one longer
        than `--max-stop-chars`."""
        if len(stop) > self.config.max_stop_sequences:
            raise over_limit(f"{len(stop)} stop sequences; the limit is "
                             f"{self.config.max_stop_sequences}", "stop")
        longest = max(map(len, stop), default=0)
        if longest > self.config.max_stop_chars:
            raise over_limit(f"a stop sequence of {longest} characters; the limit is "
                             f"{self.config.max_stop_chars}", "stop")

    def check_logit_bias(self, logit_bias: Sequence[tuple[int, float]]) -> None:
        """Raises `too_large` past `--max-logit-bias-tokens` tokens, and `bad_message` for a
        token id outside the model's vocabulary."""
        if len(logit_bias) > self.config.max_logit_bias_tokens:
            raise over_limit(f"logit_bias names {len(logit_bias)} tokens; the limit is "
                             f"{self.config.max_logit_bias_tokens}", "logit_bias")
        self.check_in_vocabulary([token for token, _ in logit_bias], "logit_bias")

    def request_class_for(self, owner: str, asked: RequestClass | None) -> RequestClass:
        """The class of a request of `owner`'s that asked for `asked` (None: nothing): BE
        for a key of `--best-effort-api-keys`, which may not ask for RT (`bad_message`);
        else what it asked, RT by default."""
        if owner not in self.best_effort_owners:
            return asked or RequestClass.RT
        if asked is RequestClass.RT:
            raise ApiError(ErrorCode.BAD_MESSAGE, "this API key's requests run as best-effort "
                           "work (--best-effort-api-keys): it cannot ask for rt")
        return RequestClass.BE

    def render_class(self, owner: str, xargs: Mapping[str, Any] | None = None) -> RequestClass:
        """The render thread (`off_loop`) a request of `owner`'s with `xargs` is prepared on:
        BE work's (a best-effort key's, or a request that asks for be) on the batch items', so
        an evaluation harness's renders do not queue ahead of chat turns'. (Bad `xargs` are
        refused by the preparation itself, on either thread.)"""
        asked_be = (xargs or {}).get("request_class") == RequestClass.BE.value
        if owner in self.best_effort_owners or asked_be:
            return RequestClass.BE
        return RequestClass.RT

    def check_choices(self, count: int) -> None:
        """Raises `too_large` past `--max-choices` choices in one request."""
        if count > self.config.max_choices:
            raise over_limit(f"{count} choices (n, times the prompts); the limit is "
                             f"{self.config.max_choices}", "n")

    def check_tools(self, count: int) -> None:
        """Raises `too_large` past `--max-tools` tools in one request."""
        if count > self.config.max_tools:
            raise over_limit(f"{count} tools; the limit is {self.config.max_tools}", "tools")

    def check_in_vocabulary(self, token_ids: Sequence[int], what: str) -> None:
        """Raises `bad_message` when `what` holds a token id the model does not have."""
        vocab = self.engine.vocab_size
        outside = [token for token in token_ids if vocab is not None and token >= vocab]
        if outside:
            raise ApiError(ErrorCode.BAD_MESSAGE, f"{what} holds token ids outside the "
                           f"model's vocabulary of {vocab}: {outside[:5]}")

    def check_open(self) -> None:
        """Raise `shutting_down` once a shutdown has begun."""
        if self.is_draining:
            raise ApiError(ErrorCode.SHUTTING_DOWN, "the server is shutting down; send this "
                           "again once it is back")

    @contextlib.contextmanager
    def live(self, gen: Generation) -> Iterator[None]:
        """Mark `gen`'s reply to a client as in flight until the block ends (`drain` waits);
        blocks may nest (a turn holds its reply live until its last frame, its stream
        until its last token): the reply counts once."""
        self._live[id(gen)] += 1
        self._none_live.clear()
        try:
            yield
        finally:
            self._live[id(gen)] -= 1
            if not self._live[id(gen)]:
                del self._live[id(gen)]
            if not self._live:
                self._none_live.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new turns, and wait up to `timeout_s` for the replies streaming now to
        finish; returns how many still stream, and cuts those of REST requests short."""
        self.is_draining = True
        left = await self.wait_for_replies(timeout_s)
        self.cut_short.set()  # (also a REST request that passed `check_open` just before)
        return left

    async def wait_for_replies(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the replies streaming to end (after `drain`, those it
        cut short: each kept, and a websocket turn's `done` sent); returns how many are
        left."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._none_live.wait()
        return len(self._live)

    def check_content(self, content: str, may_be_empty: bool = False, what: str = "message",
                      param: str | None = None) -> None:
        """A message's text (`what` names it in errors, `param` the field it came in) is at
        most `--max-content-chars` long, and not blank unless `may_be_empty`."""
        if len(content) > self.config.max_content_chars:
            raise over_limit(f"{what} has {len(content)} characters; the limit is "
                             f"{self.config.max_content_chars} (--max-content-chars)", param)
        if not may_be_empty and not content.strip():
            raise ApiError(ErrorCode.BAD_MESSAGE, f"{what} content is empty", param=param)

    def check_max_tokens(self, max_tokens: int | None, param: str = "max_tokens") -> None:
        """`max_tokens` (sent as `param`) is at most `--max-tokens-limit`."""
        if max_tokens is not None and max_tokens > self.config.max_tokens_limit:
            raise ApiError(ErrorCode.MAX_TOKENS_TOO_LARGE, f"{param} {max_tokens} exceeds "
                           f"the limit of {self.config.max_tokens_limit}", param=param)

    def cache_salt(self, owner: str) -> str | None:
        """What keeps `owner`'s cached KV apart from other keys' (None: shared). The owner is
        a key's fingerprint, never the key."""
        if owner == ANONYMOUS_OWNER or self.config.share_kv_across_keys:
            return None
        return owner

    def prepare(
        self,
        request_id: str,
        turns: Sequence[ChatTurn],
        max_tokens: int | None,
        request_class: RequestClass | None = None,
        session_id: str | None = None,
        context: ChatContext | None = None,
        owner: str = ANONYMOUS_OWNER,
        tools: Sequence[ToolSpec] = (),
        **sampling: Any,
    ) -> Generation:
        """Validate and render a request of `owner`'s (extending `context`, the exact tokens
        of the conversation so far, where it has one; offering the model `tools`); raises
        `ApiError` and changes nothing on bad input. Its class is `request_class`, else the
        owner's (`request_class_for`). `sampling`: the `GenerationParams` fields the request
        sets; the temperature it leaves unset is the server's default, else the model's,
        else 1."""
        prompt = self.render(turns, context, tools=tools)
        return self.prepare_prompt(request_id, prompt, max_tokens, request_class, session_id,
                                   owner, "the conversation", **sampling)

    def render(self, turns: Sequence[ChatTurn], context: ChatContext | None = None, *,
               open_reply: bool = True, tools: Sequence[ToolSpec] = ()) -> list[int]:
        """`Engine.continue_chat`; a conversation the chat template refuses is `bad_message`."""
        try:
            return self.engine.continue_chat(turns, context, open_reply=open_reply, tools=tools)
        except EngineRequestError as exc:
            raise ApiError(ErrorCode.BAD_MESSAGE, str(exc)) from exc

    def prepare_prompt(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int | None,
        request_class: RequestClass | None = None,
        session_id: str | None = None,
        owner: str = ANONYMOUS_OWNER,
        what: str = "the prompt",
        **sampling: Any,
    ) -> Generation:
        """`prepare`, for a prompt already in tokens (`what` names it in errors)."""
        request_class = self.request_class_for(owner, request_class)
        self.check_max_tokens(max_tokens)
        self.check_stop(sampling.get("stop", ()))
        self.check_logit_bias(sampling.get("logit_bias", ()))
        if not prompt:
            raise ApiError(ErrorCode.BAD_MESSAGE, f"{what} is empty")
        room = self.engine.max_model_len - len(prompt)
        if room < 1:
            raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"{what} is {len(prompt)} tokens; the model's context is "
                           f"{self.engine.max_model_len} tokens")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                           f"exceeds the model's context of {self.engine.max_model_len} tokens")
        limit = max_tokens if max_tokens is not None else min(self.config.reply_max_tokens, room)
        min_tokens = sampling.get("min_tokens") or 0
        if min_tokens > limit:
            if max_tokens is None and min_tokens <= self.config.reply_max_tokens:
                # The prompt, not the request, leaves too little room (a session's window
                # then moves on, as for a max_tokens too large).
                raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"prompt ({len(prompt)} tokens) plus min_tokens ({min_tokens}) "
                               f"exceeds the model's context of {self.engine.max_model_len}"
                               " tokens")
            raise ApiError(ErrorCode.BAD_MESSAGE, f"min_tokens ({min_tokens}) "
                           f"exceeds the reply's max_tokens ({limit})")
        defaults = {"temperature": 1.0, **self.engine.sampling_defaults}
        if self.config.default_temperature is not None:
            defaults["temperature"] = self.config.default_temperature
        params = GenerationParams(
            max_tokens=limit,
            request_class=request_class,
            session_id=session_id,
            cache_salt=self.cache_salt(owner),
            **{**defaults, **sampling},
        )
        return Generation(request_id, prompt, params)

    async def stream(self, gen: Generation, api: str) -> AsyncGenerator[str, None]:
        """Run `gen` on the engine, yielding text pieces. Cancelling aborts the request."""
        cls = gen.params.request_class.value
        self.metrics.inflight.labels(cls).inc()
        outcome, engine_failed = "error", False
        with self.live(gen) if api != "batch" else contextlib.nullcontext():
            try:
                deltas = self.engine.generate(gen.engine_request_id, gen.prompt_token_ids,
                                              gen.params)
                async with aclosing(deltas):
                    async for delta in deltas:
                        self._apply(gen, delta)
                        if delta.text:
                            yield delta.text
                outcome = "ok"
            except (asyncio.CancelledError, GeneratorExit):
                if gen.finish_reason is None:  # (a reply already whole stays as it ended)
                    outcome = "cancelled"
                    gen.finish_reason = "cancelled"
                else:
                    outcome = "ok"
                raise
            except EngineRequestError as exc:
                raise ApiError(ErrorCode.BAD_MESSAGE, str(exc)) from exc
            except EngineDeadError as exc:
                engine_failed = True
                raise ApiError(ErrorCode.ENGINE_ERROR, f"the engine failed: {exc}") from exc
            except EngineRequestFailedError as exc:
                engine_failed = True
                logger.error("request %s (engine %s) failed in the engine: %s", gen.request_id,
                             gen.engine_request_id, exc)
                raise ApiError(ErrorCode.ENGINE_ERROR,
                               f"the engine failed this request: {exc}") from exc
            finally:
                self._record(gen, api, outcome, engine_failed)

    def _apply(self, gen: Generation, delta: Delta) -> None:
        if delta.num_new_tokens:
            # Counted as they stream, so the dashboard's token rates are live.
            self.metrics.generation_tokens.labels(gen.params.request_class.value).inc(
                delta.num_new_tokens)
            now = time.perf_counter()
            if gen.first_token_at is None:
                gen.first_token_at = now
            gen.last_token_at = now
            gen.num_output_tokens += delta.num_new_tokens
        gen.num_cached_tokens = max(gen.num_cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            gen.finish_reason = delta.finish_reason
        if delta.tier_tokens is not None:
            gen.tier_tokens = delta.tier_tokens
        if delta.text:
            gen.pieces.append(delta.text)
        gen.output_token_ids.extend(delta.token_ids)
        gen.token_logprobs.extend(delta.logprobs)
        gen.prompt_logprobs.extend(delta.prompt_logprobs)

    def _record(self, gen: Generation, api: str, outcome: str,
                engine_failed: bool = False) -> None:
        m, cls = self.metrics, gen.params.request_class.value
        m.inflight.labels(cls).dec()
        m.requests.labels(api, cls, outcome).inc()
        m.prompt_tokens.labels(cls).inc(len(gen.prompt_token_ids))
        m.cached_prompt_tokens.labels(cls).inc(gen.num_cached_tokens)
        if gen.ttft_s is not None:
            m.ttft.labels(cls).observe(gen.ttft_s)
        if gen.tpot_s is not None:
            m.tpot.labels(cls).observe(gen.tpot_s)
        met_slo = None
        is_rt = gen.params.request_class is RequestClass.RT
        if outcome == "ok" and gen.last_token_at is not None:
            m.normalized_latency.labels(cls).observe(
                (gen.last_token_at - gen.arrival) / max(1, gen.num_output_tokens))
            if is_rt:
                met_slo = self._record_rt_slo(gen)
        elif is_rt and (engine_failed or outcome == "cancelled"):
            met_slo = self._record_rt_slo(gen, cut_short=True)
        m.finished.append(FinishedRequest(cls, gen.ttft_s, gen.tpot_s, met_slo))

    def _record_rt_slo(self, gen: Generation, cut_short: bool = False) -> bool | None:
        """Count an RT request against its targets; whether it met both. One `cut_short`
        (failed in the engine, or cancelled) counts where it had missed them by then: a
        failure always, a cancel only past a target (a user who stopped a reply on time is
        not the server's miss; None, uncounted). Counted as completed only, the attainment
        rose as an overloaded server failed turns, or its users gave up waiting (found by a
        review)."""
        p, m = gen.params, self.metrics
        ttft_slo = self.rt_slo_s[0] if p.ttft_slo_s is None else p.ttft_slo_s
        tpot_slo = self.rt_slo_s[1] if p.tpot_slo_s is None else p.tpot_slo_s
        if cut_short and gen.finish_reason != "cancelled":  # failed: missed both
            met_ttft = met_tpot = False
        else:
            waited_s = gen.ttft_s if gen.ttft_s is not None \
                else time.perf_counter() - gen.arrival
            met_ttft = waited_s <= ttft_slo
            met_tpot = gen.tpot_s is None or gen.tpot_s <= tpot_slo
            if cut_short and met_ttft and met_tpot:
                return None
        m.rt_slo.labels("ttft", str(met_ttft).lower()).inc()
        if gen.tpot_s is not None or not met_tpot:
            m.rt_slo.labels("tpot", str(met_tpot).lower()).inc()
        return met_ttft and met_tpot
