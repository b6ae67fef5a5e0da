"""What a user of the pages would trip on (scripted engine: no model needed): a refused first
message, long code lines, Markdown fences and links, a second tab, the sidebar's older pages,
and the dashboard's target lines and key dialog."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from antiphon.bench.serverproc import free_port
from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server, running_server

pytestmark = pytest.mark.browser
KEY = "test-key-123456"
LISTED = 4  # sessions in one page of the sidebar


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.002, max_model_len=4000)
    config = scripted_config(tmp_path, max_content_chars=1000, max_sessions_listed=LISTED,
                             dashboard_interval_s=0.2)
    with live_server(config, engine) as base:
        yield base


def open_chat(page: Any, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-connected=true]")


def send(page: Any, text: str) -> Any:
    """Send `text`; returns its reply's locator once the reply is done."""
    before = page.locator(".msg.assistant").count()
    page.locator("#composer").fill(text)
    page.locator("#composer").press("Enter")
    reply = page.locator(".msg.assistant").nth(before)
    reply.locator(".timings").wait_for()
    return reply


def sessions(url: str) -> list[dict[str, Any]]:
    return httpx.get(url + "/v1/sessions").json()["sessions"]  # type: ignore[no-any-return]


def test_a_refused_first_message_leaves_no_session_and_no_bubble(url: str, page: Any) -> None:
    # and gives back the system message typed for the new chat (the deletion of the session
    # opened for the message blanked it)
    open_chat(page, url)
    page.locator("#system-box summary").click()
    page.locator("#system-input").fill("Answer like a pirate.")
    too_long = "x" * 1001
    page.locator("#composer").fill(too_long)
    page.locator("#composer").press("Enter")
    page.locator("#error:not([hidden])").wait_for()
    assert "too_large" in page.locator("#error").inner_text()
    assert page.locator("#composer").input_value() == too_long  # back to fix and resend
    page.wait_for_function("document.querySelectorAll('#messages > .msg').length === 0")
    deadline = time.monotonic() + 10
    while sessions(url):  # the session opened for it is deleted again
        assert time.monotonic() < deadline, sessions(url)
        time.sleep(0.05)
    page.wait_for_timeout(200)  # (the deletion's answer is in)
    assert page.locator("#system-input").input_value() == "Answer like a pirate."
    page.locator("#composer").fill("short")
    page.locator("#composer").press("Enter")
    page.locator(".msg.assistant .timings").wait_for()
    assert page.locator("#messages > .msg").count() == 2 and len(sessions(url)) == 1


def test_long_code_lines_scroll_inside_the_bubble(url: str, page: Any) -> None:
    line = "curl -s http://127.0.0.1:8000/v1/chat/completions " + "-d x" * 40
    for width in (1280, 375):
        page.set_viewport_size({"width": width, "height": 800})
        open_chat(page, url)
        send(page, f"this:\n```bash\n{line}\n```")  # the reply: "You said: " and this
        sizes = page.evaluate("""() => {
          const bubble = [...document.querySelectorAll('.msg.assistant .bubble')].pop();
          const pre = bubble.querySelector('pre');
          const pane = document.querySelector('#messages');
          return {bubble: bubble.getBoundingClientRect().width,
                  column: bubble.parentElement.getBoundingClientRect().width,
                  paneScroll: pane.scrollWidth, pane: pane.clientWidth,
                  preScroll: pre.scrollWidth, pre: pre.clientWidth};
        }""")
        assert sizes["bubble"] <= sizes["column"] + 1, sizes
        assert sizes["paneScroll"] <= sizes["pane"] + 1, sizes  # no sideways page
        assert sizes["preScroll"] > sizes["pre"], sizes  # the code scrolls in its block


def test_fences_and_links_render_as_markdown_says(url: str, page: Any) -> None:
    open_chat(page, url)
    # A fence closes on its own character, at least as many, nothing after, indented 3 at most.
    reply = send(page, "this:\n````markdown\nA snippet:\n```python\nprint(1)\n```\n````\n"
                       "    ```python\n"
                       "After [Python](https://en.wikipedia.org/wiki/Python_(language)).")
    code = reply.locator("pre code")
    assert code.count() == 1  # the fences inside are the snippet's text
    assert "```python" in code.inner_text() and "print(1)" in code.inner_text()
    link = reply.locator("a")
    assert link.get_attribute("href") == "https://en.wikipedia.org/wiki/Python_(language)"
    assert link.inner_text() == "Python"


