"""A sign-in that ends (docs/console.md): the session cookie expires after
CONSOLE_SESSION_HOURS, and an operator signs out (a POST with the CSRF token). A real
loopback server."""

from __future__ import annotations

import time

import requests

from console.auth import ConsoleConfig
from tests.console_server import serve
from tests.integration.test_console_api import TOKEN, login_csrf


def signed_in(base: str, operator: str = "alice") -> tuple[requests.Session, str]:
    browser = requests.Session()
    csrf = login_csrf(browser, base)
    done = browser.post(f"{base}/login", data={"operator": operator, "token": TOKEN, "csrf": csrf}, timeout=10)
    assert done.status_code == 200 and done.url.endswith("/")
    return browser, csrf


def test_a_sign_in_expires(db: str) -> None:
    with serve(ConsoleConfig(token=TOKEN, read_only=False, show_content=False, session_seconds=1.5)) as base:
        browser, _ = signed_in(base)
        assert browser.get(f"{base}/api/sessions", timeout=10).status_code == 200
        time.sleep(2.0)
        assert browser.get(f"{base}/api/sessions", timeout=10).status_code == 401
        assert "Console token" in browser.get(f"{base}/", timeout=10).text


def test_signing_out_ends_the_sign_in_and_needs_the_csrf_token(db: str) -> None:
    with serve(ConsoleConfig(token=TOKEN, read_only=False, show_content=False)) as base:
        browser, csrf = signed_in(base)
        page = browser.get(f"{base}/", timeout=10).text
        assert 'action="/logout"' in page
        forged = browser.post(f"{base}/logout", data={"csrf": "forged"}, allow_redirects=False, timeout=10)
        assert forged.status_code == 403
        assert browser.get(f"{base}/api/sessions", timeout=10).status_code == 200
        out = browser.post(f"{base}/logout", data={"csrf": csrf}, allow_redirects=False, timeout=10)
        assert out.status_code == 303 and out.headers["location"] == "/login"
        assert browser.get(f"{base}/api/sessions", timeout=10).status_code == 401
