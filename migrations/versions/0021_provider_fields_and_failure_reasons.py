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

New nullable columns: no rewrite of the tables, no backfill (sessions that ended before this
migration have no reason).

Revision ID: 0021
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("message", "round_journal", "pending_round"):
        op.add_column(table, sa.Column("provider_fields", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("message", sa.Column("incomplete", sa.String(32), nullable=True))
    op.add_column("agent_session", sa.Column("failure_code", sa.String(32), nullable=True))
    op.add_column("agent_session", sa.Column("failure_message", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("agent_session", "failure_message")
    op.drop_column("agent_session", "failure_code")
    op.drop_column("message", "incomplete")
    for table in ("pending_round", "round_journal", "message"):
        op.drop_column(table, "provider_fields")
