"""Headless Chromium (Debian's `chromium`, driven by Playwright) against real servers.

Screenshots go to `artifacts/browser/` (or `$ANTIPHON_ARTIFACTS/browser`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def chromium_path() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        message = "chromium is not installed (`make test` installs it: tools/install-chromium.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def artifacts() -> Path:
    out = Path(os.environ.get("ANTIPHON_ARTIFACTS", ROOT / "artifacts")) / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Module-scoped: Playwright's sync API runs an event loop in this thread while it is open,
    which the asyncio tests of other modules must not find running."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    with sync_playwright() as p:
        # Playwright launches with a fresh temporary profile (its --user-data-dir), and every
        # test gets a new context with empty storage on top of it.
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    """A page in a fresh context (its own storage); JavaScript errors fail the test. The
    pages' Content-Security-Policy is bypassed: it forbids the `eval` that Playwright's
    `wait_for_function` runs in the page (`test_pages_work_under_their_content_security_policy`
    drives the pages with it on)."""
    context = browser.new_context(viewport={"width": 1280, "height": 860},  # type: ignore[attr-defined]
                                  accept_downloads=True, bypass_csp=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("dialog", lambda dialog: dialog.accept())
    pg.js_errors = errors
    yield pg
    context.close()
    assert not errors, errors
