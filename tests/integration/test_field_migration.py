"""Migration 0004 and the field-recovery table models agree; schema and CHECKs hold.

migrations/env.py compares only models.Base; the field tables have their own MetaData in their
own schema, so this file is their `alembic check`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from fieldrecovery.store import InvocationMeta, InvocationStore
from fieldrecovery.tables import DEFAULT_SCHEMA, FieldBase
from migrations import alembic_config
from settings import get_settings
from tests.field_helpers import clean_field_tables


def _diff(url: str, metadata: MetaData, schema: str = DEFAULT_SCHEMA) -> list[object]:
    def include_name(name: str | None, type_: str, parent_names: object) -> bool:
        return name == schema if type_ == "schema" else True

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_name": include_name,
                    "compare_type": True,
                    "target_metadata": metadata,
                },
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


@pytest.fixture
def field_db(db: str) -> Iterator[str]:
    clean_field_tables(db)
    yield db


def test_field_models_and_migration_0004_agree(pg_url: str) -> None:
    assert _diff(pg_url, FieldBase.metadata) == []


def test_the_comparison_sees_a_model_change(pg_url: str) -> None:
    changed = MetaData(schema=DEFAULT_SCHEMA)
    for table in FieldBase.metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables[f"{DEFAULT_SCHEMA}.field_recovery_invocation"].append_column(Column("extra", Integer))
    diff = _diff(pg_url, changed)
    assert [(op[0], op[1], op[2], op[3].name) for op in diff] == [  # type: ignore[index]
        ("add_column", DEFAULT_SCHEMA, "field_recovery_invocation", "extra")
    ]


def test_artifact_type_whitelist_and_status_checks_hold(field_db: str) -> None:
    engine = create_engine(field_db)
    try:
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO th_hotel_booking.field_recovery_artifact (source_message_id, source_revision,"
                    " artifact_type, content, content_hash, created_at) VALUES ('m', 1, 'RAW_ANSWER', '{}', 'h', now())"
                )
            )
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO th_hotel_booking.field_recovery_invocation (idempotency_key, request_id, attempt,"
                    " source_message_id, source_revision, observation_hash, profile_version, request_hash, status,"
                    " owner_id, created_at, started_at, completed_at, updated_at, retention_until)"
                    " VALUES ('k', 'r', 1, 'm', 1, 'o', 'p', 'h', 'SUCCEEDED', 'x', now(), now(), now(), now(), now())"
                )
            )
    finally:
        engine.dispose()


def test_migration_uses_the_configured_schema_and_downgrades_cleanly(
    fresh_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOOKING_FIELD_RECOVERY__DB_SCHEMA", "booking_alt")
    get_settings.cache_clear()
    try:
        cfg = alembic_config(fresh_db_url)
        command.upgrade(cfg, "head")
        engine = create_engine(fresh_db_url)
        assert set(inspect(engine).get_table_names(schema="booking_alt")) == {
            "field_recovery_invocation",
            "field_recovery_artifact",
        }
        assert "th_hotel_booking" not in inspect(engine).get_schema_names()
        assert _diff(fresh_db_url, _translated("booking_alt"), schema="booking_alt") == []
        # The store maps its tables to the configured schema at run time.
        store = InvocationStore(fresh_db_url, schema="booking_alt")
        meta = InvocationMeta("k", "r", 1, "<m@x>", 1, "o", "pv", "h")
        assert store.claim(meta, "owner", stale_takeover=False).owned
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM booking_alt.field_recovery_invocation")).scalar_one() == 1
        store.engine().dispose()
        command.downgrade(cfg, "0003")
        assert "booking_alt" not in inspect(engine).get_schema_names()
        command.upgrade(cfg, "head")
        assert "field_recovery_invocation" in inspect(engine).get_table_names(schema="booking_alt")
        engine.dispose()
    finally:
        monkeypatch.delenv("BOOKING_FIELD_RECOVERY__DB_SCHEMA")
        get_settings.cache_clear()


def _translated(schema: str) -> MetaData:
    out = MetaData(schema=schema)
    for table in FieldBase.metadata.sorted_tables:
        table.to_metadata(out, schema=schema)
    return out
