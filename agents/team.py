"""MetaGPT-style agents whose call graph turns into advisory requests.

Roles publish messages caused by their actions; the environment routes each message to the roles
that watch that action (MetaGPT's `_watch` / `cause_by`). Each role talks to the model in a
session of its own, so its context stays in the server's KV tiers between its calls.

Because the subscriptions are known, so is the call graph: when a role starts a model call for
an action, the roles watching that action will call the model next, no sooner than this call's
first token. `CallGraphHooks.on_call_start` sends those roles' sessions an advisory with
`expected_arrival` = the lowest prefill-plus-first-token time seen for this role (Symphony's
lower bound), so the server brings their KV forward while this call runs. The three hooks,
`on_call_start`, `on_call_end` and `expected_arrival`, are methods to override.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from antiphon.agents.client import AsyncAntiphon
from antiphon.agents.errors import AntiphonError

logger = logging.getLogger(__name__)

USER_REQUIREMENT = "UserRequirement"
# How often a call's advisories go out again while it runs: within the server's
# --advisory-ttl-s (30 s), which drops an advisory that long past its expected arrival.
ADVISORY_REFRESH_S = 15.0
ADVISING_MAX_S = 600.0  # how long a call's advisories go on being sent, at most


@dataclasses.dataclass(frozen=True)
class Message:
    content: str
    cause_by: str
    """The action that produced it (USER_REQUIREMENT for the task itself)."""
    sent_from: str


@dataclasses.dataclass
class Action:
    """One kind of model call: an instruction and a reply budget."""

    name: str
    instruction: str
    max_tokens: int = 96

    def prompt(self, role: Role, incoming: Sequence[Message]) -> str:
        received = "\n\n".join(f"[{m.sent_from}] {m.content}" for m in incoming)
        return f"You are the {role.profile}. {self.instruction}\n\n{received}"


@dataclasses.dataclass(frozen=True)
class CallRecord:
    role: str
    action: str
    started_at: float
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    advisory_lead_s: float | None
    """Time from the advisory for this role's session to this call's start (None: none)."""


class Role:
    """A named agent with actions; `watch` names the actions whose messages it reacts to."""

    def __init__(self, name: str, profile: str, actions: Sequence[Action],
                 watch: Sequence[str]) -> None:
        if not actions:
            raise ValueError(f"role {name} needs at least one action")
        self.name = name
        self.profile = profile
        self.actions = list(actions)
        self.watch = frozenset(watch)
        self.session_id: str | None = None
        self.num_calls = 0

    def choose_action(self, incoming: Sequence[Message]) -> Action:
        """The action for this reaction; the first by default (override to branch)."""
        return self.actions[0]


class Caller(Protocol):
    """An agent that calls the model in a session of its own."""

    @property
    def name(self) -> str: ...

    @property
    def session_id(self) -> str | None: ...


class CallGraph(Protocol):
    def subscribers(self, action_name: str) -> Sequence[Caller]:
        """The agents that react to `action_name`'s messages."""
        ...


class Named(Protocol):
    @property
    def name(self) -> str: ...


class TimedReply(Protocol):
    @property
    def client_ttft_s(self) -> float: ...


