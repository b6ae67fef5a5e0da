"""A coder, a tester and a reviewer built from MetaGPT's own Role, Action and Team classes, as in
MetaGPT's multi-agent tutorial (`build_customized_multi_agents.py`): the coder writes code for
the requirement, the tester writes tests for the code (and again after each review), the
reviewer reviews the tests. Free-text actions only, so it runs with any model (the software
company's actions need structured JSON output that small models do not produce).

Import it only after MetaGPT is configured (`run.py` does).
"""

from __future__ import annotations

import re

from metagpt.actions import Action, UserRequirement
from metagpt.roles import Role
from metagpt.schema import Message


def parse_code(text: str) -> str:
    match = re.search(r"```python(.*)```", text, re.DOTALL)
    return match.group(1) if match else text


class SimpleWriteCode(Action):
    PROMPT_TEMPLATE: str = (
        "Write a python function that can {instruction}.\n"
        "Return ```python your_code_here ``` with NO other texts,\nyour code:\n")
    name: str = "SimpleWriteCode"

    async def run(self, instruction: str) -> str:
        return parse_code(await self._aask(self.PROMPT_TEMPLATE.format(instruction=instruction)))


class SimpleWriteTest(Action):
    PROMPT_TEMPLATE: str = (
        "Context: {context}\n"
        "Write {k} unit tests using pytest for the given function, assuming you have imported "
        "it.\nReturn ```python your_code_here ``` with NO other texts,\nyour code:\n")
    name: str = "SimpleWriteTest"

    async def run(self, context: str, k: int = 3) -> str:
        return parse_code(await self._aask(self.PROMPT_TEMPLATE.format(context=context, k=k)))


class SimpleWriteReview(Action):
    PROMPT_TEMPLATE: str = ("Context: {context}\n"
                            "Review the test cases and provide one critical comment:\n")
    name: str = "SimpleWriteReview"

    async def run(self, context: str) -> str:
        return await self._aask(self.PROMPT_TEMPLATE.format(context=context))


class SimpleCoder(Role):
    name: str = "Alice"
    profile: str = "SimpleCoder"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._watch([UserRequirement])
        self.set_actions([SimpleWriteCode])


class SimpleTester(Role):
    name: str = "Bob"
    profile: str = "SimpleTester"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.set_actions([SimpleWriteTest])
        self._watch([SimpleWriteCode, SimpleWriteReview])

    async def _act(self) -> Message:
        todo = self.rc.todo
        context = self.get_memories()  # everything so far: code and reviews
        code = await todo.run(context, k=3)
        return Message(content=code, role=self.profile, cause_by=type(todo))


class SimpleReviewer(Role):
    name: str = "Charlie"
    profile: str = "SimpleReviewer"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.set_actions([SimpleWriteReview])
        self._watch([SimpleWriteTest])


def roles() -> list[Role]:
    return [SimpleCoder(), SimpleTester(), SimpleReviewer()]
