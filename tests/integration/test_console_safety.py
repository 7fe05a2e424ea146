"""The console is safe to leave running (docs/console.md): it answers only the host names it is
meant to be reached by (a DNS-rebinding page gets nothing), it slows down token guessing, every
answer carries the security headers, and the served command logs who did what. A real loopback
server, the real PostgreSQL schema."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests

from console.auth import load_config
from models import Phase
from tests.console_server import serve
from tests.helpers import make_session, phase_of, wait_until
from tests.integration.test_console_api import TOKEN, Serve, client, login_csrf
from tests.integration.test_console_api import console as console  # the fixture


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


# --- host names (DNS rebinding) -----------------------------------------------------------------


@pytest.mark.parametrize("token", ["", TOKEN])
def test_a_request_naming_another_host_is_refused_with_or_without_the_token_and_changes_nothing(
    console: Serve, token: str
) -> None:
    base = console(token=token)
    port = _port(base)
    sid = make_session()
    http = client(base, token=token or None)
    for host in (f"rebind.example:{port}", "rebind.example", f"127.0.0.1.evil.example:{port}", ""):
        for path in ("/", "/api/sessions", f"/api/sessions/{sid}", "/api/csrf", "/login"):
            r = http.get(base + path, headers={"Host": host}, timeout=10)
            assert r.status_code == 400, (host, path, r.status_code)
            assert r.json() == {"error": "host_not_allowed"}
        posted = http.post(f"{base}/api/sessions/{sid}/cancel", headers={"Host": host}, timeout=10)
        assert posted.status_code == 400
    assert phase_of(sid) == Phase.RUNNING
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "127.0.0.1"):
        assert http.get(f"{base}/api/sessions", headers={"Host": host}, timeout=10).status_code == 200, host


def test_names_beyond_loopback_are_allowed_by_console_allowed_hosts_and_the_address_listened_on(
    db: str,
) -> None:
    from settings import load_settings

    settings = load_settings(CONSOLE_TOKEN=TOKEN, CONSOLE_ALLOWED_HOSTS="console.example.com, .ops.example")
    allowed = load_config(settings, "10.1.2.3").allowed_hosts
    assert {"console.example.com", ".ops.example", "10.1.2.3", "localhost", "127.0.0.1"} <= allowed
    assert "0.0.0.0" not in load_config(settings, "0.0.0.0").allowed_hosts  # a wildcard names no host
    config = load_config(settings, "127.0.0.1")
    with serve(config) as base:
        port = _port(base)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for host, status in (
            (f"console.example.com:{port}", 200),
            ("CONSOLE.example.com", 200),
            (f"a.ops.example:{port}", 200),
            ("ops.example", 200),
            ("xops.example", 400),
            ("other.example.com", 400),
        ):
            r = requests.get(f"{base}/api/sessions", headers={**auth, "Host": host}, timeout=10)
            assert r.status_code == status, host


# --- security headers ---------------------------------------------------------------------------


def test_every_answer_carries_the_security_headers_and_authenticated_ones_are_not_stored(console: Serve) -> None:
    base = console()
    sid = make_session()
    http = client(base)
    answers = {
        "page": http.get(f"{base}/sessions/{sid}", timeout=10),
        "live": http.get(f"{base}/sessions/{sid}/live", timeout=10),
        "api": http.get(f"{base}/api/sessions", timeout=10),
        "login": requests.get(f"{base}/login", timeout=10),
        "unauthorized": requests.get(f"{base}/api/sessions", timeout=10),
        "static": requests.get(f"{base}/static/console.js", timeout=10),
    }
    for name, r in answers.items():
        csp = r.headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in csp, name
        assert re.search(r"script-src 'self'(;|$)", csp), (name, csp)
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, name
        assert r.headers.get("x-content-type-options") == "nosniff", name
        assert r.headers.get("referrer-policy") == "no-referrer", name
        assert r.headers.get("x-frame-options") == "DENY", name
    for name in ("page", "live", "api", "login", "unauthorized"):
        assert answers[name].headers.get("cache-control") == "no-store", name


def test_no_page_holds_an_inline_script_or_event_handler(console: Serve) -> None:
    base = console()
    sid = make_session()
    http = client(base)
    for path in ("/", f"/sessions/{sid}", f"/sessions/{sid}/live", "/approvals", "/health", "/login"):
        html = http.get(base + path, timeout=10).text
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), path
        assert not re.search(r"\son[a-z]+\s*=", html, re.IGNORECASE), path


# --- refused sign-ins ---------------------------------------------------------------------------


def test_repeated_refused_sign_ins_from_one_address_are_slowed_down_then_let_through(console: Serve) -> None:
    from console.auth import FREE_FAILURES

    base = console()
    browser = requests.Session()
    csrf = login_csrf(browser, base)

    def sign_in(token: str) -> requests.Response:
        return browser.post(f"{base}/login", data={"operator": "x", "token": token, "csrf": csrf}, timeout=10)

    for _ in range(FREE_FAILURES):
        assert sign_in("guess").status_code == 401
    slowed = sign_in(TOKEN)
    assert slowed.status_code == 429  # even the right token waits: the check is not made at all
    wait = int(slowed.headers["retry-after"])
    assert wait >= 1
    api = requests.get(f"{base}/api/sessions", headers={"Authorization": "Bearer guess"}, timeout=10)
    assert api.status_code == 429  # a bearer guess is a sign-in too
    time.sleep(wait + 0.2)
    assert requests.get(f"{base}/api/sessions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).ok
    # A success forgets the failures.
    assert sign_in("guess").status_code == 401


# --- the served command's log -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served_console(db: str, redis_url: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``agent-recovery console`` as an operator starts it, in a subprocess, with a token."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLE_")}
    env.update(DATABASE_URL=db, REDIS_URL=redis_url, CONSOLE_TOKEN=TOKEN, LOG_LEVEL="INFO")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "console", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{base}/login", timeout=2).status_code == 200
        except requests.ConnectionError:
            return proc.poll() is None and False

    try:
        wait_until(up, timeout=30, what="the console answers")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_console_command_logs_each_request_each_action_and_each_refused_sign_in_without_the_token(
    served_console: tuple[str, subprocess.Popen[str]],
) -> None:
    base, proc = served_console
    sid = make_session()
    http = client(base, operator="alice")
    assert http.get(f"{base}/api/sessions", params={"user": "secret-filter"}, timeout=10).status_code == 200
    assert http.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 200
    browser = requests.Session()
    form = {"operator": "mallory", "token": TOKEN + "x", "csrf": login_csrf(browser, base)}
    refused = browser.post(f"{base}/login", data=form, timeout=10)
    assert refused.status_code == 401
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    lines = out.splitlines()
    requests_logged = [ln for ln in lines if "event=console_request " in ln]
    listed = [ln for ln in requests_logged if "path=/api/sessions " in ln and "method=GET" in ln]
    assert listed, out
    assert re.search(r"status=200 duration_ms=\d+ operator=alice", listed[0]), listed[0]
    assert "secret-filter" not in out  # the path is logged without its query
    (action,) = [ln for ln in lines if "event=console_action " in ln]
    assert f"action=cancel session_id={sid}" in action and "outcome=cancelled" in action
    assert "operator=alice" in action
    assert any("event=console_login_refused" in ln and "operator=mallory" in ln for ln in lines), out
    assert TOKEN not in out
