"""The chat page when frames cross (scripted engine: no model needed): a new chat's first
message sent while another chat opens, a message lost with the connection, a rename of a chat
another tab deleted, and a chat shown again while its reply is regenerated."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.browser.test_chat_page import open_chat, send, sessions
from tests.conftest import scripted_config
from tests.liveserver import live_server

pytestmark = pytest.mark.browser


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.002, max_model_len=4000)
    with live_server(scripted_config(tmp_path, max_content_chars=1000), engine) as base:
        yield base


def wait_until(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def messages_of(url: str, session_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/sessions/{session_id}")
    return r.json()["messages"] if r.status_code == 200 else None  # type: ignore[no-any-return]


@pytest.mark.parametrize("length", [20, 1001], ids=["taken", "refused"])
def test_a_first_message_sent_while_another_chat_opens_starts_a_chat_of_its_own(
        url: str, page: Any, length: int) -> None:
    """A click on a chat in the sidebar, then "+ New chat" and Enter before that chat had
    opened: the message went into the chat clicked, and when the server refused it (too long)
    the page deleted that chat, with all its messages."""
    open_chat(page, url)
    send(page, "an older chat")
    older = sessions(url)[0]["session_id"]
    page.locator("#new-session").click()
    text = "x" * length
    page.evaluate("""(text) => {
      document.querySelector('.session-row .session-item').click();
      document.querySelector('#new-session').click();
      const composer = document.querySelector('#composer');
      composer.value = text;
      composer.dispatchEvent(new Event('input'));
      document.querySelector('#composer-form').requestSubmit();
    }""", text)
    if length > 1000:
        page.locator("#error:not([hidden])").wait_for()
        page.wait_for_function(f"document.querySelector('#composer').value.length === {length}")
        wait_until(lambda: len(sessions(url)) == 1, "the new chat's session is deleted")
    else:
        wait_until(lambda: len(sessions(url)) == 2 and sessions(url)[0]["num_messages"] == 2,
                   "the message is answered in a new chat")
    assert [m["content"] for m in messages_of(url, older) if m["role"] == "user"] == [
        "an older chat"]  # (None: deleted)


def test_a_message_the_server_never_got_comes_back_to_the_composer(url: str, page: Any) -> None:
    """The connection dropped before the server had the message (a laptop waking up): the
    reply was marked failed, the session was opened again without it, and the text was
    gone."""
    messages = {"seen": 0}

    def drop_the_second_message(ws: Any) -> None:
        upstream = ws.connect_to_server()

        def from_page(message: str | bytes) -> None:
            if json.loads(message).get("type") == "message":
                messages["seen"] += 1
                if messages["seen"] == 2:
                    ws.close()  # swallowed, and the connection with it
                    return
            upstream.send(message)
        ws.on_message(from_page)
        upstream.on_message(ws.send)

    page.route_web_socket("**/v1/ws", drop_the_second_message)
    open_chat(page, url)
    send(page, "a first message")
    page.locator("#composer").fill("the words I typed")
    page.locator("#composer").press("Enter")
    page.wait_for_function("document.querySelector('#composer').value === 'the words I typed'")
    page.wait_for_selector("body[data-connected=true]")  # back, and the session shown again
    assert page.locator("#composer").input_value() == "the words I typed"
    assert [m["content"] for m in messages_of(url, sessions(url)[0]["session_id"])
            if m["role"] == "user"] == ["a first message"]


def test_a_deletion_the_connection_cut_short_is_not_done_later_unasked(
        tmp_path: Path, page: Any) -> None:
    """A chat deleted while its reply streams is deleted once the reply has stopped: with
    the connection lost before that, the deletion stayed pending, and the chat's next reply,
    much later, deleted it without asking."""
    def drop_at_the_cancel(ws: Any) -> None:
        upstream = ws.connect_to_server()

        def from_page(message: str | bytes) -> None:
            if json.loads(message).get("type") == "cancel":
                ws.close()  # the cancel swallowed, and the connection with it
                return
            upstream.send(message)
        ws.on_message(from_page)
        upstream.on_message(ws.send)

    engine = ScriptedEngine(token_delay_s=0.05, reply=lambda turns: "word " * 40)
    with live_server(scripted_config(tmp_path), engine) as base:
        page.route_web_socket("**/v1/ws", drop_at_the_cancel)
        open_chat(page, base)
        page.locator("#composer").fill("a long answer please")
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant.streaming").wait_for()
        sid = sessions(base)[0]["session_id"]
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator(".session-row").first.locator(".session-delete").click()
        page.wait_for_selector("body[data-connected=false]")
        page.wait_for_selector("body[data-connected=true]")
        wait_until(lambda: not page.locator(".msg.assistant.streaming").count()
                   and messages_of(base, sid) and len(messages_of(base, sid)) == 2,
                   "the cut reply ends on the server")
        page.locator(".session-row").first.locator(".session-item").click()
        send(page, "one more")
        page.wait_for_timeout(300)
        assert messages_of(base, sid) is not None, "deleted without asking"


def test_a_title_being_typed_outlives_the_sidebar_redrawn_under_it(tmp_path: Path,
                                                                   page: Any) -> None:
    """The sidebar is drawn again at every reply's start and end: a title being typed went
    with it, and focus fell to the page."""
    engine = ScriptedEngine(token_delay_s=0.03, reply=lambda turns: "word " * 30)
    with live_server(scripted_config(tmp_path), engine) as base:
        open_chat(page, base)
        page.locator("#composer").fill("a question")
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant.streaming").wait_for()
        page.locator(".session-row").first.locator(".session-rename").click()
        page.locator(".session-title-input").fill("my renamed chat")
        page.locator(".msg.assistant .timings").wait_for()  # the reply ended: redrawn
        page.wait_for_timeout(300)
        assert page.locator(".session-title-input").input_value() == "my renamed chat"
        page.locator(".session-title-input").press("Enter")
        wait_until(lambda: sessions(base)[0]["title"] == "my renamed chat", "renamed")
        page.wait_for_function("document.querySelector('#session-list').innerText"
                               ".includes('my renamed chat')")


def test_renaming_a_chat_another_tab_deleted_leaves_the_chat_shown(url: str, page: Any) -> None:
    """Errors of renames and deletions named no request, so a `session_not_found` for another
    chat blanked the chat being read."""
    open_chat(page, url)
    send(page, "chat one")
    page.locator("#new-session").click()
    send(page, "chat two")
    one = next(s for s in sessions(url) if s["title"] == "chat one")
    assert httpx.delete(f"{url}/v1/sessions/{one['session_id']}").status_code == 204
    page.locator(".session-row", has_text="chat one").locator(".session-rename").click()
    page.locator(".session-title-input").fill("renamed")
    page.locator(".session-title-input").press("Enter")
    page.locator("#error:not([hidden])").wait_for()
    assert "session_not_found" in page.locator("#error").inner_text()
    page.wait_for_function("!document.querySelector('#session-list').innerText"
                           ".includes('chat one')")
    assert page.locator("#session-title").inner_text() == "chat two"
    assert page.locator("#messages > .msg").count() == 2


def test_a_chat_shown_again_while_its_reply_is_regenerated_shows_one_reply(
        tmp_path: Path, page: Any) -> None:
    """The server keeps the old reply until the new one is in: a chat opened again while its
    reply was regenerated showed both, the old one for good."""
    engine = ScriptedEngine(token_delay_s=0.02, reply=lambda turns: "word " * 40)
    with live_server(scripted_config(tmp_path), engine) as base:
        open_chat(page, base)
        send(page, "chat one")
        page.locator("#new-session").click()
        send(page, "chat two")
        chat = page.locator(".session-row", has_text="chat one").locator(".session-item")
        other = page.locator(".session-row", has_text="chat two").locator(".session-item")
        chat.click()
        page.wait_for_function("document.querySelector('#session-title').innerText"
                               " === 'chat one'")
        page.locator(".msg-actions .regenerate", has_text="Regenerate").click()
        page.locator(".msg.assistant.streaming").wait_for()
        other.click()
        page.wait_for_function("document.querySelector('#session-title').innerText"
                               " === 'chat two'")
        chat.click()
        page.wait_for_function("document.querySelector('#session-title').innerText"
                               " === 'chat one'")
        page.locator(".msg.assistant .timings").last.wait_for()
        page.wait_for_function("!document.querySelector('.msg.assistant.streaming')")
        assert page.locator("#messages > .msg.assistant").count() == 1
