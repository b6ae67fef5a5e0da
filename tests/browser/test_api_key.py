"""The UI against a server that requires an API key (scripted engine: no model needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server

pytestmark = pytest.mark.browser
KEY = "test-key-123456"


@pytest.fixture
def keyed_url(tmp_path: Path) -> Iterator[str]:
    engine = ScriptedEngine(token_delay_s=0.01, max_model_len=1000)
    with live_server(scripted_config(tmp_path, api_keys=(KEY,)), engine) as url:
        yield url


def test_chat_asks_for_the_key_and_keeps_it(keyed_url: str, page: Any, artifacts: Path) -> None:
    page.goto(keyed_url + "/")
    page.locator("#auth-dialog[open]").wait_for()
    page.screenshot(path=str(artifacts / "api-key-prompt.png"))
    page.locator("#api-key-input").fill(KEY)
    page.locator("#api-key-save").click()
    page.wait_for_selector("body[data-connected=true]")
    page.locator("#composer").fill("hello there")
    page.locator("#composer").press("Enter")
    page.locator(".msg.assistant .bubble", has_text="You said: hello there").wait_for()
    # The key is kept in the browser: the dashboard, on another page, uses it at once.
    page.goto(keyed_url + "/dashboard")
    page.wait_for_selector("body[data-connected=true]")
    assert not page.locator("#auth-dialog[open]").count()


def test_dashboard_asks_for_the_key(keyed_url: str, page: Any) -> None:
    page.goto(keyed_url + "/dashboard")
    page.locator("#auth-dialog[open]").wait_for()
    assert page.locator("#error .error-code").inner_text() == "unauthorized"
    page.locator("#api-key-input").fill(KEY)
    page.locator("#api-key-save").click()
    page.wait_for_selector("body[data-connected=true]")
