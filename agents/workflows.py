"""The example three-role workflow: an architect designs, an engineer writes code, a reviewer
reviews it and sends it back twice before approving (seven model calls in all).

Call graph (from the subscriptions): architect -> engineer -> reviewer -> engineer -> ...;
the reviewer's third review approves and nobody watches approvals, so the run ends there.
"""

from __future__ import annotations

from collections.abc import Sequence

from antiphon.agents.client import AsyncAntiphon
from antiphon.agents.team import (
    USER_REQUIREMENT,
    Action,
    CallGraphHooks,
    Environment,
    Message,
    Role,
)

WRITE_DESIGN = "WriteDesign"
WRITE_CODE = "WriteCode"
REQUEST_CHANGES = "RequestChanges"
APPROVE = "Approve"


class Reviewer(Role):
    """Sends the code back `rounds_back` times, then approves."""

    def __init__(self, rounds_back: int = 2, max_tokens: int = 64) -> None:
        super().__init__("reviewer", "code reviewer", [
            Action(REQUEST_CHANGES, "Review the code below. Name the two most important "
                   "changes the engineer must make.", max_tokens),
            Action(APPROVE, "Review the code below and say briefly why it is ready.",
                   max_tokens),
        ], watch=[WRITE_CODE])
        self.rounds_back = rounds_back

    def choose_action(self, incoming: Sequence[Message]) -> Action:
        return self.actions[0] if self.num_calls < self.rounds_back else self.actions[1]


def software_team(max_tokens: int = 96, rounds_back: int = 2) -> list[Role]:
    architect = Role("architect", "software architect", [
        Action(WRITE_DESIGN, "Write a short design for the task below: the modules and "
               "their functions, as a list.", max_tokens)], watch=[USER_REQUIREMENT])
    engineer = Role("engineer", "Python engineer", [
        Action(WRITE_CODE, "Write the Python code for the design or apply the review "
               "below. Reply with code only.", max_tokens)],
        watch=[WRITE_DESIGN, REQUEST_CHANGES])
    return [architect, engineer, Reviewer(rounds_back, max(16, max_tokens * 2 // 3))]


async def run_workflow(client: AsyncAntiphon, task: str, *, hints: bool = True,
                       max_tokens: int = 96, title_prefix: str = "") -> Environment:
    """Run the team on `task`; the environment holds the messages and per-call records. A
    run that fails deletes the sessions it opened (the caller has no environment to find
    them by: they counted against the key's `--max-sessions-per-key` for good)."""
    env = Environment(client, software_team(max_tokens),
                      CallGraphHooks(client, send_advisories=hints))
    await env.open_sessions(title_prefix)
    try:
        await env.run(task)
    except BaseException:
        await env.close_sessions()
        raise
    return env
