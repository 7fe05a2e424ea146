"""Ours: what a provider sent beside the answer, and why a session ended FAILED or CANCELLED.

- ``message.provider_fields``, ``round_journal.provider_fields``,
  ``pending_round.provider_fields``: the fields of the model's assistant message that the
  client does not read itself (``reasoning_content``, ``thinking_blocks``,
  ``reasoning_details``, a ``content`` given as a list of typed parts, ...), as the provider sent
  them; they are sent back with the message (docs/providers.md).
- ``message.incomplete``: an ASSISTANT answer the model did not finish, marked (``refusal``,
  ``content_filter``, ``truncated``, ``no_tool_calls``); NULL for a whole answer.
- ``agent_session.failure_code``, ``agent_session.failure_message``: why the session ended
  FAILED or CANCELLED (docs/providers.md, "Failure reasons"), written by the compare-and-set
  that moves it there.

- ``model_call_usage``: the provider's usage of every model call whose reply was stored (prompt,
  completion, cached and reasoning tokens, the model's name), inserted with the reply.

New nullable columns and a new table: no rewrite of the tables, no backfill (sessions that ended before this
migration have no reason).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("message", "round_journal", "pending_round"):
        op.add_column(table, sa.Column("provider_fields", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("message", sa.Column("incomplete", sa.String(32), nullable=True))
    op.add_column("agent_session", sa.Column("failure_code", sa.String(32), nullable=True))
    op.add_column("agent_session", sa.Column("failure_message", sa.String(300), nullable=True))
    op.create_table(
        "model_call_usage",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger(), sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("execution_id", sa.BigInteger(), nullable=True),
        sa.Column("model", sa.String(128), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("reasoning_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_model_call_usage_session", "model_call_usage", ["session_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_model_call_usage_session", table_name="model_call_usage")
    op.drop_table("model_call_usage")
    op.drop_column("agent_session", "failure_message")
    op.drop_column("agent_session", "failure_code")
    op.drop_column("message", "incomplete")
    for table in ("pending_round", "round_journal", "message"):
        op.drop_column(table, "provider_fields")
