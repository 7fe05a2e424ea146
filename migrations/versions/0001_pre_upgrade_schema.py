"""The schema as it was before the upgrade (no delivery columns on subagent_execution).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "agent_session",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("user_id", sa.String(128), nullable=False),
        sa.Column("session_type", sa.String(20), nullable=False),
        sa.Column("parent_session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=True),
        sa.Column("agent_type", sa.String(64), nullable=False),
        sa.Column("execution_mode", sa.String(20), nullable=False, server_default=sa.text("'CLOUD'")),
        sa.Column("phase", sa.String(20), nullable=True),
        sa.Column("compaction_boundary_message_id", sa.BigInteger, nullable=True),
        sa.Column("compaction_summary", sa.Text, nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.CheckConstraint(
            "session_type IN ('NORMAL', 'SIDE_TASK', 'SUBAGENT')", name=op.f("ck_agent_session_session_type")
        ),
        sa.CheckConstraint("execution_mode IN ('CLOUD', 'LOCAL')", name=op.f("ck_agent_session_execution_mode")),
        sa.CheckConstraint(
            "phase IS NULL OR phase IN ('IDLE', 'RUNNING', 'RESUMING', 'WAITING_USER', 'COMPLETED', "
            "'FAILED', 'CANCELLED')",
            name=op.f("ck_agent_session_phase"),
        ),
    )
    op.create_index("ix_agent_session_parent", "agent_session", ["parent_session_id"])
    op.create_index("ix_agent_session_phase", "agent_session", ["phase"])

    op.create_table(
        "message",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("tool_calls", sa.Text, nullable=True),
        sa.Column("tool_call_id", sa.String(128), nullable=True),
        sa.Column("source_session_id", sa.BigInteger, nullable=True),
        sa.Column("deleted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("role IN ('SYSTEM', 'USER', 'ASSISTANT', 'TOOL')", name=op.f("ck_message_role")),
    )
    op.create_index("ix_message_session_id_id", "message", ["session_id", "id"])

    op.create_table(
        "subagent_execution",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("parent_session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("child_session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("agent_type", sa.String(64), nullable=False),
        sa.Column("task_description", sa.Text, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("rounds", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("total_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("completed_at", TS, nullable=True),
        sa.CheckConstraint(
            "status IN ('RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED')",
            name=op.f("ck_subagent_execution_status"),
        ),
    )
    op.create_index("ix_sae_child_session", "subagent_execution", ["child_session_id"])


def downgrade() -> None:
    op.drop_table("subagent_execution")
    op.drop_table("message")
    op.drop_table("agent_session")
