"""Field recovery retention: artifacts get retention_until; both tables are purged by it.

Additive. ``field_recovery_artifact.retention_until`` is backfilled as created_at plus the
default 90 days (the invocations' own default), then made NOT NULL. Two indexes serve the
``field.purge_expired`` batches, which delete rows past ``retention_until``. Like 0004, this
revision does nothing on a database other than PostgreSQL.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from settings import get_settings

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

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
    op.add_column(ART, sa.Column("retention_until", TS, nullable=True), schema=schema)
    op.execute(sa.text(f"UPDATE \"{schema}\".{ART} SET retention_until = created_at + interval '90 days'"))
    op.alter_column(ART, "retention_until", nullable=False, schema=schema)
    op.create_index("ix_field_recovery_artifact_retention_until", ART, ["retention_until"], schema=schema)
    op.create_index("ix_field_recovery_invocation_retention_until", INV, ["retention_until"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    if schema is None:
        return
    op.drop_index("ix_field_recovery_invocation_retention_until", table_name=INV, schema=schema)
    op.drop_index("ix_field_recovery_artifact_retention_until", table_name=ART, schema=schema)
    op.drop_column(ART, "retention_until", schema=schema)
