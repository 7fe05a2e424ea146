"""Ours: worker boot generations, the last scan's record, lease generations.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "worker_boot",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("booted_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_worker_boot")),
    )
    op.create_table(
        "recovery_scan",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("duration_ms", sa.Integer, nullable=False),
        sa.Column("parents", sa.Integer, nullable=False),
        sa.Column("executions", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_recovery_scan")),
    )
    for table in ("agent_session", "subagent_execution"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("lease_generation", sa.Integer, nullable=True))


def downgrade() -> None:
    for table in ("subagent_execution", "agent_session"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("lease_generation")
    op.drop_table("recovery_scan")
    op.drop_table("worker_boot")
