"""Field recovery: invocation and artifact tables in their own schema (docs/tables.md).

Additive. The schema is ``booking.field-recovery.db-schema`` (env
BOOKING_FIELD_RECOVERY__DB_SCHEMA, default ``th_hotel_booking``) and is created here. The
tables mirror fieldrecovery/tables.py (checked by tests/integration/test_field_migration.py).
Field recovery runs on PostgreSQL only: on another database (the SQLite embedded default of
the crash demo) this revision creates nothing.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from settings import get_settings

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)
INV = "field_recovery_invocation"
ART = "field_recovery_artifact"


def _schema() -> str | None:
    if op.get_bind().dialect.name != "postgresql":
        return None
    return get_settings().booking_field_recovery.db_schema


def upgrade() -> None:
    schema = _schema()
    if schema is None:
        return
    op.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    op.create_table(
        INV,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("idempotency_key", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("source_message_id", sa.String(512), nullable=False),
        sa.Column("source_revision", sa.Integer, nullable=False),
        sa.Column("observation_hash", sa.String(64), nullable=False),
        sa.Column("profile_version", sa.String(128), nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("response_hash", sa.String(64), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("owner_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("provider_session_id", sa.String(128), nullable=True),
        sa.Column("provider_run_id", sa.String(128), nullable=True),
        sa.Column("resolved_profile_id", sa.String(128), nullable=True),
        sa.Column("resolved_profile_version", sa.String(128), nullable=True),
        sa.Column("model", sa.String(128), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("total_tokens", sa.Integer, nullable=True),
        sa.Column("duration_ms", sa.Integer, nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_summary", sa.String(512), nullable=True),
        sa.Column("patch_set", sa.JSON, nullable=True),
        sa.Column("assembly_result", sa.JSON, nullable=True),
        sa.Column("assembled_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("retention_until", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_field_recovery_invocation")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_field_recovery_invocation_idempotency_key")),
        sa.CheckConstraint(
            "status IN ('IN_PROGRESS', 'SUCCEEDED', 'FAILED')", name=op.f("ck_field_recovery_invocation_status")
        ),
        sa.CheckConstraint(
            "status <> 'SUCCEEDED' OR (patch_set IS NOT NULL AND completed_at IS NOT NULL)",
            name=op.f("ck_field_recovery_invocation_succeeded_has_patch_set"),
        ),
        sa.CheckConstraint(
            "status <> 'FAILED' OR (error_code IS NOT NULL AND completed_at IS NOT NULL)",
            name=op.f("ck_field_recovery_invocation_failed_has_error_code"),
        ),
        sa.CheckConstraint(
            "assembly_result IS NULL OR status = 'SUCCEEDED'",
            name=op.f("ck_field_recovery_invocation_assembly_only_on_success"),
        ),
        schema=schema,
    )
    op.create_index("ix_field_recovery_invocation_source", INV, ["source_message_id", "source_revision"], schema=schema)
    op.create_index(
        "ix_field_recovery_invocation_in_progress",
        INV,
        ["lease_expires_at"],
        schema=schema,
        postgresql_where=sa.text("status = 'IN_PROGRESS'"),
    )
    op.create_table(
        ART,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("source_message_id", sa.String(512), nullable=False),
        sa.Column("source_revision", sa.Integer, nullable=False),
        sa.Column("artifact_type", sa.String(32), nullable=False),
        sa.Column("idempotency_key", sa.String(64), nullable=True),
        sa.Column("content", sa.JSON, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_field_recovery_artifact")),
        sa.UniqueConstraint(
            "source_message_id",
            "source_revision",
            "artifact_type",
            "content_hash",
            name=op.f("uq_field_recovery_artifact_content"),
        ),
        # The artifact-type whitelist (fieldrecovery.tables.ArtifactType).
        sa.CheckConstraint(
            "artifact_type IN ('PARSED_FACT_SET', 'RECOVERY_REQUEST', 'RECOVERY_ASSEMBLY', 'EFFECTIVE_FACT_VIEW')",
            name=op.f("ck_field_recovery_artifact_artifact_type"),
        ),
        schema=schema,
    )
    op.create_index("ix_field_recovery_artifact_key", ART, ["idempotency_key"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    if schema is None:
        return
    op.drop_index("ix_field_recovery_artifact_key", table_name=ART, schema=schema)
    op.drop_table(ART, schema=schema)
    op.drop_index("ix_field_recovery_invocation_in_progress", table_name=INV, schema=schema)
    op.drop_index("ix_field_recovery_invocation_source", table_name=INV, schema=schema)
    op.drop_table(INV, schema=schema)
    # RESTRICT: the schema goes only if nothing else lives in it.
    op.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}"'))