class CallGraphHooks:
    """Advisories from the call graph. With `send_advisories=False` it only measures.

    Works on any `CallGraph`: this module's `Environment`, or a MetaGPT team through
    `antiphon.agents.metagpt_hooks`."""

    def __init__(self, client: AsyncAntiphon, send_advisories: bool = True,
                 refresh_s: float = ADVISORY_REFRESH_S) -> None:
        """`refresh_s`: how often a call's advisories go out again while it runs (the
        server drops one `--advisory-ttl-s`, 30 s, past its expected arrival)."""
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        self.client = client
        self.send_advisories = send_advisories
        self.refresh_s = refresh_s
        self.min_first_token_s: dict[str, float] = {}
        self.advised_at: dict[str, float] = {}
        self.num_advisories = 0
        self.num_advisory_errors = 0
        self.num_hook_errors = 0  # `on_call_end`s that raised (`call_ended`)

    def expected_arrival(self, role: Caller) -> float | None:
        """Seconds until the roles after `role` call the model, at the soonest: the fastest
        prefill plus first token seen for `role` (None before its first call)."""
        return self.min_first_token_s.get(role.name)

    async def on_call_start(self, graph: CallGraph, role: Caller, action: Named) -> None:
        if not self.send_advisories:
            return
        arrival = self.expected_arrival(role)
        # (together: one after another, N roles' advisories took N answers' time)
        await asyncio.gather(*(self.advise(nxt, arrival)
                               for nxt in graph.subscribers(action.name) if nxt is not role))

    def advise_during_call(self, graph: CallGraph, role: Caller, action: Named) -> Advising:
        """`on_call_start` now, and again every `refresh_s` until the call ends
        (`Advising.stop`): sent once, the advisory expired during a call longer than the
        server keeps it, and the roles after it found their KV let go."""
        return Advising(lambda: self.on_call_start(graph, role, action), self.refresh_s)

    async def advise(self, role: Caller, expected_arrival: float | None, *,
                     note: tuple[bool, float] | None = None) -> None:
        """Advise `role`'s session (not with `send_advisories=False`); a failure is logged
        and counted, never raised. `note`: the `note_advisory` its caller made when it
        decided to advise (the role may call before this runs: noted here, after the call
        had taken its lead, the note stood for the role's next call)."""
        session_id = role.session_id
        if session_id is None or not self.send_advisories:
            return
        noted, sent_at = self.note_advisory(session_id) if note is None else note
        try:
            await self.client.advise(session_id, expected_arrival)
        except AntiphonError as exc:  # advisories are hints: never fail the workflow
            self.num_advisory_errors += 1
            logger.warning("advisory for %s failed: %s", role.name, exc)
            # (one noted by an earlier advisory, which went out, stays: a refresh failing
            # dropped the lead time of the call it had advised)
            if not noted and self.advised_at.get(session_id) == sent_at:
                del self.advised_at[session_id]
            return
        self.num_advisories += 1

    def note_advisory(self, session_id: str) -> tuple[bool, float]:
        """Whether `session_id` was advised since its last call already, and when it was
        first, noting now if not yet. Noted before the advisory is sent, so a call starting
        meanwhile finds it (a short lead)."""
        noted = session_id in self.advised_at
        return noted, self.advised_at.setdefault(session_id, time.perf_counter())

    async def call_ended(self, graph: CallGraph, role: Caller, action: Named,
                         reply: TimedReply) -> None:
        """`on_call_end`, whose failure (an override's own bookkeeping) is logged and counted
        (`num_hook_errors`), never raised: the call it reports on succeeded, and its reply
        is the workflow's (raised, MetaGPT lost a reply the server had stored, and a team's
        whole run was cancelled)."""
        try:
            await self.on_call_end(graph, role, action, reply)
        except Exception:
            self.num_hook_errors += 1
            logger.exception("on_call_end for %s failed", role.name)

    async def on_call_end(self, graph: CallGraph, role: Caller, action: Named,
                          reply: TimedReply) -> None:
        best = self.min_first_token_s.get(role.name)
        self.min_first_token_s[role.name] = reply.client_ttft_s if best is None \
            else min(best, reply.client_ttft_s)

    def take_lead(self, role: Caller) -> float | None:
        """The advisory lead time of the call `role` is starting now (and forget the
        advisory)."""
        advised = self.advised_at.pop(role.session_id or "", None)
        return None if advised is None else time.perf_counter() - advised