def second_tab(page: Any, url: str, first: str) -> Any:
    """Send `first` in `page`, open the same session in a second tab, and go back to `page`."""
    open_chat(page, url)
    send(page, first)
    other = page.context.new_page()
    open_chat(other, url)  # the same session, remembered
    other.locator(".msg.user", has_text=first).wait_for()
    page.bring_to_front()
    return other


def come_back(tab: Any) -> None:
    """The user goes to `tab` (it resyncs with the server)."""
    tab.bring_to_front()
    tab.evaluate("window.dispatchEvent(new Event('blur')); window.dispatchEvent(new Event('focus'))")


def test_a_second_tab_shows_what_the_first_said_when_the_user_comes_back(
        url: str, page: Any) -> None:
    other = second_tab(page, url, "first question")
    send(page, "second question")
    come_back(other)
    other.locator(".msg.user", has_text="second question").wait_for(timeout=10_000)
    assert other.locator("#messages > .msg").count() == 4


def test_coming_back_while_another_tab_answers_keeps_one_poll(tmp_path: Path,
                                                              page: Any) -> None:
    """Each open of a chat another tab was answering started a poll of its own: coming back
    to the tab k times polled k + 1 times every 1.5 s, each the whole conversation."""
    with live_server(scripted_config(tmp_path), ScriptedEngine(token_delay_s=0.05)) as base:
        other = second_tab(page, base, "hello")
        page.locator("#composer").fill(" ".join(["word"] * 160))  # a reply of about 8 s
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant.streaming").wait_for()
        come_back(other)
        other.locator(".replying-note").wait_for()
        for _ in range(5):
            come_back(other)
            other.wait_for_timeout(50)
        other.evaluate("""() => {
          window.opens = 0;
          const send = WebSocket.prototype.send;
          WebSocket.prototype.send = function (data) {
            if (String(data).includes('"session.open"')) window.opens += 1;
            return send.call(this, data);
          };
        }""")
        other.wait_for_timeout(3000)  # two polls' time
        assert other.evaluate("window.opens") <= 3


def test_a_second_tab_offers_no_retry_while_the_first_is_answering(
        tmp_path: Path, page: Any) -> None:
    """The second tab showed the first's new message without a reply and offered "Retry",
    which the server refused (the session was busy), and showed the reply only once the user
    left the tab and came back."""
    with live_server(scripted_config(tmp_path), ScriptedEngine(token_delay_s=0.05)) as base:
        other = second_tab(page, base, "hello")
        other.set_viewport_size({"width": 900, "height": 420})  # the conversation overflows
        page.locator("#composer").fill(" ".join(["word"] * 80))  # a reply of about 4 s
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant.streaming").wait_for()
        come_back(other)
        other.locator(".replying-note").wait_for()
        assert other.locator(".msg.user").count() == 2
        assert other.locator(".regenerate").count() == 0
        # a message typed meanwhile waits in the composer (the server would refuse it)
        other.locator("#composer").fill("meanwhile")
        assert other.locator("#send").is_disabled()
        other.locator("#composer").press("Enter")
        assert other.locator("#composer").input_value() == "meanwhile"
        page.locator(".msg.assistant").nth(1).locator(".timings").wait_for()
        # the reply comes in without the user doing anything, and can be regenerated
        other.locator(".msg.assistant").nth(1).wait_for(timeout=10_000)
        other.locator(".regenerate", has_text="Regenerate").wait_for()
        assert other.locator(".replying-note").count() == 0
        assert other.locator(".msg.assistant").nth(1).inner_text().startswith("You said: word")
        assert other.locator("#send").is_enabled()
        # scrolled to the end, the Regenerate row in view
        assert other.evaluate("""() => {
          const m = document.querySelector('#messages');
          return m.scrollHeight - m.scrollTop - m.clientHeight < 2;
        }""")


