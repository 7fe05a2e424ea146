"""Ours: a tree whose budget ran out asks for more (``on_budget_exhausted = "ask"``,
docs/usage.md): its request is an ``approval_request`` asked before any round, so
``approval_request.journal_id`` becomes nullable (NULL: a budget request).

Relaxes a NOT NULL: no rewrite on PostgreSQL, no backfill (SQLite rebuilds the table).

Revision ID: 0030
Revises: 0029
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("approval_request") as batch:
        batch.alter_column("journal_id", existing_type=sa.BigInteger(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM approval_request WHERE journal_id IS NULL")
    with op.batch_alter_table("approval_request") as batch:
        batch.alter_column("journal_id", existing_type=sa.BigInteger(), nullable=False)