class Advising:
    """A call's advisories, sent now (unless not `send_now`) and every `refresh_s` until
    `stop` (for at most `ADVISING_MAX_S`: a call whose end is never seen, say a stream never
    read, does not advise for ever)."""

    def __init__(self, send: Callable[[], Awaitable[None]], refresh_s: float, *,
                 send_now: bool = True) -> None:
        self._stopped = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(send, refresh_s, send_now))

    async def _run(self, send: Callable[[], Awaitable[None]], refresh_s: float,
                   send_now: bool) -> None:
        for i in range(max(1, math.ceil(ADVISING_MAX_S / refresh_s))):
            if self._stopped.is_set():  # (stopped as its wait ran out: a send now is late)
                return
            if i or send_now:
                await send()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), refresh_s)
                return

    def stop_soon(self) -> None:
        """No more advisories; the one being sent, if any, finishes (`stop` waits for it)."""
        self._stopped.set()

    async def stop(self) -> None:
        """No more advisories; the one being sent, if any, is let finish."""
        self._stopped.set()
        await self._task


async def stop_all(advisings: Sequence[Advising]) -> None:
    """`Advising.stop` each of `advisings`, every one told before any is waited for: stopped
    one after another, a cancel (a caller's timeout) landing in one's wait left the rest
    advising for up to `ADVISING_MAX_S`, and so did one whose send had failed."""
    for advising in advisings:
        advising.stop_soon()
    for result in await asyncio.gather(*(advising.stop() for advising in advisings),
                                       return_exceptions=True):
        if isinstance(result, Exception):  # (a hook's bug: said, not lost)
            logger.error("an advising failed", exc_info=result)


async def create_sessions(client: AsyncAntiphon, titles: Sequence[str]) -> list[str]:
    """One new session per title, their ids in order; all or none (a failure deletes those
    made: left behind, they counted against the key's `--max-sessions-per-key`, and a retry,
    opening them all again beside them, was refused)."""
    ids: list[str] = []
    try:
        for title in titles:
            ids.append((await client.create_session(title)).session_id)
    except BaseException:
        await delete_sessions(client, ids)
        raise
    return ids


async def delete_sessions(client: AsyncAntiphon, session_ids: Sequence[str]) -> None:
    """Delete each of `session_ids`, as far as possible (a failure is logged, not raised: the
    error that brought the caller here is the one to tell)."""
    for session_id in session_ids:
        try:
            await client.delete_session(session_id)
        except Exception as exc:
            logger.warning("could not delete session %s: %s", session_id, exc)


