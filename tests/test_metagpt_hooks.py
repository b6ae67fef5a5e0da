"""The MetaGPT adapter's logic without metagpt: objects shaped like MetaGPT's roles and
environment, whose model calls go through the real OpenAI client to a live server (scripted
engine: it echoes the last user message, 10 ms a token)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from antiphon.agents import AsyncAntiphon
from antiphon.agents.metagpt_hooks import MetaGPTAdvisor, action_name, with_session
from tests.conftest import Scripted
from tests.test_agents_sdk import advisories_counted


class UserRequirement:
    pass


class WriteDesign:
    pass


class WriteCode:
    pass


@dataclasses.dataclass
class Message:  # the fields of metagpt.schema.Message the adapter reads
    content: str
    cause_by: str
    send_to: set[str] = dataclasses.field(default_factory=lambda: {"<all>"})


class Environment:  # metagpt.environment.Environment's shape
    def __init__(self, roles: list[Any]) -> None:
        self.roles = {r.name: r for r in roles}
        self.published: list[Message] = []

    def publish_message(self, message: Message, peekable: bool = True) -> bool:
        self.published.append(message)
        return True


def role(url: str, name: str, watch: type) -> Any:
    llm = SimpleNamespace(aclient=openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                                     max_retries=0))
    return SimpleNamespace(name=name, rc=SimpleNamespace(watch={action_name(watch)}, todo=None),
                           llm=llm)


async def call(r: Any, todo: type, content: str, stream: bool = False) -> str:
    r.rc.todo = todo()  # MetaGPT sets the role's todo before the action asks the model
    messages = [{"role": "system", "content": f"You are the {r.name}."},
                {"role": "user", "content": content}]
    out = await r.llm.aclient.chat.completions.create(
        model="scripted", messages=messages, stream=stream)
    if not stream:
        return out.choices[0].message.content
    return "".join([c.choices[0].delta.content or "" async for c in out if c.choices])


def test_action_names_and_session_kwargs() -> None:
    assert action_name(WriteCode) == action_name(WriteCode()) == f"{__name__}.WriteCode"
    kwargs = {"model": "m", "extra_body": {"vllm_xargs": {"request_class": "rt"}, "x": 1}}
    assert with_session(kwargs, "s_1") == {"model": "m", "extra_body": {
        "vllm_xargs": {"request_class": "rt", "session_id": "s_1"}, "x": 1}}
    assert kwargs["extra_body"] == {"vllm_xargs": {"request_class": "rt"}, "x": 1}  # untouched


async def test_calls_run_in_role_sessions_and_advise_the_watchers(scripted: Scripted) -> None:
    url, engine = scripted.url, scripted.engine
    architect = role(url, "architect", UserRequirement)
    engineer = role(url, "engineer", WriteDesign)
    reviewer = role(url, "reviewer", WriteCode)
    reviewer.addresses = {"qa", "reviewer"}
    env = Environment([architect, engineer, reviewer])
    async with AsyncAntiphon(url) as client:
        advisor = MetaGPTAdvisor(client)
        graph = await advisor.attach(env)
        titles = {s.title: s.session_id for s in await client.list_sessions()}
        sessions = {r.name: r.session_id for r in graph.roles}
        assert titles == {f"metagpt:{name}": sid for name, sid in sessions.items()}

        assert await call(architect, WriteDesign, "design it") == "You said: design it"
        await advisor.drain()
        assert advisories_counted(url, "rest") == 1  # the engineer, which watches WriteDesign
        assert engine.advisories == []  # its session has said nothing yet: nothing to move

        assert await call(engineer, WriteCode, "code it", stream=True) == "You said: code it"
        await advisor.drain()
        assert advisories_counted(url, "rest") == 2  # the reviewer
        assert [c.role for c in advisor.calls] == ["architect", "engineer"]
        assert advisor.calls[0].advisory_lead_s is None
        assert advisor.calls[1].advisory_lead_s is not None  # advised during the architect's call
        assert 0 < advisor.calls[1].client_ttft_s <= advisor.calls[1].total_s

        await call(architect, WriteDesign, "again")
        await advisor.drain()
        # The engineer's session now holds its last call; the advisory brings it forward, due
        # no sooner than the architect's fastest first token so far (its first call's).
        advised, tokens, arrival = engine.advisories[-1]
        assert advised == sessions["engineer"]
        assert engine.decode(tokens) == \
            "<system>You are the engineer.\n<user>code it\n<assistant>You said: code it"
        assert arrival == advisor.calls[0].client_ttft_s

        # Publishing wakes the roles it is sent to, by watch (the engineer) or by name (the
        # architect), due now; not the reviewer, to whose address it goes but who neither
        # watches it nor is named.
        env.publish_message(Message("done", action_name(WriteDesign),
                                    {"architect", "engineer", "qa"}))
        await advisor.drain()
        assert len(env.published) == 1
        # The engineer's conversation has not changed since its advisory during the
        # architect's call, due already: the server may take it for a repeat (within
        # --advisory-repeat-interval-s) and not send it again.
        repeats = advisories_counted(url, "rest", "antiphon_advisory_repeats")
        assert advisories_counted(url, "rest") + repeats == 5 and repeats <= 1
        arrivals = {(sid, arrival) for sid, _, arrival in engine.advisories[-2:]}
        assert (sessions["architect"], 0.0) in arrivals
        assert repeats or (sessions["engineer"], 0.0) in arrivals
        assert advisor.hooks.num_advisories == 5 and advisor.hooks.num_advisory_errors == 0
        # A call right after a publish finds its advisory, though it may not be sent yet.
        env.publish_message(Message("go", action_name(WriteCode)))
        await call(reviewer, WriteDesign, "review")
        assert advisor.calls[-1].advisory_lead_s is not None
        await advisor.drain()
    stats = httpx.get(url + f"/v1/sessions/{sessions['architect']}").json()
    assert stats["messages"] == []  # the OpenAI client keeps the conversation itself


async def test_a_call_right_after_a_publish_waits_for_its_advisory(scripted: Scripted) -> None:
    """The advisory for a role that a publish wakes reaches the engine before that role's
    call, not beside it (too late to be used): the call waits for it, briefly."""
    url, engine = scripted.url, scripted.engine
    architect = role(url, "architect", UserRequirement)
    engineer = role(url, "engineer", WriteDesign)
    env = Environment([architect, engineer])
    events: list[str] = []
    advise, generate = engine.advise, engine.generate

    async def recorded_advise(session_id: str, *args: Any) -> Any:
        events.append(f"advise {session_id}")
        return await advise(session_id, *args)

    def recorded_generate(request_id: str, prompt: list[int], params: Any) -> Any:
        events.append("generate " + engine.decode(prompt).split("\n")[0])
        return generate(request_id, prompt, params)

    engine.advise, engine.generate = recorded_advise, recorded_generate  # type: ignore[method-assign]
    async with AsyncAntiphon(url) as client:
        advisor = MetaGPTAdvisor(client)
        graph = await advisor.attach(env)
        engineer_session = next(r.session_id for r in graph.roles if r.name == "engineer")
        await call(engineer, WriteCode, "code it")  # the session now has context to move
        await advisor.drain()
        events.clear()
        env.publish_message(Message("design done", action_name(WriteDesign)))
        await call(engineer, WriteCode, "code it again")
        await advisor.drain()
    assert events.index(f"advise {engineer_session}") < events.index(
        "generate <system>You are the engineer.")
    assert advisor.calls[-1].advisory_lead_s is not None
    with pytest.raises(ValueError, match="advisory_wait_s"):
        MetaGPTAdvisor(client, advisory_wait_s=-1)


async def test_an_advisory_answered_late_does_not_hold_up_the_call_that_sent_it(
        scripted: Scripted) -> None:
    """The call waited for its advisories still being sent once its own reply was in: the
    engine answers an advisory between steps, and a slow one held the reply back."""
    url = scripted.url
    architect = role(url, "architect", UserRequirement)
    engineer = role(url, "engineer", WriteDesign)
    answered: list[float] = []
    async with AsyncAntiphon(url) as client:
        advise = client.advise

        async def slow_advise(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(1.5)
            answered.append(time.perf_counter())
            return await advise(*args, **kwargs)

        client.advise = slow_advise  # type: ignore[method-assign]
        advisor = MetaGPTAdvisor(client)
        graph = await advisor.attach(Environment([architect, engineer]))
        engineer_session = next(r.session_id for r in graph.roles if r.name == "engineer")
        started = time.perf_counter()
        await call(architect, WriteDesign, "design it")  # advises the engineer meanwhile
        returned = time.perf_counter() - started
        # The engineer's call, which comes next, still waits for it (`advisory_wait_s`).
        assert advisor._advising.get(engineer_session)
        await advisor.drain()  # (which does wait for it)
    assert returned < 1.0 and answered, returned


def test_a_message_published_outside_an_event_loop_is_delivered(scripted: Scripted) -> None:
    """MetaGPT publishes the idea (`run_project`) before `asyncio.run(company.run())`: sending
    its advisories needed a running loop, and the publish raised."""
    env = Environment([role(scripted.url, "engineer", WriteDesign)])

    async def attach() -> MetaGPTAdvisor:
        client = AsyncAntiphon(scripted.url)
        advisor = MetaGPTAdvisor(client)
        await advisor.attach(env)
        await client.close()
        return advisor

    asyncio.run(attach())
    assert env.publish_message(Message("design done", action_name(WriteDesign)))
    assert len(env.published) == 1


async def test_measuring_only_sends_no_advisory_on_publish(scripted: Scripted) -> None:
    # `run.py --no-hints` (hooks with send_advisories=False) still advised the roles a
    # publish woke: its baseline had advisories in it.
    from antiphon.agents.team import CallGraphHooks

    url = scripted.url
    architect = role(url, "architect", UserRequirement)
    engineer = role(url, "engineer", WriteDesign)
    env = Environment([architect, engineer])
    async with AsyncAntiphon(url) as client:
        advisor = MetaGPTAdvisor(client, CallGraphHooks(client, send_advisories=False))
        await advisor.attach(env)
        await call(architect, WriteDesign, "design it")
        env.publish_message(Message("done", action_name(WriteDesign)))
        await advisor.drain()
        assert advisories_counted(url, "rest") == 0
        assert advisor.hooks.num_advisories == 0


async def test_a_message_advises_only_the_roles_metagpt_delivers_it_to(
        scripted: Scripted) -> None:
    """A message for Bob advised Alice too, who watches its action but never gets it
    (MetaGPT's environment delivers by `send_to` and the role's addresses first)."""
    alice, bob = role(scripted.url, "Alice", WriteDesign), role(scripted.url, "Bob", WriteDesign)
    carol = role(scripted.url, "Carol", WriteDesign)
    carol.addresses = {"reviewers", "Carol"}
    env = Environment([alice, bob, carol])
    advised = []
    async with AsyncAntiphon(scripted.url) as client:
        advisor = MetaGPTAdvisor(client)
        graph = await advisor.attach(env)
        names = {r.session_id: r.name for r in graph.roles}
        for send_to in ({"Bob"}, {"reviewers"}, {"<all>"}):
            advisor.hooks.advised_at.clear()
            env.publish_message(Message("news", action_name(WriteDesign), send_to))
            await advisor.drain()
            advised.append(sorted(names[s] for s in advisor.hooks.advised_at))
    assert advised == [["Bob"], ["Carol"], ["Alice", "Bob", "Carol"]]


async def test_a_published_message_advises_its_role_until_it_calls_and_no_later() -> None:
    # MetaGPT runs a woken role once every role of the round is done: advised once at the
    # publish, a longer call beside the one that woke it outlasted the advisory. And an
    # advisory task that ran after the role's call had begun noted itself again, so the
    # role's next call reported a lead no advisory had given it (found by a review).
    import asyncio
    import time

    from antiphon.agents.metagpt_hooks import TeamRole
    from antiphon.agents.team import CallGraphHooks

    class Client:
        def __init__(self) -> None:
            self.advised: list[float] = []

        async def advise(self, session_id: str, expected_arrival: float | None) -> None:
            self.advised.append(time.perf_counter())
            await asyncio.sleep(0.005)

    async def create(*args: Any, **kwargs: Any) -> str:
        await asyncio.sleep(0.01)
        return "reply"

    client = Client()
    advisor = MetaGPTAdvisor(client, CallGraphHooks(client, refresh_s=0.05))  # type: ignore[arg-type]
    completions = SimpleNamespace(create=create)
    bob = SimpleNamespace(name="Bob", rc=SimpleNamespace(todo=WriteCode(), watch=set()),
                          llm=SimpleNamespace(aclient=SimpleNamespace(
                              chat=SimpleNamespace(completions=completions))))
    view = TeamRole("Bob", frozenset({action_name(WriteDesign)}), session_id="s_bob",
                    addresses=frozenset({"Bob"}))
    advisor.graph.roles.append(view)
    advisor._hook_calls(bob, view)
    env = Environment([])
    advisor._hook_publish(env)

    env.publish_message(Message("design", action_name(WriteDesign)))
    await asyncio.sleep(0.3)  # another role's longer call of the round
    assert len(client.advised) >= 4  # renewed while Bob waited
    await completions.create(model="m", messages=[])  # Bob's call
    assert advisor.calls[-1].advisory_lead_s is not None
    advised = len(client.advised)
    await asyncio.sleep(0.2)
    assert len(client.advised) == advised  # not after it began

    env.publish_message(Message("design", action_name(WriteDesign)))
    await completions.create(model="m", messages=[])  # at once: before its advisory ran
    assert advisor.calls[-1].advisory_lead_s is not None
    await asyncio.sleep(0.2)
    await completions.create(model="m", messages=[])  # nothing advised it since its last
    assert advisor.calls[-1].advisory_lead_s is None
    await advisor.drain()


async def test_roles_sharing_one_llm_client_are_refused(scripted: Scripted) -> None:
    # Hooked for each role, the client's calls all ran in the last role's session, and each
    # role's turns overwrote the others' context (found by a review).
    alice, bob = role(scripted.url, "Alice", WriteDesign), role(scripted.url, "Bob", WriteCode)
    bob.llm = alice.llm  # MetaGPT's Role(llm=shared)
    async with AsyncAntiphon(scripted.url) as client:
        with pytest.raises(ValueError, match="Alice and Bob share one LLM client"):
            await MetaGPTAdvisor(client).attach(Environment([alice, bob]))
        assert await client.list_sessions() == []  # nothing opened


class FakeClient:
    """The SDK client's session and advisory calls, in memory (`fail_create_at`: the
    session open, counted from 1, that fails)."""

    def __init__(self, fail_create_at: int | None = None) -> None:
        self.sessions: list[str] = []
        self.num_created = 0
        self.fail_create_at = fail_create_at

    async def create_session(self, title: str) -> SimpleNamespace:
        self.num_created += 1
        if self.num_created == self.fail_create_at:
            raise ConnectionError("the connection dropped")
        self.sessions.append(f"s_{self.num_created}")
        return SimpleNamespace(session_id=self.sessions[-1])

    async def delete_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)

    async def advise(self, session_id: str, expected_arrival: float | None) -> None:
        pass

    async def chat(self, session_id: str, prompt: str, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(text="ok", client_ttft_s=0.01, prompt_tokens=1,
                               completion_tokens=1)


def offline_role(name: str, watch: type, calls: list[tuple[str, str]]) -> Any:
    """A MetaGPT-shaped role whose model call records (role, session) and answers "reply"."""
    async def create(*args: Any, **kwargs: Any) -> str:
        calls.append((name, kwargs["extra_body"]["vllm_xargs"]["session_id"]))
        return "reply"
    completions = SimpleNamespace(create=create)
    return SimpleNamespace(name=name, rc=SimpleNamespace(watch={action_name(watch)}, todo=None),
                           llm=SimpleNamespace(aclient=SimpleNamespace(
                               chat=SimpleNamespace(completions=completions))))


async def test_a_failing_on_call_end_hook_does_not_fail_the_call() -> None:
    """`on_call_end` ran in the call's path unguarded: an override that raised lost MetaGPT
    a reply the server had stored, and cancelled a team's whole run (found by a review)."""
    from antiphon.agents.team import USER_REQUIREMENT, Action, CallGraphHooks
    from antiphon.agents.team import Environment as Team
    from antiphon.agents.team import Role as TeamMember

    class Failing(CallGraphHooks):
        async def on_call_end(self, *args: Any) -> None:
            raise KeyError("a bug in the hook's own bookkeeping")

    client, calls = FakeClient(), []
    hooks = Failing(client)  # type: ignore[arg-type]
    advisor = MetaGPTAdvisor(client, hooks)  # type: ignore[arg-type]
    alice = offline_role("Alice", WriteDesign, calls)
    await advisor.attach(Environment([alice]))
    alice.rc.todo = WriteDesign()
    assert await alice.llm.aclient.chat.completions.create(model="m", messages=[]) == "reply"
    await advisor.drain()
    assert hooks.num_hook_errors == 1
    team = Team(client, [TeamMember("a", "p", [Action("X", "do")], [USER_REQUIREMENT])],
                hooks)  # type: ignore[arg-type]
    await team.run("task")
    assert hooks.num_hook_errors == 2 and team.calls


