"""The chat page's Regenerate and Retry: a new reply replaces the last one, and a message left
without a reply (the engine failed, or the server went down while answering it) gets one
(scripted engine: no model needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.sessions.store import SessionStore
from tests.conftest import scripted_config
from tests.liveserver import live_server
from tests.test_regenerate import Versioned

pytestmark = pytest.mark.browser


@dataclasses.dataclass
class Chat:
    url: str
    engine: ScriptedEngine
    replies: Versioned


@pytest.fixture
def chat(tmp_path: Path) -> Iterator[Chat]:
    # A reply the server kept no answer to: a user message committed, then the server died.
    store = SessionStore(tmp_path / "sessions.sqlite3")
    session = store.create_session("local", "Cut short")
    assert session is not None
    store.append_message(session.session_id, "user", "are you there?", 14)
    store.close()
    replies = Versioned()
    engine = ScriptedEngine(reply=replies, token_delay_s=0.005)
    with live_server(scripted_config(tmp_path), engine) as base:
        yield Chat(base, engine, replies)


def bubbles(page: Any) -> list[tuple[str, str]]:
    return [("user" if "user" in str(m.get_attribute("class")).split() else "assistant",
             str(m.locator(".bubble").inner_text()).strip())
            for m in page.locator("#messages > .msg").all()]


def open_page(page: Any, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-connected=true]")


def send(page: Any, text: str) -> None:
    page.locator("#composer").fill(text)
    page.locator("#composer").press("Enter")
    page.locator(".msg.assistant .bubble", has_text=f"to {text}").wait_for()
    # done: the page takes no message while a reply streams (the next Enter would be ignored)
    page.locator(".msg.assistant.streaming").wait_for(state="detached")


def test_regenerate_replaces_the_last_reply(chat: Chat, page: Any, artifacts: Path) -> None:
    open_page(page, chat.url)
    page.locator("#new-session").click()
    send(page, "first")
    send(page, "second")
    button = page.locator(".msg-actions .regenerate")
    button.wait_for()
    assert button.inner_text() == "Regenerate"
    chat.replies.version = 2
    button.click()
    page.locator(".msg.assistant .bubble", has_text="v2 to second").wait_for()
    page.locator(".msg-actions .regenerate").wait_for()
    page.screenshot(path=str(artifacts / "regenerate.png"))
    expected = [("user", "first"), ("assistant", "v1 to first"), ("user", "second"),
                ("assistant", "v2 to second")]
    assert bubbles(page) == expected
    page.reload()
    page.wait_for_selector("body[data-connected=true]")
    page.locator(".msg.assistant .bubble", has_text="v2 to second").wait_for()
    assert bubbles(page) == expected


def test_a_reply_that_failed_is_retried_not_sent_twice(chat: Chat, page: Any) -> None:
    open_page(page, chat.url)
    page.locator("#new-session").click()
    chat.engine.fail_next_request()
    page.locator("#composer").fill("hello")
    page.locator("#composer").press("Enter")
    page.locator(".msg.assistant.failed").wait_for()
    assert "engine_error" in page.locator("#error").inner_text()
    # The server kept the message: it does not go back to the composer to be sent twice.
    assert page.locator("#composer").input_value() == ""
    button = page.locator(".msg-actions .regenerate")
    assert button.inner_text() == "Retry"
    button.click()
    page.locator(".msg.assistant .bubble", has_text="v1 to hello").wait_for()
    page.locator(".msg-actions .regenerate", has_text="Regenerate").wait_for()  # saved: done
    assert bubbles(page) == [("user", "hello"), ("assistant", "v1 to hello")]
    page.reload()
    page.wait_for_selector("body[data-connected=true]")
    page.locator(".msg.assistant .bubble", has_text="v1 to hello").wait_for()
    assert bubbles(page) == [("user", "hello"), ("assistant", "v1 to hello")]


def test_a_message_the_server_went_down_answering_gets_a_retry(chat: Chat, page: Any) -> None:
    open_page(page, chat.url)
    page.locator(".session-item", has_text="Cut short").click()
    page.locator(".msg.user .bubble", has_text="are you there?").wait_for()
    button = page.locator(".msg-actions .regenerate")
    assert button.inner_text() == "Retry"
    button.click()
    page.locator(".msg.assistant .bubble", has_text="v1 to are you there?").wait_for()
    assert bubbles(page) == [("user", "are you there?"), ("assistant", "v1 to are you there?")]
    assert page.locator(".msg-actions .regenerate").inner_text() == "Regenerate"

