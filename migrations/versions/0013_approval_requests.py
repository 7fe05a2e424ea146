"""Ours: approval requests (a human approves a tool call before it runs).

``approval_request`` holds one row per tool call that waits for a human decision: the session,
the call, the tool, the arguments and their SHA-256, the agent that asked, when, its expiry,
and the decision (status, who, when, why, edited arguments). One request per (session, call);
a partial index over the PENDING ones serves the pending list and the scan's backstop. The
session phase ``WAITING_APPROVAL`` joins the phase CHECK.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

PHASES = "'IDLE', 'RUNNING', 'RESUMING', 'WAITING_USER', 'COMPLETED', 'FAILED', 'CANCELLED'"
WITH_APPROVAL = "'IDLE', 'RUNNING', 'RESUMING', 'WAITING_USER', 'WAITING_APPROVAL', 'COMPLETED', 'FAILED', 'CANCELLED'"


def _phase_check(values: str) -> None:
    with op.batch_alter_table("agent_session") as batch:
        batch.drop_constraint(op.f("ck_agent_session_phase"), type_="check")
        batch.create_check_constraint(op.f("ck_agent_session_phase"), f"phase IS NULL OR phase IN ({values})")


def upgrade() -> None:
    _phase_check(WITH_APPROVAL)
    op.create_table(
        "approval_request",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("execution_id", sa.BigInteger, sa.ForeignKey("subagent_execution.id"), nullable=True),
        sa.Column("journal_id", sa.BigInteger, sa.ForeignKey("round_journal.id"), nullable=False),
        sa.Column("call_id", sa.String(128), nullable=False),
        sa.Column("tool", sa.String(128), nullable=False),
        sa.Column("agent_type", sa.String(64), nullable=False),
        sa.Column("arguments", sa.Text, nullable=False),
        sa.Column("arguments_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("requested_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("decided_at", TS, nullable=True),
        sa.Column("decided_by", sa.String(128), nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("approved_arguments", sa.Text, nullable=True),
        sa.CheckConstraint(
            "status IN ('PENDING', 'APPROVED', 'DENIED', 'EXPIRED', 'CANCELLED')", name="ck_approval_request_status"
        ),
        sa.CheckConstraint(
            "(status = 'PENDING') = (decided_at IS NULL)", name="ck_approval_request_pending_has_no_decision"
        ),
        sa.UniqueConstraint("session_id", "call_id", name="uq_approval_request_call"),
    )
    op.create_index(
        "ix_approval_request_pending",
        "approval_request",
        ["requested_at"],
        postgresql_where=sa.text("status = 'PENDING'"),
        sqlite_where=sa.text("status = 'PENDING'"),
    )


def downgrade() -> None:
    op.drop_index("ix_approval_request_pending", table_name="approval_request")
    op.drop_table("approval_request")
    op.execute("UPDATE agent_session SET phase = 'RUNNING' WHERE phase = 'WAITING_APPROVAL'")
    _phase_check(PHASES)
