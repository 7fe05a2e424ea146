"""Ours: agent releases (docs/releases.md).

- ``agent_release``: the whole agent configuration in force (every agent's definition, every
  tool's schema and flags, MCP server entries without secrets), stored once under the sha256 of
  its canonical JSON.
- ``agent_session.release_id``: the release a session runs on, set by its first run (a child
  takes its parent's); NULL until then, so a session older than this migration takes the
  release of the worker that runs it next.

A new table and a new nullable column: no rewrite, no backfill.

Revision ID: 0025
Revises: 0024
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_release",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("definition", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("content_hash", name="uq_agent_release_content_hash"),
    )
    with op.batch_alter_table("agent_session") as batch:
        batch.add_column(sa.Column("release_id", sa.BigInteger(), nullable=True))
        batch.create_foreign_key("fk_agent_session_release_id_agent_release", "agent_release", ["release_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("agent_session") as batch:
        batch.drop_constraint("fk_agent_session_release_id_agent_release", type_="foreignkey")
        batch.drop_column("release_id")
    op.drop_table("agent_release")
