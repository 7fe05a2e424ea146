"""The upgrade: delivery columns, backfill, recovery indexes.

Backfill order (docs/tables.md, "Migrations"): add delivery_status nullable -> RUNNING rows PENDING ->
terminal rows LEGACY -> assert no NULL -> NOT NULL DEFAULT 'PENDING'. Never derived from
parent_result_delivered_at.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
T = "subagent_execution"


def upgrade() -> None:
    # 1. nullable column
    with op.batch_alter_table(T) as batch:
        batch.add_column(sa.Column("delivery_status", sa.String(20), nullable=True))
    # 2. RUNNING -> PENDING (they enter compatible recovery)
    op.execute(f"UPDATE {T} SET delivery_status = 'PENDING' WHERE status = 'RUNNING'")
    # 3. terminal -> LEGACY (ended before the upgrade: never injected, never scanned)
    op.execute(f"UPDATE {T} SET delivery_status = 'LEGACY' WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED')")
    # 4. no NULL may remain
    left = op.get_bind().execute(sa.text(f"SELECT count(*) FROM {T} WHERE delivery_status IS NULL")).scalar()
    if left:
        raise RuntimeError(f"0002: {left} subagent_execution rows have a status outside the known set")
    # 5. NOT NULL DEFAULT 'PENDING'; the other columns; constraints and indexes
    with op.batch_alter_table(T) as batch:
        batch.alter_column(
            "delivery_status",
            existing_type=sa.String(20),
            nullable=False,
            server_default=sa.text("'PENDING'"),
        )
        batch.add_column(sa.Column("invocation_type", sa.String(20), nullable=True))
        batch.add_column(sa.Column("parent_tool_call_id", sa.String(128), nullable=True))
        batch.add_column(sa.Column("parent_result_delivered_at", TS, nullable=True))
        batch.add_column(sa.Column("parent_assistant_message_id", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("parent_tool_message_id", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("execution_start_message_id", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("final_message_id", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("total_tool_calls", sa.Integer, nullable=False, server_default=sa.text("0")))
        batch.drop_constraint(op.f("ck_subagent_execution_status"), type_="check")
        batch.create_check_constraint(
            op.f("ck_subagent_execution_status"),
            "status IN ('RUNNING', 'RECOVERING', 'COMPLETED', 'FAILED', 'CANCELLED')",
        )
        batch.create_check_constraint(
            op.f("ck_subagent_execution_delivery_status"),
            "delivery_status IN ('PENDING', 'DELIVERED', 'SUPPRESSED', 'LEGACY')",
        )
        batch.create_check_constraint(
            op.f("ck_subagent_execution_invocation_type"),
            "invocation_type IS NULL OR invocation_type IN ('DELEGATE', 'FOLLOWUP')",
        )
        batch.create_check_constraint(
            op.f("ck_subagent_execution_delivered_is_terminal"),
            "delivery_status <> 'DELIVERED' OR (status IN ('COMPLETED', 'FAILED', 'CANCELLED') "
            "AND parent_result_delivered_at IS NOT NULL)",
        )
        batch.create_unique_constraint(op.f("uq_sae_parent_tool_call"), ["parent_session_id", "parent_tool_call_id"])
    op.create_index("idx_sae_recovery", T, ["status", "delivery_status"])
    # The scan costs O(pending), not O(history): partial on PostgreSQL (and SQLite).
    op.create_index(
        "idx_sae_pending",
        T,
        ["parent_session_id"],
        postgresql_where=sa.text("delivery_status = 'PENDING'"),
        sqlite_where=sa.text("delivery_status = 'PENDING'"),
    )


def downgrade() -> None:
    op.drop_index("idx_sae_pending", table_name=T)
    op.drop_index("idx_sae_recovery", table_name=T)
    with op.batch_alter_table(T) as batch:
        batch.drop_constraint(op.f("uq_sae_parent_tool_call"), type_="unique")
        batch.drop_constraint(op.f("ck_subagent_execution_delivered_is_terminal"), type_="check")
        batch.drop_constraint(op.f("ck_subagent_execution_invocation_type"), type_="check")
        batch.drop_constraint(op.f("ck_subagent_execution_delivery_status"), type_="check")
        batch.drop_constraint(op.f("ck_subagent_execution_status"), type_="check")
        for col in (
            "total_tool_calls",
            "final_message_id",
            "execution_start_message_id",
            "parent_tool_message_id",
            "parent_assistant_message_id",
            "parent_result_delivered_at",
            "parent_tool_call_id",
            "invocation_type",
            "delivery_status",
        ):
            batch.drop_column(col)
        batch.create_check_constraint(
            op.f("ck_subagent_execution_status"), "status IN ('RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED')"
        )
