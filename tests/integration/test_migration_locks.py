"""Migration 0010 on a large subagent_execution: its index build never holds a table lock that
blocks readers or writers (pg_locks is read while the upgrade runs)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import create_engine, text

BLOCKING = ("ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")


@pytest.mark.timeout(300)
def test_the_0010_index_build_holds_no_lock_that_blocks_readers_or_writers_of_the_table(fresh_db_url: str) -> None:
    from alembic import command

    from migrations import alembic_config

    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "0009")
    engine = create_engine(fresh_db_url)
    with engine.begin() as conn:
        sid = conn.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, started_at, updated_at)"
                " VALUES ('u1', 'NORMAL', 'main', 'RUNNING', now(), now()) RETURNING id"
            )
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
                " status, delivery_status, started_at, completed_at, parent_result_delivered_at)"
                " SELECT :sid, :sid, 'reviewer', 'old', 'COMPLETED', 'DELIVERED', now(), now(), now()"
                " FROM generate_series(1, 400000)"
            ),
            {"sid": sid},
        )
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        with engine.connect() as conn:
            while not done.is_set():
                rows = conn.execute(
                    text(
                        "SELECT l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                        " WHERE c.relname = 'subagent_execution' AND l.granted AND l.pid <> pg_backend_pid()"
                    )
                ).scalars()
                seen.extend(m for m in rows if m in BLOCKING)
                conn.rollback()
                time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        command.upgrade(cfg, "0010")
    finally:
        done.set()
        watcher.join(10)
    engine.dispose()
    assert seen == [], f"the upgrade held {sorted(set(seen))} on subagent_execution"
