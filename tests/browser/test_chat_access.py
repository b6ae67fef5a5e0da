"""The chat page for users of input methods, the keyboard and screen readers: an input method's
Enter picks a candidate and saves or sends nothing; the focus stays in the composer after Send,
Stop or Regenerate; a streaming reply is busy until it ends (scripted engine: no model needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server

pytestmark = pytest.mark.browser

# Keydown events as input methods send them: Chrome and Firefox mark the Enter that confirms a
# candidate isComposing; Safari sends it after compositionend, with isComposing false and only
# the keyCode 229 ("processed by the input method") to tell it.
IME_KEYS = """([selector, key]) => {
  const target = document.querySelector(selector);
  target.dispatchEvent(new CompositionEvent('compositionstart', {bubbles: true}));
  for (const init of [{isComposing: true}, {isComposing: false, keyCode: 229}]) {
    target.dispatchEvent(new KeyboardEvent('keydown',
      {key, bubbles: true, cancelable: true, ...init}));
  }
}"""


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.01)
    with live_server(scripted_config(tmp_path), engine) as base:
        yield base


def open_chat(page: Any, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-connected=true]")


def focused(page: Any) -> str:
    return str(page.evaluate("document.activeElement.id || document.activeElement.tagName"))


def wait_done(page: Any, replies: int) -> None:
    page.locator(".msg.assistant .timings").nth(replies - 1).wait_for()
    page.wait_for_function("document.body.dataset.generating === 'false'")


def test_an_input_methods_enter_neither_saves_a_rename_nor_sends(url: str, page: Any) -> None:
    open_chat(page, url)
    page.locator("#composer").fill("かな")
    page.evaluate(IME_KEYS, ["#composer", "Enter"])
    page.wait_for_timeout(300)
    assert page.locator("#composer").input_value() == "かな"
    assert page.locator(".msg.user").count() == 0
    page.locator("#composer").fill("hello")
    page.locator("#composer").press("Enter")
    wait_done(page, 1)

    page.locator(".session-row .session-rename").first.click()
    page.locator(".session-title-input").fill("にほんご")
    for key in ("Enter", "Escape"):
        page.evaluate(IME_KEYS, [".session-title-input", key])
        page.wait_for_timeout(300)
        assert page.locator(".session-title-input").count() == 1, key  # still being typed
    assert [s["title"] for s in httpx.get(url + "/v1/sessions").json()["sessions"]] == ["hello"]
    page.locator(".session-title-input").press("Enter")  # the user's own Enter saves it
    page.locator(".session-name", has_text="にほんご").wait_for()


def test_the_focus_stays_in_the_composer_after_send_stop_and_regenerate(url: str,
                                                                        page: Any) -> None:
    """Each hides or removes the button pressed: the focus fell to the top of the page, and a
    keyboard user had to tab back down to the composer."""
    open_chat(page, url)
    page.locator("#composer").fill("hello")
    page.locator("#send").click()
    assert focused(page) == "composer"
    wait_done(page, 1)
    page.locator(".regenerate").click()
    assert focused(page) == "composer"
    wait_done(page, 1)
    page.locator("#composer").fill("a long one " * 40)
    page.locator("#composer").press("Enter")
    page.wait_for_timeout(600)  # (Stop takes no click just after a send)
    page.locator("#stop").focus()
    page.keyboard.press("Enter")
    page.locator(".msg.assistant.cancelled").wait_for()
    assert focused(page) == "composer"


def test_a_streaming_reply_is_busy_until_it_ends(url: str, page: Any) -> None:
    """The conversation is a live region and the reply is drawn again at every frame: screen
    readers are to read it once it is in, not each redraw."""
    open_chat(page, url)
    for end in ("done", "stop"):
        before = page.locator(".msg.assistant").count()
        page.locator("#composer").fill(f"a long one ({end}) " * 20)
        page.locator("#composer").press("Enter")
        reply = page.locator(".msg.assistant").nth(before)
        reply.locator(".bubble", has_text="a long").wait_for()
        assert reply.get_attribute("aria-busy") == "true"
        if end == "stop":
            page.wait_for_timeout(600)  # (Stop takes no click just after a send)
            page.locator("#stop").click()
        wait_done(page, before + 1)
        assert reply.get_attribute("aria-busy") is None
    assert "cancelled" in str(page.locator(".msg.assistant").last.get_attribute("class"))
