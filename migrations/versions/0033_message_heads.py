"""Ours: an index for the console's timeline (docs/console.md, "Size").

- ``ix_message_session_heads``: ``message (session_id, id)`` over the live messages other than
  TOOL results: the timeline reads a session's newest 100 of them and counts the older ones
  without reading its TOOL results, which a round of 3,000 delegations makes most of the
  history.

An index only, built without blocking writers: no rewrite, no backfill.

Revision ID: 0033
Revises: 0031
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0031"
branch_labels = None
depends_on = None

HEADS = "role <> 'TOOL' AND deleted IS false"


def upgrade() -> None:
    """PostgreSQL: built CONCURRENTLY, outside the migration's transaction, as 0031 does: a plain
    build holds a lock that blocks every writer of ``message`` for the whole build. A build that
    fails (or is interrupted) leaves an INVALID index: drop it (``DROP INDEX CONCURRENTLY
    ix_message_session_heads``) and run the upgrade again."""
    if op.get_bind().dialect.name != "postgresql":
        op.create_index("ix_message_session_heads", "message", ["session_id", "id"], sqlite_where=sa.text(HEADS))
        return
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_message_session_heads",
            "message",
            ["session_id", "id"],
            postgresql_where=sa.text(HEADS),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_message_session_heads", table_name="message")
