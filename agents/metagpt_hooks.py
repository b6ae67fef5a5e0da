"""Call-graph advisories for a real MetaGPT team (the `metagpt` package, 0.8.2) on Antiphon.

MetaGPT talks to Antiphon through the OpenAI-compatible API. `MetaGPTAdvisor.attach(env)` hooks
a team in place, changing nothing in MetaGPT:

- each role gets an Antiphon session, and every model call of the role carries it
  (`vllm_xargs.session_id`), so the server keeps the call's exact tokens as the session's
  context, in the KV tiers;
- when a role's model call starts, the roles watching the action it is running (`rc.todo`) get
  an advisory through the same `CallGraphHooks` as `antiphon.agents.team`: expected arrival is
  the fastest first token seen for the calling role (Symphony's lower bound);
- `Environment.publish_message` advises the roles a message wakes (MetaGPT's own rule: the
  message's `cause_by` is watched, or the role is named in `send_to`), due now.

Every call is timed (`MetaGPTAdvisor.calls`): first token, total, advisory lead time.

The module never imports metagpt. It works on MetaGPT's objects by their attributes
(`env.roles`, `role.name`, `role.rc.watch`, `role.rc.todo`, `role.llm.aclient`,
`message.cause_by`, `message.send_to`), so its logic is tested without the package, whose pins
clash with vLLM's; `examples/metagpt/` runs it with the real one. Attach after hiring the roles
and before running the team.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Collection, Sequence
from typing import Any

from antiphon.agents.client import AsyncAntiphon
from antiphon.agents.team import Advising, CallGraphHooks, create_sessions, stop_all

# The attribute a hooked `completions.create` carries (`MetaGPTAdvisor.attach` hooks one once).
_HOOKED = "_antiphon_advisor_hook"
ROUTE_TO_ALL = "<all>"  # MetaGPT's MESSAGE_ROUTE_TO_ALL: a message for every role


@dataclasses.dataclass(eq=False)
class TeamRole:
    """What the hooks need of a MetaGPT role."""

    name: str
    watch: frozenset[str]
    """The actions it reacts to, as MetaGPT names them (`module.ClassName`)."""
    session_id: str | None = None
    addresses: frozenset[str] = frozenset()
    """Where MetaGPT delivers messages to it (`Role.addresses`; its name where none)."""


@dataclasses.dataclass(frozen=True)
class ActionName:
    name: str


@dataclasses.dataclass(frozen=True)
class CallTiming:
    role: str
    action: str
    started_at: float
    client_ttft_s: float
    """To the first streamed content (the whole call when not streamed)."""
    total_s: float
    advisory_lead_s: float | None
    """From the advisory for this role's session to this call's start (None: none)."""


class TeamGraph:
    def __init__(self, roles: Sequence[TeamRole] = ()) -> None:
        self.roles = list(roles)

    def subscribers(self, action_name: str) -> list[TeamRole]:
        return [r for r in self.roles if action_name in r.watch]

    def recipients(self, cause_by: str, send_to: Collection[str]) -> list[TeamRole]:
        """The roles a published message makes act: those MetaGPT delivers it to
        (`Environment.publish_message`: `send_to` holds "<all>" or one of the role's
        addresses), and of those, the ones its `Role._observe` filter keeps (they watch
        `cause_by`, or `send_to` names them)."""
        return [r for r in self.roles
                if (ROUTE_TO_ALL in send_to or not r.addresses.isdisjoint(send_to))
                and (cause_by in r.watch or r.name in send_to)]


def action_name(action: object) -> str:
    """MetaGPT's name of an action (class or instance): `module.ClassName`."""
    cls = action if isinstance(action, type) else type(action)
    return f"{cls.__module__}.{cls.__name__}"


