"""Ours: the fenced start of a delegating round's inline tools.

``pending_round.inline_started`` lists the tool_call ids of the round's inline (non-delegation)
calls whose start was committed under the parent's fence, just before each ran. Delivery tells
the model the truth about a call without a result: started (it may or may not have taken
effect) or never started (it did not run). Rows written before this migration, or by a worker
that does not write the column, read NULL: every call of theirs without a result is in doubt.
Additive, no default: no rewrite of the table and no backfill.

Revision ID: 0017
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pending_round") as batch:
        batch.add_column(sa.Column("inline_started", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pending_round") as batch:
        batch.drop_column("inline_started")
