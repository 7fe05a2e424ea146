"""Ours: moving sessions between releases, and waiting for a worker of one (docs/releases.md).

- ``agent_session.release_target_id``: the release an operator moved a top-level session (and
  its tree) to (``sessions upgrade``), taken at its next round boundary.
- ``agent_session.release_wait_since``: since when a session waits for a worker of its release
  (partial index ``ix_agent_session_release_wait``, for the metric).
- ``release_move``: one row per move of a session tree from one release to another (its
  history: by the policy ``latest`` or by an operator's upgrade).

New nullable columns and a new table: no rewrite, no backfill.

Revision ID: 0029
Revises: 0025
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agent_session") as batch:
        batch.add_column(sa.Column("release_target_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("release_wait_since", sa.DateTime(timezone=True), nullable=True))
        batch.create_foreign_key(
            "fk_agent_session_release_target_id_agent_release", "agent_release", ["release_target_id"], ["id"]
        )
    op.create_index(
        "ix_agent_session_release_wait",
        "agent_session",
        ["release_wait_since"],
        postgresql_where=sa.text("release_wait_since IS NOT NULL"),
        sqlite_where=sa.text("release_wait_since IS NOT NULL"),
    )
    op.create_table(
        "release_move",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("session_id", sa.BigInteger(), nullable=False),
        sa.Column("from_release_id", sa.BigInteger(), nullable=False),
        sa.Column("to_release_id", sa.BigInteger(), nullable=False),
        sa.Column("sessions", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
    )
    op.create_index("ix_release_move_session", "release_move", ["session_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_release_move_session", table_name="release_move")
    op.drop_table("release_move")
    op.drop_index("ix_agent_session_release_wait", table_name="agent_session")
    with op.batch_alter_table("agent_session") as batch:
        batch.drop_constraint("fk_agent_session_release_target_id_agent_release", type_="foreignkey")
        batch.drop_column("release_wait_since")
        batch.drop_column("release_target_id")