def test_while_the_server_is_away_the_page_counts_down_and_retries_when_the_user_returns(
        tmp_path: Path, page: Any) -> None:
    """The status said "Reconnecting in 9s…" until the next try (no countdown), and a user
    coming back to the page (another tab, another window) waited out the rest of a backoff of
    up to 15 s after the server was back. The countdown is outside the live regions: screen
    readers announced each tick of it."""
    config = scripted_config(tmp_path)
    port = free_port()
    with running_server(config, ScriptedEngine(), port=port) as (base, _):
        open_chat(page, base)
    page.wait_for_function("document.body.dataset.connected === 'false'")
    time.sleep(8)  # failed tries: the backoff is now 4 to 10 s
    page.evaluate("window.dispatchEvent(new Event('blur'))")  # the user leaves
    readings, announced = [], []
    for _ in range(3):
        readings.append(page.locator("#conn-status").inner_text())
        announced.append(page.evaluate("""() => [...document.querySelectorAll(
          '[role=status], [role=alert], [aria-live]:not([aria-live=off])')]
          .map((e) => e.textContent)"""))
        time.sleep(1.1)
    assert all(text.startswith("Reconnecting in ") for text in readings), readings
    assert announced[0] == announced[1] == announced[2], announced
    seconds = [int(text.removeprefix("Reconnecting in ").rstrip("s…")) for text in readings]
    # counting down (a try between two readings starts a longer wait: a rise)
    assert any(b < a for a, b in itertools.pairwise(seconds)), readings
    with running_server(config, ScriptedEngine(), port=port):
        back = time.monotonic()
        page.evaluate("window.dispatchEvent(new Event('focus'))")  # and comes back
        page.wait_for_function("document.body.dataset.connected === 'true'", timeout=15000)
        assert time.monotonic() - back < 1.5
        assert page.locator("#conn-status").inner_text() == "Connected"


def test_a_reply_cut_at_max_tokens_says_so_after_a_reload(tmp_path: Path, page: Any) -> None:
    """The live timings line says "length"; a reloaded page showed such a reply as whole."""
    with live_server(scripted_config(tmp_path, default_max_tokens=3), ScriptedEngine()) as base:
        open_chat(page, base)
        assert "length" in send(page, "one two three four five").locator(".timings").inner_text()
        page.reload()
        page.wait_for_selector(".msg.assistant .finish-note")
        assert page.locator(".msg.assistant .finish-note").inner_text() == "length"
        assert page.locator(".msg.user .finish-note").count() == 0


def test_the_older_chats_listed_stay_listed_after_a_reply(url: str, page: Any) -> None:
    for n in range(3 * LISTED):
        httpx.post(url + "/v1/sessions", json={"title": f"older chat {n}"})
    open_chat(page, url)
    rows, older = page.locator(".session-row"), page.locator("#sessions-older")
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === {LISTED}")
    older.click()
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === {2 * LISTED}")
    send(page, "hello")  # a new session, listed first
    page.locator(".session-row", has_text="hello").wait_for()
    time.sleep(0.3)  # the list refreshes after the reply
    assert rows.count() == 2 * LISTED + 1
    assert older.is_visible()
    older.click()
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === "
                           f"{3 * LISTED + 1}")


def test_a_chat_deleted_elsewhere_leaves_the_sidebar_with_older_pages_listed(
        url: str, page: Any) -> None:
    """With older pages listed, a refresh kept every chat the fresh first page lacked: one
    deleted in another tab stayed listed for good, and clicking it only showed an error
    (found by a review). Now the refresh drops it; and a listed chat found gone when opened
    leaves the sidebar."""
    ids = [httpx.post(url + "/v1/sessions", json={"title": f"older chat {n}"}).json()[
        "session_id"] for n in range(2 * LISTED)]
    open_chat(page, url)
    rows = page.locator(".session-row")
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === {LISTED}")
    page.locator("#sessions-older").click()
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === {2 * LISTED}")
    assert httpx.delete(f"{url}/v1/sessions/{ids[-1]}").status_code == 204  # the newest
    page.evaluate("window.dispatchEvent(new Event('blur'));"
                  "window.dispatchEvent(new Event('focus'))")  # (lists again)
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === "
                           f"{2 * LISTED - 1}")
    assert rows.filter(has_text=f"older chat {2 * LISTED - 1}").count() == 0
    # A listed chat deleted since the last listing: opened, it goes from the sidebar.
    assert httpx.delete(f"{url}/v1/sessions/{ids[0]}").status_code == 204  # the oldest
    rows.filter(has_text="older chat 0").locator(".session-item").click()
    page.wait_for_function(f"document.querySelectorAll('.session-row').length === "
                           f"{2 * LISTED - 2}")


def test_the_dashboard_draws_the_target_lines(url: str, page: Any) -> None:
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-connected=true]")
    for chart in ("ttft", "tpot"):
        card = page.locator(f"[data-chart={chart}]")
        card.locator("svg line.target").first.wait_for(state="attached", timeout=10_000)
        assert card.locator(".legend-target").count() == 1


