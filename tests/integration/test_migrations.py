"""Migrations on data shaped like production (docs/fault-model.md, R19) and models/migrations agreement."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic import command
from alembic.util.exc import CommandError
from sqlalchemy import create_engine, inspect, text

from migrations import alembic_config

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _seed_pre_upgrade(url: str) -> dict[str, int]:
    engine = create_engine(url)
    ids: dict[str, int] = {}
    with engine.begin() as conn:
        parent = conn.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, started_at, updated_at)"
                " VALUES ('u1', 'NORMAL', 'main', 'RUNNING', :t, :t) RETURNING id"
            ),
            {"t": NOW},
        ).scalar_one()
        for status in ("RUNNING", "COMPLETED", "FAILED", "CANCELLED"):
            child = conn.execute(
                text(
                    "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, phase,"
                    " started_at, updated_at) VALUES ('u1', 'SUBAGENT', :p, 'reviewer', NULL, :t, :t) RETURNING id"
                ),
                {"p": parent, "t": NOW},
            ).scalar_one()
            ids[status] = conn.execute(
                text(
                    "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type,"
                    " task_description, status, started_at) VALUES (:p, :c, 'reviewer', 'old task', :s, :t)"
                    " RETURNING id"
                ),
                {"p": parent, "c": child, "s": status, "t": NOW},
            ).scalar_one()
    engine.dispose()
    return ids


def test_upgrade_backfills_running_as_pending_and_terminal_as_legacy(fresh_db_url: str) -> None:
    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "0001")
    ids = _seed_pre_upgrade(fresh_db_url)
    command.upgrade(cfg, "head")

    engine = create_engine(fresh_db_url)
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT id, delivery_status FROM subagent_execution")).all())
        assert rows[ids["RUNNING"]] == "PENDING"
        for status in ("COMPLETED", "FAILED", "CANCELLED"):
            assert rows[ids[status]] == "LEGACY"
        legacy_untouched = conn.execute(
            text(
                "SELECT count(*) FROM subagent_execution WHERE invocation_type IS NULL AND parent_tool_call_id IS NULL"
            )
        ).scalar_one()
        assert legacy_untouched == 4

    insp = inspect(engine)
    cols = {c["name"]: c for c in insp.get_columns("subagent_execution")}
    assert cols["delivery_status"]["nullable"] is False
    assert "PENDING" in str(cols["delivery_status"]["default"])
    for name in (
        "invocation_type",
        "parent_tool_call_id",
        "parent_result_delivered_at",
        "parent_assistant_message_id",
        "parent_tool_message_id",
        "execution_start_message_id",
        "final_message_id",
        "total_tool_calls",
        "lease_owner",
        "lease_expires_at",
        "epoch",
    ):
        assert name in cols, name
    indexes = {i["name"]: i for i in insp.get_indexes("subagent_execution")}
    assert "idx_sae_recovery" not in indexes, "no index names status (0010: in-place updates)"
    assert not [name for name, i in indexes.items() if "status" in i["column_names"]]
    assert indexes["ix_sae_settled_unfinished"]["column_names"] == ["id"]
    assert "idx_sae_pending" in indexes
    uniques = {u["name"]: u["column_names"] for u in insp.get_unique_constraints("subagent_execution")}
    assert uniques["uq_sae_parent_tool_call"] == ["parent_session_id", "parent_tool_call_id"]
    with engine.connect() as conn:
        partial = conn.execute(text("SELECT indexdef FROM pg_indexes WHERE indexname = 'idx_sae_pending'")).scalar_one()
        assert "WHERE" in partial and "PENDING" in partial
        options = conn.execute(text("SELECT reloptions FROM pg_class WHERE relname = 'subagent_execution'")).scalar()
        assert "fillfactor=70" in (options or []), options
        # A new row that names no delivery_status gets the default PENDING.
        parent = conn.execute(text("SELECT parent_session_id, child_session_id FROM subagent_execution")).first()
        assert parent is not None
        new_id = conn.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
                " status, started_at) VALUES (:p, :c, 'reviewer', 't', 'RUNNING', now()) RETURNING id"
            ),
            {"p": parent[0], "c": parent[1]},
        ).scalar_one()
        assert (
            conn.execute(
                text("SELECT delivery_status FROM subagent_execution WHERE id = :i"), {"i": new_id}
            ).scalar_one()
            == "PENDING"
        )
    engine.dispose()


def test_upgrade_refuses_rows_with_unknown_status(fresh_db_url: str) -> None:
    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "0001")
    ids = _seed_pre_upgrade(fresh_db_url)
    engine = create_engine(fresh_db_url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE subagent_execution DROP CONSTRAINT ck_subagent_execution_status"))
        conn.execute(text("UPDATE subagent_execution SET status = 'WEIRD' WHERE id = :i"), {"i": ids["FAILED"]})
    engine.dispose()
    with pytest.raises(RuntimeError, match="status outside the known set"):
        command.upgrade(cfg, "head")


def test_models_and_migrations_agree(pg_url: str) -> None:
    # `alembic check` raises when autogenerate finds any difference.
    try:
        command.check(alembic_config(pg_url))
    except CommandError as exc:  # pragma: no cover - the failure message is the diff
        pytest.fail(f"models and migrations disagree: {exc}")


def test_downgrade_to_base_and_back(fresh_db_url: str) -> None:
    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "base")
    command.upgrade(cfg, "head")
    engine = create_engine(fresh_db_url)
    assert "pending_round" in inspect(engine).get_table_names()
    engine.dispose()
