"""The chat page marks where the model's view of a conversation longer than its context starts,
live and after a reload (scripted engine, a 1,000-token context: no model needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server

pytestmark = pytest.mark.browser


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.005, max_model_len=1000)
    config = scripted_config(tmp_path, max_content_chars=500, context_refill_frac=0.5)
    with live_server(config, engine) as base:
        yield base


def first_seen(page: Any) -> str:
    """The text of the first message after the page's context note."""
    return str(page.locator(".context-cut + .msg .bubble").inner_text())


def test_the_page_marks_where_the_model_stops_seeing_the_conversation(
        url: str, page: Any, artifacts: Path) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-connected=true]")
    for i in range(8):
        page.locator("#composer").fill(f"message {i} " + "x" * 30)
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant .bubble", has_text=f"You said: message {i} ").wait_for()
        page.locator(".msg.assistant.streaming").wait_for(state="detached")  # takes the next
        if i < 7:  # the first 7 turns fit: no note
            assert page.locator(".context-cut").count() == 0, i
    page.locator(".context-cut").wait_for()
    assert page.locator(".context-cut").count() == 1
    assert first_seen(page).startswith("message 3 ")  # what the scripted server cut to
    page.screenshot(path=str(artifacts / "context-cut.png"))
    page.reload()
    page.wait_for_selector("body[data-connected=true]")
    page.locator(".context-cut").wait_for()
    assert first_seen(page).startswith("message 3 ")
    assert page.locator(".msg").count() == 16  # every message is still shown