async def test_an_attach_that_fails_or_repeats_changes_nothing() -> None:
    """A session failing to open left the roles before it hooked and their sessions open;
    attached again, the hooks wrapped the first ones, whose session won: the calls ran in
    the old sessions and the advisories went to new, empty ones (found by a review)."""
    calls: list[tuple[str, str]] = []
    alice, bob = offline_role("Alice", WriteDesign, calls), offline_role("Bob", WriteCode, calls)
    env = Environment([alice, bob])
    unhooked = alice.llm.aclient.chat.completions.create
    client = FakeClient(fail_create_at=2)
    with pytest.raises(ConnectionError):
        await MetaGPTAdvisor(client).attach(env)  # type: ignore[arg-type]
    assert client.sessions == [] and alice.llm.aclient.chat.completions.create is unhooked
    graph = await MetaGPTAdvisor(client).attach(env)  # type: ignore[arg-type]
    alice.rc.todo = WriteDesign()
    await alice.llm.aclient.chat.completions.create(model="m", messages=[])
    assert calls == [("Alice", graph.roles[0].session_id)]
    with pytest.raises(ValueError, match="hooked by an advisor already"):
        await MetaGPTAdvisor(client).attach(env)  # type: ignore[arg-type]
    assert len(client.sessions) == 2