def with_session(kwargs: dict[str, Any], session_id: str) -> dict[str, Any]:
    """OpenAI `chat.completions.create` keyword arguments that run the call in `session_id`."""
    extra_body = dict(kwargs.get("extra_body") or {})
    extra_body["vllm_xargs"] = {**(extra_body.get("vllm_xargs") or {}), "session_id": session_id}
    return {**kwargs, "extra_body": extra_body}


class MetaGPTAdvisor:
    def __init__(self, client: AsyncAntiphon, hooks: CallGraphHooks | None = None, *,
                 session_prefix: str = "metagpt:", advisory_wait_s: float = 0.25) -> None:
        """`advisory_wait_s`: how long a role's model call waits at most for an advisory to its
        own session still being sent (a message published just before the call): an advisory
        that reaches the engine after the call is too late to be used."""
        if advisory_wait_s < 0:
            raise ValueError(f"advisory_wait_s must be >= 0, got {advisory_wait_s}")
        self.client = client
        self.hooks = hooks if hooks is not None else CallGraphHooks(client)
        self.session_prefix = session_prefix
        self.advisory_wait_s = advisory_wait_s
        self.graph = TeamGraph()
        self.calls: list[CallTiming] = []
        self._pending: set[asyncio.Task[None]] = set()
        self._advising: dict[str, set[asyncio.Task[None]]] = {}  # session: advisories sending
        # session: the renewal of the advisory a published message sent it, until it calls
        self._renewing: dict[str, Advising] = {}

    async def attach(self, env: Any) -> TeamGraph:
        """Open a session for each of `env`'s roles and hook their model calls and
        `env.publish_message`. Raises ValueError, changing nothing, where roles share one
        LLM client (`Role(llm=shared)`): its calls cannot be told apart by role, and hooked
        for each, every call ran in one role's session; and where a role's client is hooked
        already (an advisor attached before: hooked again, its calls ran in the first
        advisor's sessions and this one's advisories went to sessions never called). Where
        a session fails to open, those opened go again and nothing is hooked."""
        owners: dict[int, str] = {}
        for role in env.roles.values():
            completions = role.llm.aclient.chat.completions
            shared = owners.setdefault(id(completions), role.name)
            if shared != role.name:
                raise ValueError(f"roles {shared} and {role.name} share one LLM client: give "
                                 "each role its own, for each to run in its own session")
            if getattr(completions.create, _HOOKED, False):
                raise ValueError(f"role {role.name}'s LLM client is hooked by an advisor "
                                 "already: attach one advisor to a team")
        views = [TeamRole(role.name, frozenset(role.rc.watch), addresses=frozenset(
            getattr(role, "addresses", None) or {role.name})) for role in env.roles.values()]
        ids = await create_sessions(self.client, [f"{self.session_prefix}{role.name}"
                                                  for role in env.roles.values()])
        for view, session_id in zip(views, ids, strict=True):
            view.session_id = session_id
        for role, view in zip(env.roles.values(), views, strict=True):
            self.graph.roles.append(view)
            self._hook_calls(role, view)
        self._hook_publish(env)
        return self.graph

    async def drain(self) -> None:
        """Stop renewing advisories, and wait for those still being sent."""
        renewing, self._renewing = list(self._renewing.values()), {}
        await stop_all(renewing)  # (each told at once: a cancel here leaves none running)
        while self._pending:
            await asyncio.gather(*self._pending)

    def _spawn(self, advising: Awaitable[None], *session_ids: str | None) -> None:
        # Advisories go out beside the calls; only a call to an advised session waits for it.
        task = asyncio.ensure_future(advising)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        for session_id in session_ids:
            if session_id is not None:
                sending = self._advising.setdefault(session_id, set())
                sending.add(task)
                task.add_done_callback(sending.discard)

    def _stop(self, advising: Advising, action: ActionName) -> None:
        """No more advisories from `advising`; one being sent finishes beside the caller (a
        call waited for it: an advisory answered late, between an engine's long steps, held
        up the model call's own reply), and the calls of the roles it advises (those that
        watch `action`, which run once this call is done) wait for it as for any advisory."""
        advising.stop_soon()
        self._spawn(stop_all([advising]),
                    *(role.session_id for role in self.graph.subscribers(action.name)))

    async def _advisory_sent(self, session_id: str) -> None:
        """Let the advisories to `session_id` still being sent reach the server first (at most
        `advisory_wait_s`)."""
        sending = self._advising.get(session_id)
        if sending and self.advisory_wait_s > 0:
            await asyncio.wait(set(sending), timeout=self.advisory_wait_s)

    def _hook_calls(self, role: Any, view: TeamRole) -> None:
        completions = role.llm.aclient.chat.completions
        create = completions.create
        session_id = view.session_id
        assert session_id is not None

        async def hooked_create(*args: Any, **kwargs: Any) -> Any:
            action = ActionName(action_name(role.rc.todo))
            renewing = self._renewing.pop(session_id, None)
            if renewing is not None:  # (before the lead is taken: a renewal notes none after)
                renewing.stop_soon()
                self._spawn(renewing.stop())
            lead = self.hooks.take_lead(view)
            advising = self.hooks.advise_during_call(self.graph, view, action)
            started = time.perf_counter()  # the wait below counts in the call's time
            try:
                await self._advisory_sent(session_id)
                response = await create(*args, **with_session(kwargs, session_id))
            except BaseException:
                self._stop(advising, action)
                raise
            if kwargs.get("stream"):
                return self._timed(response, view, action, started, lead, advising)
            self._stop(advising, action)
            await self._finish(view, action, started, time.perf_counter() - started, lead)
            return response

        setattr(hooked_create, _HOOKED, True)
        completions.create = hooked_create

    async def _timed(self, stream: AsyncIterator[Any], view: TeamRole, action: ActionName,
                     started: float, lead: float | None,
                     advising: Advising) -> AsyncIterator[Any]:
        ttft_s = None
        try:
            async for chunk in stream:
                if ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft_s = time.perf_counter() - started
                yield chunk
        finally:
            self._stop(advising, action)
        total_s = time.perf_counter() - started
        await self._finish(view, action, started, total_s if ttft_s is None else ttft_s, lead)

    async def _finish(self, view: TeamRole, action: ActionName, started: float,
                      ttft_s: float, lead: float | None) -> None:
        timing = CallTiming(view.name, action.name, started, ttft_s,
                            time.perf_counter() - started, lead)
        self.calls.append(timing)
        await self.hooks.call_ended(self.graph, view, action, timing)

    def _hook_publish(self, env: Any) -> None:
        publish = env.publish_message

        def hooked_publish(message: Any, *args: Any, **kwargs: Any) -> Any:
            result = publish(message, *args, **kwargs)
            if not self.hooks.send_advisories:  # measuring only (`run.py --no-hints`)
                return result
            try:  # (MetaGPT publishes the idea before `asyncio.run(company.run())`)
                asyncio.get_running_loop()
            except RuntimeError:  # no loop to send on: an advisory is only a hint
                return result
            for role in self.graph.recipients(message.cause_by, message.send_to):
                # Due now. Renewed for roles advised at the call's start: that advisory was due
                # at the call's first token and may expire before a long call ends. Noted at
                # once, since the role may call before the advisory task first runs.
                if role.session_id is None:
                    continue
                note = self.hooks.note_advisory(role.session_id)
                self._spawn(self.hooks.advise(role, 0.0, note=note), role.session_id)
                # And renewed until the role calls: MetaGPT runs it once every role of the
                # round is done, and a longer call beside the one that woke it outlasted the
                # advisory (found by a review).
                if role.session_id not in self._renewing:
                    self._renewing[role.session_id] = Advising(
                        functools.partial(self.hooks.advise, role, 0.0), self.hooks.refresh_s,
                        send_now=False)
            return result

        # MetaGPT's Environment is a pydantic model, which refuses unknown attributes.
        object.__setattr__(env, "publish_message", hooked_publish)
