"""Behind PgBouncer in transaction mode (docs/scaling.md, "PgBouncer"): a private ``pgbouncer``
in front of the test PostgreSQL, never the system's. Such a pooler hands each transaction any
server connection and refuses libpq's ``options`` at connect; with ``DB_SETTINGS_SCOPE=transaction``
every transaction sets the server bounds for itself, and nothing a transaction set outlives it.
A delegation, a worker SIGKILLed mid-child and its recovery run through it end to end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg2
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from models import lease, transaction
from tests.helpers import executions_of, messages_of, wait_until
from tests.services import PgBouncer, require_pgbouncer
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final answer"}},
    {
        "when": {"system_contains": "subagent", "last_role": "user"},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
    },
    {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
]


def _bouncer_for(db_url: str, workdir: Path, pool_size: int = 20) -> PgBouncer:
    server = urlsplit(db_url.replace("postgresql+psycopg2", "postgresql"))
    return PgBouncer(
        workdir,
        server_host=server.hostname or "127.0.0.1",
        server_port=server.port or 5432,
        pool_size=pool_size,
        executable=require_pgbouncer(),
    )


def _database(db_url: str) -> str:
    return urlsplit(db_url).path.lstrip("/")


@pytest.fixture
def through_one_server_connection(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PgBouncer]:
    """This process's DATABASE_URL through a PgBouncer with ONE server connection: whatever a
    transaction leaves behind, the next one finds."""
    from models.db import dispose_engines
    from settings import get_settings

    with _bouncer_for(db, tmp_path / "pgbouncer", pool_size=1) as bouncer:
        monkeypatch.setenv("DATABASE_URL", bouncer.url(_database(db)))
        get_settings.cache_clear()
        dispose_engines()
        try:
            yield bouncer
        finally:
            monkeypatch.setenv("DATABASE_URL", db)
            monkeypatch.delenv("DB_SETTINGS_SCOPE", raising=False)
            get_settings.cache_clear()
            dispose_engines()


def _show(setting: str) -> str:
    """The setting in its base unit (milliseconds for a timeout), in a transaction of ours."""
    with transaction() as s:
        return str(s.execute(text("SELECT setting FROM pg_settings WHERE name = :n"), {"n": setting}).scalar_one())


def test_the_session_scope_cannot_connect_through_a_transaction_pooler(
    through_one_server_connection: PgBouncer,
) -> None:
    # Bounds sent at connect (libpq ``options``) are a session's state: PgBouncer in
    # transaction mode refuses them, so the pooled deployment must say DB_SETTINGS_SCOPE.
    with pytest.raises(OperationalError, match="unsupported startup parameter: options"):
        _show("lock_timeout")


def test_in_the_transaction_scope_every_transaction_carries_the_bounds_and_leaves_nothing_behind(
    through_one_server_connection: PgBouncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models.db import dispose_engines
    from settings import get_settings

    monkeypatch.setenv("DB_SETTINGS_SCOPE", "transaction")
    get_settings.cache_clear()
    dispose_engines()
    expected = lease.server_settings()
    assert _show("idle_in_transaction_session_timeout") == expected["idle_in_transaction_session_timeout"]
    assert _show("lock_timeout") == expected["lock_timeout"]
    # Another client of the same (one) server connection, outside our engine: nothing leaked.
    bouncer = through_one_server_connection
    database = _database(get_settings().DATABASE_URL)
    other = psycopg2.connect(host=bouncer.host, port=bouncer.port, user="postgres", dbname=database)
    try:
        other.autocommit = True
        cur = other.cursor()
        cur.execute("SHOW lock_timeout")
        assert cur.fetchone() == ("0",)
        cur.execute("SHOW idle_in_transaction_session_timeout")
        assert cur.fetchone() == ("0",)
    finally:
        other.close()


def test_a_delegation_and_a_crash_recovery_through_pgbouncer_deliver_exactly_once(
    stack_factory: StackFactory, db: str, tmp_path: Path
) -> None:
    with _bouncer_for(db, tmp_path / "pgbouncer") as bouncer:
        through = {"DATABASE_URL": bouncer.url(_database(db)), "DB_SETTINGS_SCOPE": "transaction"}
        stack = stack_factory(SCRIPT)
        w1 = stack.worker("w1", pool="threads", concurrency=8, CRASH_POINT="child.mid_tool", **through)
        sid = stack.submit("please work")
        wait_until(lambda: "crash_point=child.mid_tool" in w1.log() or w1.exited, timeout=60, what="crash mid-tool")
        assert "crash_point=child.mid_tool" in w1.log()
        w1.kill()
        before = [(e.id, e.child_session_id) for e in executions_of(sid)]
        w2 = stack.worker("w2", beat=True, pool="threads", concurrency=8, **through)
        snap = stack.wait_phase(sid, timeout=100)
        # No pool process starts on threads: the statement warm-up ran from the worker's boot.
        wait_until(lambda: "event=worker_warm_up " in w2.log(), timeout=30, what="the warm-up on a threads pool")
        execs = executions_of(sid)
        assert [(e.id, e.child_session_id) for e in execs] == before
        assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}
        assert snap["messages"][-1]["content"] == "final answer"
        rounds = [m for m in messages_of(sid) if m.role == "ASSISTANT" and m.tool_calls]
        assert len(rounds) == 1
        assert stack.invariants() == []
        forwarded = bouncer.stats(_database(db))
        assert forwarded.get("total_xact_count", 0) > 20, forwarded  # the workers' work went through it
        assert "unsupported startup parameter" not in bouncer.log()
