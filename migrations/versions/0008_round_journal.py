"""Ours: the round journal (docs/tables.md, round_journal).

``round_journal`` holds the model's reply of a round in flight (content, tool calls, tokens,
the epoch that owns it, the history position it was asked from), one OPEN entry per session
at most (partial unique index). ``round_journal_call`` holds each tool call's start (for the
tools that are not safe to repeat) and result. The transaction that lands the round in the
history closes the entry.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "round_journal",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger, sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("after_message_id", sa.BigInteger, nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("tool_calls", sa.JSON, nullable=False),
        sa.Column("refused", sa.JSON, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("replays", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("closed_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('OPEN', 'CLOSED', 'ABANDONED')", name="ck_round_journal_status"),
        sa.CheckConstraint("(status = 'OPEN') = (closed_at IS NULL)", name="ck_round_journal_open_has_no_close"),
    )
    op.create_index(
        "uq_round_journal_open",
        "round_journal",
        ["session_id"],
        unique=True,
        postgresql_where=sa.text("closed_at IS NULL"),
        sqlite_where=sa.text("closed_at IS NULL"),
    )
    op.create_table(
        "round_journal_call",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("journal_id", sa.BigInteger, sa.ForeignKey("round_journal.id"), nullable=False),
        sa.Column("tool_call_id", sa.String(128), nullable=False),
        sa.Column("tool_name", sa.String(128), nullable=False),
        sa.Column("repeatable", sa.Boolean, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("starts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('STARTED', 'FINISHED')", name="ck_round_journal_call_status"),
        sa.UniqueConstraint("journal_id", "tool_call_id", name="uq_round_journal_call"),
    )


def downgrade() -> None:
    op.drop_table("round_journal_call")
    op.drop_index("uq_round_journal_open", table_name="round_journal")
    op.drop_table("round_journal")