class Environment:
    """Routes published messages to watching roles and runs them until nobody has work."""

    def __init__(self, client: AsyncAntiphon, roles: Sequence[Role],
                 hooks: CallGraphHooks | None = None, *, temperature: float = 0.0,
                 advisory_wait_s: float = 0.25) -> None:
        """`advisory_wait_s`: how long a round waits at most, once its calls are done, for
        their advisories still being sent (to the roles of the next round): one answered late,
        between an engine's long steps, held the next round up for as long as it took."""
        names = [r.name for r in roles]
        if len(set(names)) != len(names):
            raise ValueError(f"role names must be unique: {names}")
        if not advisory_wait_s >= 0:
            raise ValueError(f"advisory_wait_s must be >= 0, got {advisory_wait_s}")
        self.advisory_wait_s = advisory_wait_s
        self.client = client
        self.roles = list(roles)
        self.hooks = hooks if hooks is not None else CallGraphHooks(client)
        self.temperature = temperature
        self.history: list[Message] = []
        self.calls: list[CallRecord] = []
        self._inbox: dict[str, list[Message]] = {r.name: [] for r in roles}
        self._opened: list[Role] = []  # roles whose sessions `open_sessions` made

    def subscribers(self, action_name: str) -> list[Role]:
        return [r for r in self.roles if action_name in r.watch]

    def publish_message(self, message: Message) -> None:
        self.history.append(message)
        for role in self.subscribers(message.cause_by):
            self._inbox[role.name].append(message)

    async def open_sessions(self, prefix: str = "") -> None:
        """A session for each role without one, titled `prefix` and its name; all or none
        (a failure deletes those this call made: left behind, they counted against the key's
        `--max-sessions-per-key`, and a retry was refused)."""
        roles = [role for role in self.roles if role.session_id is None]
        ids = await create_sessions(self.client, [f"{prefix}{role.name}" for role in roles])
        for role, session_id in zip(roles, ids, strict=True):
            role.session_id = session_id
        self._opened.extend(roles)

    async def close_sessions(self) -> None:
        """Delete the sessions `open_sessions` made (those given with the roles stay)."""
        opened, self._opened = self._opened, []
        ids = [role.session_id for role in opened if role.session_id is not None]
        for role in opened:
            role.session_id = None
        await delete_sessions(self.client, ids)

    async def run(self, requirement: str, max_rounds: int = 20) -> list[Message]:
        """Publish `requirement` and let roles react, round by round (roles with mail in the
        same round run concurrently), until no role has mail or `max_rounds` pass. A role's
        failure stops the other roles of its round and is raised."""
        await self.open_sessions()
        self.publish_message(Message(requirement, USER_REQUIREMENT, "user"))
        stopping: set[asyncio.Future[None]] = set()  # advisories still being sent
        try:
            for _ in range(max_rounds):
                ready = [(r, self._inbox[r.name]) for r in self.roles if self._inbox[r.name]]
                if not ready:
                    break
                for role, _mail in ready:
                    self._inbox[role.name] = []
                await self._round(ready, stopping)
        finally:  # (the run is over: no call is left for them to advise)
            for task in stopping:
                task.cancel()
            await asyncio.gather(*stopping, return_exceptions=True)
        return self.history

    async def _round(self, ready: Sequence[tuple[Role, list[Message]]],
                     stopping: set[asyncio.Future[None]]) -> None:
        """Run the `ready` roles' calls together and publish their replies. Their advisories
        go on until the round ends (the roles they advise call only then; refreshed during
        its own call alone, an advisory expired while a longer call of the round ran on:
        found by a review); one still being sent then finishes beside the next round, which
        waits for it `advisory_wait_s` at most, and is added to `stopping`."""
        advisings: list[Advising] = []
        reactions = [asyncio.ensure_future(self._react(r, m, advisings)) for r, m in ready]
        try:
            messages = await asyncio.gather(*reactions)
        except BaseException:
            # A role that fails stops the others of its round (their turns are cancelled on
            # the server too): they ran on with nothing awaiting them.
            for reaction in reactions:
                reaction.cancel()
            await asyncio.gather(*reactions, return_exceptions=True)
            raise
        finally:
            for advising in advisings:
                advising.stop_soon()
            task = asyncio.ensure_future(stop_all(advisings))
            stopping.add(task)
            task.add_done_callback(stopping.discard)
            await asyncio.wait({task}, timeout=self.advisory_wait_s)
        for message in messages:
            self.publish_message(message)

    async def _react(self, role: Role, incoming: Sequence[Message],
                     advisings: list[Advising]) -> Message:
        """Run `role`'s call; its advisories, added to `advisings`, go on until stopped."""
        action = role.choose_action(incoming)
        assert role.session_id is not None
        lead = self.hooks.take_lead(role)
        # The advisories go out beside the call, not before it: they must not delay it.
        advisings.append(self.hooks.advise_during_call(self, role, action))
        started = time.perf_counter()
        reply = await self.client.chat(role.session_id, action.prompt(role, incoming),
                                       max_tokens=action.max_tokens,
                                       temperature=self.temperature)
        role.num_calls += 1
        self.calls.append(CallRecord(role.name, action.name, started, reply.client_ttft_s,
                                     time.perf_counter() - started, reply.prompt_tokens,
                                     reply.completion_tokens, lead))
        await self.hooks.call_ended(self, role, action, reply)
        return Message(reply.text, action.name, role.name)

