"""Ours: pending_round, leases and epochs (docs/tables.md; docs/invariants.md, I6).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pending_round",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("assistant_content", sa.Text, nullable=True),
        sa.Column("tool_calls", sa.JSON, nullable=False),
        sa.Column("inline_results", sa.JSON, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("closed_at", TS, nullable=True),
    )
    op.create_index(
        "uq_pending_round_open",
        "pending_round",
        ["session_id"],
        unique=True,
        postgresql_where=sa.text("closed_at IS NULL"),
        sqlite_where=sa.text("closed_at IS NULL"),
    )
    with op.batch_alter_table("agent_session") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer, nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("lease_owner", sa.String(128), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", TS, nullable=True))
    with op.batch_alter_table("subagent_execution") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer, nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("lease_owner", sa.String(128), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", TS, nullable=True))
        batch.add_column(sa.Column("pending_round_id", sa.BigInteger, nullable=True))
        batch.create_foreign_key(
            op.f("fk_subagent_execution_pending_round_id_pending_round"),
            "pending_round",
            ["pending_round_id"],
            ["id"],
        )


def downgrade() -> None:
    with op.batch_alter_table("subagent_execution") as batch:
        batch.drop_constraint(op.f("fk_subagent_execution_pending_round_id_pending_round"), type_="foreignkey")
        for col in ("pending_round_id", "lease_expires_at", "lease_owner", "epoch"):
            batch.drop_column(col)
    with op.batch_alter_table("agent_session") as batch:
        for col in ("lease_expires_at", "lease_owner", "epoch"):
            batch.drop_column(col)
    op.drop_index("uq_pending_round_open", table_name="pending_round")
    op.drop_table("pending_round")
