"""A real browser for the console's tests: Debian's Chromium driven by Playwright, launched by
its path (Playwright's own browser download is never used). Without a Chromium the tests skip
with that reason on a developer's machine, and FAIL in CI (CI=true), where .ci/run installs it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI

#: A site's name that this browser resolves to 127.0.0.1 (the state after a DNS rebinding).
REBOUND_NAME = "rebound.example"
#: Flags for a headless Chromium in a container, with no call home.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # A name that resolves to loopback, as a DNS-rebinding site's name does after its rebind.
    f"--host-resolver-rules=MAP {REBOUND_NAME} 127.0.0.1",
]


def wait_js(page: Any, expression: str, *, timeout: float = 30.0, what: str = "") -> None:
    """Wait until ``expression`` (JavaScript) is truthy in ``page``. Playwright's own
    ``wait_for_function`` evaluates a string in the page, which the console's
    Content-Security-Policy refuses (no eval); ``page.evaluate`` is not subject to it."""
    import time

    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or expression}; {page_state(page)}")
        page.wait_for_timeout(100)


def page_state(page: Any) -> str:
    """What a failed wait saw, for its message: the page's address, its live part's polling
    (active, and how long ago it last asked and last swapped), and its visible text's start;
    a screenshot beside the test's files (BROWSER_FAILURE_DIR, else the temporary directory)."""
    import tempfile
    import time

    state = page.evaluate(
        """() => {
        const live = document.getElementById("live");
        const ago = (v) => (v ? Date.now() - Number(v) : null);
        return {
            url: location.href,
            visibility: document.visibilityState,
            live: live ? {active: live.dataset.active, asked_ms_ago: ago(live.dataset.updatedAt),
                          swapped_ms_ago: ago(live.dataset.swappedAt)} : null,
            text: document.body ? document.body.innerText.slice(0, 600) : "",
        };
    }"""
    )
    folder = Path(os.environ.get("BROWSER_FAILURE_DIR") or tempfile.gettempdir())
    shot = folder / f"browser-failure-{int(time.time())}.png"
    try:
        page.screenshot(path=str(shot), full_page=True)
        state["screenshot"] = str(shot)
    except Exception as exc:  # the page may be gone: the state above still says what it was
        state["screenshot"] = f"not taken: {type(exc).__name__}"
    return json.dumps(state)


def chromium_path() -> str | None:
    """CHROMIUM (a path), else the system's chromium."""
    named = os.environ.get("CHROMIUM", "")
    if named and os.access(named, os.X_OK):
        return named
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser_page() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        if IN_CI:
            pytest.fail("no Chromium found: CI=true needs it for the console's browser tests (.ci/run installs it)")
        pytest.skip("no Chromium found (apt-get install chromium): the console's browser tests were skipped")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the dev extra has it): the browser tests were skipped")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.set_default_timeout(30_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()
