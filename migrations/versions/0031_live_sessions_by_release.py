"""Ours: an index for the live sessions of each release (docs/releases.md, docs/operations.md).

- ``ix_agent_session_release_live``: ``agent_session (release_id)`` over the sessions pinned to
  a release and not stopped (no phase yet, or not COMPLETED/FAILED/CANCELLED): the metric
  ``agent_recovery_sessions_by_release`` counts them at every scrape without reading the
  stopped ones, which are most of the table.

An index only, built without blocking writers: no rewrite, no backfill.

Revision ID: 0031
Revises: 0029
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

LIVE = "release_id IS NOT NULL AND (phase IS NULL OR phase NOT IN ('COMPLETED', 'FAILED', 'CANCELLED'))"


def upgrade() -> None:
    """PostgreSQL: built CONCURRENTLY, outside the migration's transaction, as 0010 does: a plain
    build holds a lock that blocks every writer of ``agent_session`` for the whole build. A build
    that fails (or is interrupted) leaves an INVALID index: drop it (``DROP INDEX CONCURRENTLY
    ix_agent_session_release_live``) and run the upgrade again."""
    if op.get_bind().dialect.name != "postgresql":
        op.create_index("ix_agent_session_release_live", "agent_session", ["release_id"], sqlite_where=sa.text(LIVE))
        return
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_agent_session_release_live",
            "agent_session",
            ["release_id"],
            postgresql_where=sa.text(LIVE),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_agent_session_release_live", table_name="agent_session")
