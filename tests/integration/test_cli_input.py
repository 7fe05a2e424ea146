"""Bad input at the CLI: one line naming the problem on stderr and a
non-zero exit, never a traceback. Each command runs as an operator runs it, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import make_execution, make_session
from tests.types import StackFactory

MAIN = "main agent"


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *argv],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("agent-recovery: ")
    for word in words:
        assert word in lines[0]
    return lines[0]


@pytest.fixture
def db_env(db: str) -> dict[str, str]:
    return {"DATABASE_URL": db}


def test_cancelling_a_session_that_does_not_exist_names_it_and_fails(db_env: dict[str, str]) -> None:
    assert_one_line_error(cli("cancel", "999999", env=db_env), "no session 999999")


def test_cancelling_an_existing_session_still_works(db_env: dict[str, str]) -> None:
    sid = make_session()
    done = cli("cancel", str(sid), env=db_env)
    assert done.returncode == 0 and f"session {sid}: cancelled" in done.stdout


def test_submitting_to_an_unknown_agent_names_it_and_saves_nothing(db_env: dict[str, str]) -> None:
    from harness.views import session_list
    from models import transaction

    assert_one_line_error(cli("submit", "--agent", "nosuch", "hello", env=db_env), "unknown agent 'nosuch'")
    with transaction() as s:
        assert session_list(s, 10) == []


def test_an_empty_local_client_user_is_refused(db_env: dict[str, str]) -> None:
    for action in ("connect", "disconnect"):
        assert_one_line_error(cli("local-client", action, "", env=db_env), "user id is empty")
        assert_one_line_error(cli("local-client", action, "  ", env=db_env), "user id is empty")


def test_showing_or_redelivering_what_does_not_exist_names_it_and_fails(db_env: dict[str, str]) -> None:
    assert_one_line_error(cli("session", "show", "999999", env=db_env), "no session 999999")
    assert_one_line_error(cli("session", "show", "999999", "--json", env=db_env), "no session 999999")
    assert_one_line_error(cli("redeliver", "999999", env=db_env), "no execution 999999")
    assert_one_line_error(cli("redeliver", "--parent", "999999", env=db_env), "no session 999999")


def test_redelivering_an_existing_execution_still_works(db_env: dict[str, str]) -> None:
    eid = make_execution(make_session())
    done = cli("redeliver", str(eid), env=db_env)
    assert done.returncode == 0 and done.stdout.strip() == "still_running"


def test_a_database_that_does_not_answer_is_named_without_its_password() -> None:
    from tests.services import free_port

    url = f"postgresql+psycopg2://someone:s3cret@127.0.0.1:{free_port()}/nodb"
    for argv in (("status",), ("cancel", "1"), ("session", "list")):
        line = assert_one_line_error(cli(*argv, env={"DATABASE_URL": url}), "database is unreachable")
        assert "s3cret" not in line


def script() -> list[dict]:  # type: ignore[type-arg]
    return [{"when": {"system_contains": MAIN, "turn": 0}, "reply": {"content": "hello back"}}]


@pytest.mark.timeout(120)
def test_a_submit_the_broker_did_not_take_prints_its_session_and_the_scan_starts_it_later(
    stack_factory: StackFactory,
) -> None:
    from tests.services import free_port

    stack = stack_factory(script())
    down = {**stack.env, "CELERY_BROKER_URL": f"redis://127.0.0.1:{free_port()}/4"}
    done = cli("submit", "hello", env=down)
    line = assert_one_line_error(done, "saved", "broker", "scan will start it")
    sid = int(done.stdout.strip())
    assert f"session {sid} " in line
    assert stack.snapshot(sid)["phase"] == "RUNNING"  # committed, nobody runs it yet

    stack.worker("w1", beat=True)  # the broker is back (the stack's own), with a worker and a beat
    snap = stack.wait_phase(sid, timeout=60)
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT"]
    assert stack.invariants() == []


def test_a_scan_with_the_broker_down_says_so_and_reserves_nothing(db_env: dict[str, str]) -> None:
    from tests.services import free_port

    parent = make_session()
    eid = make_execution(parent)  # no lease: the scan would reserve it at once
    down = {**db_env, "CELERY_BROKER_URL": f"redis://127.0.0.1:{free_port()}/4"}
    assert_one_line_error(cli("scan", env=down), "broker is unreachable", "nothing was scanned")
    from tests.helpers import executions_of

    assert [e.epoch for e in executions_of(parent) if e.id == eid] == [0]


def test_a_session_list_limit_below_one_is_refused(db_env: dict[str, str]) -> None:
    done = cli("session", "list", "--limit", "-1", env=db_env)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "must be at least 1" in done.stderr