def test_the_dashboard_key_dialog_keeps_what_is_typed(tmp_path: Path, page: Any) -> None:
    engine = ScriptedEngine(token_delay_s=0.002)
    config = scripted_config(tmp_path, api_keys=(KEY,), dashboard_interval_s=0.2)
    with live_server(config, engine) as base:
        page.goto(base + "/dashboard")
        page.locator("#auth-dialog[open]").wait_for()
        assert page.locator("#live-status").inner_text() == "API key required"
        page.locator("#api-key-input").press_sequentially(KEY[:6], delay=20)
        time.sleep(2.5)  # polls retried meanwhile (0.4 s, 0.8 s, ...)
        assert page.locator("#api-key-input").input_value() == KEY[:6]
        page.locator("#api-key-input").press_sequentially(KEY[6:])
        page.locator("#api-key-save").click()
        page.wait_for_selector("body[data-connected=true]", timeout=40_000)


def test_a_new_chat_asked_for_while_the_first_message_opens_its_session_loses_nothing(
        url: str, page: Any) -> None:
    """Enter on a new chat's first message, then "+ New chat" before the server has opened
    the session for it: the message goes to that session and is answered (it was dropped,
    and its session left empty), and the page shows a blank chat."""
    open_chat(page, url)
    page.locator("#composer").fill("first of its chat")
    page.evaluate("""() => {
      document.querySelector('#composer-form').requestSubmit();
      document.querySelector('#new-session').click();
    }""")
    deadline = time.monotonic() + 10
    while not (listed := sessions(url)) or listed[0]["num_messages"] < 2:
        assert time.monotonic() < deadline, listed
        time.sleep(0.05)
    assert [(s["title"], s["num_messages"]) for s in listed] == [("first of its chat", 2)]
    assert page.locator("#session-title").inner_text() == "New chat"
    assert page.locator("#messages > .msg").count() == 0
    assert page.locator("#composer").input_value() == ""
    send(page, "second chat")  # the blank chat is one: its message opens a session of its own
    assert len(sessions(url)) == 2


def test_a_busy_sessions_banner_goes_once_the_other_reply_is_in(tmp_path: Path,
                                                                 page: Any) -> None:
    """A message sent in a tab that had not yet seen another tab's turn is refused
    (session_busy, its text back in the composer); the banner saying so went on showing after
    that turn's reply was in and Send was enabled again."""
    with live_server(scripted_config(tmp_path), ScriptedEngine(token_delay_s=0.05)) as base:
        other = second_tab(page, base, "hello")
        page.locator("#composer").fill(" ".join(["word"] * 40))  # a reply of about 2 s
        page.locator("#composer").press("Enter")
        page.locator(".msg.assistant.streaming").wait_for()
        other.locator("#composer").fill("me too")
        other.locator("#composer").press("Enter")
        other.locator("#error:not([hidden])").wait_for()
        assert "session_busy" in other.locator("#error").inner_text()
        assert other.locator("#composer").input_value() == "me too"
        page.locator(".msg.assistant").nth(1).locator(".timings").wait_for()
        come_back(other)
        other.locator(".msg.assistant").nth(1).wait_for(timeout=10_000)
        other.locator("#error").wait_for(state="hidden", timeout=10_000)
        assert other.locator("#send").is_enabled()


def test_a_shutting_down_banner_goes_once_a_server_serves_again(tmp_path: Path,
                                                               page: Any) -> None:
    """A turn refused while the server shut down showed `shutting_down`, and the banner went
    on showing once the page had reconnected to the server that replaced it."""
    config = scripted_config(tmp_path)
    port = free_port()
    with running_server(config, ScriptedEngine(), port=port) as (base, _):
        open_chat(page, base)
        page.evaluate("""() => {  // as the server's refusal of a turn during its shutdown shows
          const box = document.querySelector('#error');
          box.querySelector('.error-code').textContent = 'shutting_down';
          box.dataset.code = 'shutting_down';
          box.hidden = false;
        }""")
    page.wait_for_function("document.body.dataset.connected === 'false'")
    assert page.locator("#error").is_visible()
    with running_server(config, ScriptedEngine(), port=port):
        page.evaluate("window.dispatchEvent(new Event('focus'))")  # (tries at once)
        page.wait_for_function("document.body.dataset.connected === 'true'", timeout=15000)
        page.locator("#error").wait_for(state="hidden", timeout=5000)


