"""Operators sign in as themselves (docs/console.md, "Operators"): CONSOLE_OPERATORS_FILE names
each one's role and a hash of their token; every action is within the role, a refused one is
recorded; the shared token is not accepted beside the file; the hash is made by
``agent-recovery console hash-token`` from stdin. Cancels and redeliveries from the CLI are
recorded too. A real loopback server, the real PostgreSQL schema, the commands in subprocesses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import text

from console.auth import ConsoleConfig, ConsoleConfigError, load_config
from console.operators import Operators, hash_token, hash_token_pbkdf2, token_matches
from models import transaction
from settings import Settings
from tests.console_server import serve
from tests.helpers import make_execution, make_session, phase_of
from tests.integration.test_approval_display import env as env  # the fixture
from tests.integration.test_approval_display import parked as parked  # the fixture
from tests.integration.test_approvals import Runs, cli
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_api import TOKEN, login_csrf

TOKENS = {"vera": "vera-token-1", "alex": "alex-token-2", "ada": "ada-token-3"}
ROLES = {"vera": "viewer", "alex": "approver", "ada": "admin"}


@pytest.fixture(scope="module")
def operators_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("operators") / "operators.toml"
    entries = [
        f'[[operators]]\nname = "{name}"\nrole = "{ROLES[name]}"\ntoken_hash = "{hash_token(token)}"\n'
        for name, token in TOKENS.items()
    ]
    path.write_text("\n".join(entries))
    return path


def api(base: str, name: str, token: str | None = None) -> requests.Session:
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token or TOKENS[name]}"
    http.headers["X-Console-Operator"] = name
    http.headers["X-CSRF-Token"] = http.get(f"{base}/api/csrf", timeout=10).json().get("csrf", "")
    return http


def actions() -> list[tuple[Any, ...]]:
    with transaction() as s:
        rows = s.execute(
            text("SELECT actor, action, session_id, execution_id, call_id, outcome FROM operator_action ORDER BY id")
        )
        return [tuple(r) for r in rows]


def test_each_role_acts_within_itself_and_a_refused_action_is_recorded(
    db: str, operators_file: Path, parked: tuple[int, str, Any], runs: Runs
) -> None:
    waiting, call_id, _ = parked
    sid = make_session()
    parent = make_session()
    eid = make_execution(parent)
    config = ConsoleConfig(token="", read_only=False, show_content=False, operators=Operators(str(operators_file)))
    with serve(config) as base:
        request_id = api(base, "vera").get(f"{base}/api/approvals", timeout=10).json()["approvals"][0]["id"]
        viewer, approver, admin = api(base, "vera"), api(base, "alex"), api(base, "ada")
        assert viewer.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 403
        assert viewer.post(f"{base}/api/approvals/{request_id}/deny", json={"reason": "no"}, timeout=10).json() == {
            "error": "forbidden"
        }
        assert approver.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 403
        assert approver.post(f"{base}/api/executions/{eid}/redeliver", timeout=10).status_code == 403
        assert phase_of(sid) == "RUNNING"
        assert approver.post(f"{base}/api/approvals/{request_id}/approve", json={}, timeout=10).status_code == 200
        assert admin.post(f"{base}/api/sessions/{sid}/cancel", timeout=10).status_code == 200
    assert actions() == [
        ("console:vera", "cancel", sid, None, None, "forbidden"),
        ("console:vera", "deny", waiting, None, call_id, "forbidden"),
        ("console:alex", "cancel", sid, None, None, "forbidden"),
        ("console:alex", "redeliver", parent, eid, None, "forbidden"),
        ("console:alex", "approve", waiting, None, call_id, "decided"),
        ("console:ada", "cancel", sid, None, None, "cancelled"),
    ]


def test_an_operator_signs_in_with_their_own_token_and_sees_only_their_buttons(db: str, operators_file: Path) -> None:
    sid = make_session()
    config = ConsoleConfig(token="", read_only=False, show_content=False, operators=Operators(str(operators_file)))
    with serve(config) as base:
        viewer = requests.Session()
        csrf = login_csrf(viewer, base)
        assert "Your token" in viewer.get(f"{base}/login", timeout=10).text

        def sign_in(name: str, token: str) -> requests.Response:
            return viewer.post(f"{base}/login", data={"operator": name, "token": token, "csrf": csrf}, timeout=10)

        assert sign_in("vera", TOKENS["ada"]).status_code == 401
        assert sign_in("eve", "x").status_code == 401
        done = sign_in("vera", TOKENS["vera"])
        assert done.status_code == 200 and done.url.endswith("/")
        page = viewer.get(f"{base}/sessions/{sid}", timeout=10).text
        assert 'id="role">viewer<' in page and 'id="cancel"' not in page
        admin = requests.Session()
        csrf = login_csrf(admin, base)
        admin.post(f"{base}/login", data={"operator": "ada", "token": TOKENS["ada"], "csrf": csrf}, timeout=10)
        assert 'id="cancel"' in admin.get(f"{base}/sessions/{sid}", timeout=10).text
        # A cookie names its operator under a key of theirs: renamed, it signs nobody in.
        cookie = admin.cookies["console_session"]
        forged = requests.get(
            f"{base}/api/sessions", cookies={"console_session": cookie.replace("ada.", "vera.", 1)}, timeout=10
        )
        assert forged.status_code == 401
        # The shared token is no way in beside the operators file; a known name with another's token neither.
        assert api(base, "ada", token=TOKEN).get(f"{base}/api/sessions", timeout=10).status_code == 401
        assert api(base, "vera", token=TOKENS["ada"]).get(f"{base}/api/sessions", timeout=10).status_code == 401
    assert [(a, act, out) for a, act, _s, _e, _c, out in actions()] == [
        ("console:vera", "sign_in", "wrong_token"),
        ("console:eve", "sign_in", "wrong_token"),
        ("console:vera", "sign_in", "signed_in"),
        ("console:ada", "sign_in", "signed_in"),
    ]


def test_the_operators_file_is_read_at_start_and_a_wrong_one_stops_the_console(tmp_path: Path) -> None:
    good = tmp_path / "operators.json"
    good.write_text(json.dumps({"operators": [{"name": "bo", "role": "admin", "token_hash": hash_token_pbkdf2("t")}]}))
    config = load_config(Settings(CONSOLE_OPERATORS_FILE=str(good)), "0.0.0.0")
    assert config.needs_token and config.role_of("bo") == "admin" and config.role_of("nobody") is None
    assert config.token_ok("bo", "t") and not config.token_ok("bo", "u") and not config.token_ok("al", "t")
    for body, says in [
        ('[[operators]]\nname = "bo"\nrole = "root"\ntoken_hash = "x"\n', "role must be one of"),
        ('[[operators]]\nname = "b o"\nrole = "admin"\ntoken_hash = "x"\n', "name must be"),
        ('[[operators]]\nname = "bo"\nrole = "admin"\ntoken_hash = "plain"\n', "not a scrypt or pbkdf2_sha256"),
        ('[[operators]]\nname = "bo"\nrole = "admin"\ntoken_hash = "pbkdf2_sha256$10$AA$AA"\n', "iterations"),
        ("operators = 3", "a list of operators"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(body)
        with pytest.raises(ConsoleConfigError, match=says):
            load_config(Settings(CONSOLE_OPERATORS_FILE=str(bad)), "127.0.0.1")


def test_hash_token_reads_the_token_from_stdin_never_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret\n"))
    monkeypatch.setenv("AGENTS_FILE", "/nonexistent/agents.toml")  # it loads no tool
    assert main(["console", "hash-token"]) == 0
    stored = capsys.readouterr().out.strip()
    assert stored.startswith("scrypt$") and "s3cret" not in stored
    assert token_matches("s3cret", stored) and not token_matches("s3cret ", stored)
    with pytest.raises(SystemExit) as refused:
        main(["console", "hash-token", "s3cret"])
    assert refused.value.code == 2  # a token has no place in argv


def test_cancels_and_redeliveries_from_the_cli_are_recorded_with_who_asked(db: str, env: dict[str, str]) -> None:
    import getpass

    from cli.main import main

    sid = make_session()
    parent = make_session()
    eid = make_execution(parent)
    assert main(["cancel", str(sid), "--by", "dave"]) == 0
    assert main(["cancel", str(sid)]) == 0  # already stopped: recorded too
    assert main(["cancel", str(sid), "--by", "x" * 200]) == 2  # nothing done, nothing recorded
    assert cli("redeliver", str(eid), "--by", "dave", env=env).returncode == 0
    assert cli("redeliver", str(parent), "--parent", env=env).returncode == 0
    me = f"cli:{getpass.getuser()}"
    assert actions() == [
        ("cli:dave", "cancel", sid, None, None, "cancelled"),
        (me, "cancel", sid, None, None, "already_stopped"),
        ("cli:dave", "redeliver", parent, eid, None, "still_running"),
        (me, "redeliver", parent, None, None, "waiting"),
    ]


def test_a_changed_operators_file_is_read_again_and_a_broken_one_keeps_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import console.operators as operators_module

    monkeypatch.setattr(operators_module, "RELOAD_CHECK_SECONDS", 0.0)
    path = tmp_path / "operators.toml"

    def write(body: str, mtime: int) -> None:
        path.write_text(body)
        os.utime(path, (mtime, mtime))

    entry = '[[operators]]\nname = "{}"\nrole = "{}"\ntoken_hash = "{}"\n'
    write(entry.format("kim", "admin", hash_token("old")), 1_000)
    found = Operators(str(path))
    assert found.authenticate("kim", "old") is not None
    assert found.authenticate("kim", "old") is not None  # the second time from memory
    write(entry.format("kim", "viewer", hash_token("new")), 2_000)  # a new token and role
    assert found.authenticate("kim", "old") is None  # the remembered check is gone with the hash
    kim = found.authenticate("kim", "new")
    assert kim is not None and kim.role == "viewer"
    write("not toml [", 3_000)
    assert found.get("kim") is not None  # the operators read last stay
