"""Ours: the operators' audit trail, and approval requests found by their journal entry.

- ``operator_action``: one row per decision asked for (who, what, on what, the outcome,
  when), the one trace of a decision that repeated or lost to the one that stands.
- ``ix_approval_request_journal (journal_id)``: every gated round reads its requests by
  journal entry (``models.approval.requests_of``); without it each read scans the table.
  Built CONCURRENTLY would need a migration outside a transaction; the table holds pending
  and recently decided requests only (decided ones are purged after APPROVAL_RETENTION_DAYS).

Revision ID: 0020
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "operator_action",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("session_id", sa.BigInteger(), nullable=True),
        sa.Column("execution_id", sa.BigInteger(), nullable=True),
        sa.Column("call_id", sa.String(128), nullable=True),
        sa.Column("request_id", sa.BigInteger(), nullable=True),
        sa.Column("outcome", sa.String(32), nullable=False),
    )
    op.create_index("ix_operator_action_target", "operator_action", ["session_id", "call_id", "at"])
    op.create_index("ix_approval_request_journal", "approval_request", ["journal_id"])


def downgrade() -> None:
    op.drop_index("ix_approval_request_journal", table_name="approval_request")
    op.drop_index("ix_operator_action_target", table_name="operator_action")
    op.drop_table("operator_action")