def test_a_server_at_its_connection_limit_is_asked_again_ever_more_slowly(
        tmp_path: Path, page: Any) -> None:
    """A server over --max-connections opens the socket, refuses in an error frame and closes
    (1013): the page reset its backoff at every open and asked again twice a second, for as
    long as the server was full (found by a review). The backoff grows until the server takes
    a connection; then the refusal's banner goes."""
    from websockets.sync.client import connect

    page.add_init_script("""(() => {
      const Real = window.WebSocket;
      window.socketsOpened = 0;
      window.WebSocket = class extends Real {
        constructor(...args) { super(...args); window.socketsOpened += 1; }
      };
    })()""")
    config = scripted_config(tmp_path, max_connections=1)
    with running_server(config, ScriptedEngine()) as (base, _):
        with connect(base.replace("http://", "ws://") + "/v1/ws"):  # the one it takes
            page.goto(base + "/")
            page.locator("#error:not([hidden])").wait_for()
            assert "too_many_requests" in page.locator("#error").inner_text()
            time.sleep(4.5)  # backoff 0.5, 1, 2 s (each +-25%): at most 4 sockets, not 9
            assert page.evaluate("window.socketsOpened") <= 4
        page.evaluate("window.dispatchEvent(new Event('focus'))")  # (tries at once)
        page.wait_for_function("document.body.dataset.connected === 'true'", timeout=15000)
        page.locator("#error").wait_for(state="hidden", timeout=5000)


def test_a_new_chat_takes_a_system_message_and_shows_it(tmp_path: Path, page: Any) -> None:
    """A system message typed on a new chat opens its session with it: the model sees it
    first (the scripted engine's prompt), the conversation shows it above the messages, also
    after a reload, and the next new chat starts without one."""
    engine = ScriptedEngine(token_delay_s=0.002)
    with live_server(scripted_config(tmp_path), engine) as base:
        open_chat(page, base)
        page.locator("#system-box summary").click()
        page.locator("#system-input").fill("Answer like a pirate.")
        send(page, "hello")
        assert engine.decode(engine.request_prompts[-1]).startswith(
            "<system>Answer like a pirate.\n<user>hello\n")
        note = page.locator("#messages > .system-note")
        assert note.inner_text() == "System: Answer like a pirate."
        assert page.locator("#system-box").is_hidden()
        sid = sessions(base)[0]["session_id"]
        stored = httpx.get(f"{base}/v1/sessions/{sid}").json()["session"]
        assert stored["system"] == "Answer like a pirate."
        page.reload()
        page.wait_for_selector("body[data-connected=true]")
        page.locator("#messages > .msg.assistant").wait_for()
        assert note.inner_text() == "System: Answer like a pirate."
        page.locator("#new-session").click()
        assert page.locator("#system-box").is_visible()
        assert page.locator("#system-input").input_value() == ""
        send(page, "no system here")
        assert engine.decode(engine.request_prompts[-1]).startswith("<user>no system here")
        assert page.locator("#messages > .system-note").count() == 0


@pytest.mark.parametrize("refusal", ["too_many_sessions", "too_large"])
def test_a_new_chat_whose_session_is_refused_gives_the_message_back(
        tmp_path: Path, page: Any, refusal: str) -> None:
    """The server refused to open a new chat's session (the key's sessions at their limit, a
    system message too long): the banner said so, and the message, cleared from the composer,
    was lost, with Send disabled for good."""
    config = scripted_config(tmp_path, max_sessions_per_key=1, max_content_chars=100)
    with live_server(config, ScriptedEngine()) as base:
        open_chat(page, base)
        if refusal == "too_many_sessions":
            send(page, "the one chat this key may keep")
            page.locator("#new-session").click()
        else:
            page.locator("#system-box summary").click()
            page.locator("#system-input").fill("x" * 101)
        page.locator("#composer").fill("will it be kept?")
        page.locator("#composer").press("Enter")
        page.locator("#error:not([hidden])").wait_for()
        assert refusal in page.locator("#error").inner_text()
        page.wait_for_function(
            "document.querySelector('#composer').value === 'will it be kept?'", timeout=5000)
        assert page.locator("#send").is_enabled()
        assert len(sessions(base)) == (1 if refusal == "too_many_sessions" else 0)


@pytest.mark.parametrize("limit", ["max_content_chars", "max_frame_bytes"])
def test_a_message_over_the_servers_limits_is_refused_before_it_is_sent(
        tmp_path: Path, page: Any, limit: str) -> None:
    """A message over the websocket's frame limit (a pasted log) closed the connection (1009)
    with no word of why: the text came back in the composer, every reply streaming on the
    socket was cut, and a new chat's session was left empty (found by a review)."""
    config = scripted_config(tmp_path, max_content_chars=1500, max_frame_bytes=1000)
    # (a frame up to 4 times the limit reaches the server, which refuses it as too_large)
    text = "x" * 1501 if limit == "max_content_chars" else "😀" * 1100  # 4,400 bytes
    with live_server(config, ScriptedEngine()) as base:
        open_chat(page, base)
        page.locator("#composer").fill(text)
        page.locator("#composer").press("Enter")
        page.locator("#error:not([hidden])").wait_for()
        shown = page.locator("#error").inner_text()
        assert "too_large" in shown
        assert ("1501 characters" in shown) if limit == "max_content_chars" else ("1000" in shown)
        assert page.locator("#composer").input_value() == text
        assert page.locator("body[data-connected=true]").count() == 1
        assert sessions(base) == []
        page.locator("#composer").fill("a short one")
        page.locator("#composer").press("Enter")
        page.locator("#messages > .msg.assistant:not(.streaming)").wait_for()
        assert len(sessions(base)) == 1


def test_the_dashboard_counts_down_to_its_next_try(url: str, page: Any) -> None:
    """"Offline, retrying in 8 s…" stayed as it was until the next try (the chat page's
    status counts down)."""
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-connected=true]")
    page.route("**/v1/dashboard*", lambda route: route.abort())
    page.wait_for_selector("body[data-connected=false]", timeout=10_000)
    page.wait_for_timeout(3000)  # failures in a row: the wait is now some seconds
    readings = []
    for _ in range(4):
        readings.append(page.locator("#live-status").inner_text())
        page.wait_for_timeout(1100)
    assert all(text.startswith("Offline, retrying in ") for text in readings), readings
    seconds = [int(text.removeprefix("Offline, retrying in ").split()[0]) for text in readings]
    assert any(b < a for a, b in itertools.pairwise(seconds)), readings


def test_a_long_typing_burst_advises_again_before_the_advisory_expires(url: str,
                                                                       page: Any) -> None:
    """One notice per burst: typing a long message, the advisory expired (the engine keeps it
    30 s) before the turn came, and the session's prefetched KV was not kept for it."""
    open_chat(page, url)
    sent = page.evaluate("""async () => {
        const { TypingBurst } = await import('/static/composer.js');
        let now = 0;
        const sent = [];
        const burst = new TypingBurst(2000, () => now, 15000);
        const key = (hasText = true) => burst.keystroke(hasText, () => sent.push(now) > 0);
        for (now = 0; now <= 40000; now += 500) key();  // 40 s without a pause
        now = 43000; key();  // a new burst after a pause
        now = 43500; key();
        now = 60000; key(false);  // an empty box: nothing to advise
        // typing goes on in another chat (its session had heard nothing: no prefetch)
        now = 61000; burst.keystroke(true, () => sent.push(now) > 0, "s_a");
        now = 61500; burst.keystroke(true, () => sent.push(now) > 0, "s_b");
        now = 62000; burst.keystroke(true, () => sent.push(now) > 0, "s_b");
        return sent;
    }""")
    assert sent == [0, 15000, 30000, 43000, 61000, 61500]


def test_typing_on_through_a_reply_advises_the_conversation_with_it(
        tmp_path: Path, page: Any) -> None:
    """Someone sends a message and goes on typing the next one while the reply streams. That
    was one typing burst: its one notice came before the reply existed (the advisory's
    context lacked it), and none came after the reply was saved until the 15-s refresh. A sent
    message and a saved reply each renew the burst."""
    engine = ScriptedEngine(token_delay_s=0.05, reply=lambda turns: "word " * 40)  # about 2 s
    with live_server(scripted_config(tmp_path), engine) as base:
        open_chat(page, base)
        send(page, "first")  # a session to type in
        page.wait_for_timeout(2500)  # a pause: the next keystroke starts a burst
        composer = page.locator("#composer")
        composer.fill("second")
        composer.press("Enter")
        reply = page.locator(".msg.assistant").nth(1)
        for _ in range(12):  # a key every 250 ms, as someone typing the next message
            composer.press_sequentially("a")
            page.wait_for_timeout(250)
        reply.locator(".timings").wait_for()  # saved while the typing went on
        for _ in range(4):
            composer.press_sequentially("a")
            page.wait_for_timeout(250)
        contexts = ["".join(map(chr, tokens)) for _sid, tokens, _ in engine.advisories]
        assert any("second\n<assistant>word" in c for c in contexts), (
            f"no advisory covered the reply typed through: {[c[-40:] for c in contexts]}")
