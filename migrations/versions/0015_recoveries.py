"""Ours: how often recovery took an execution back.

- ``subagent_execution.recoveries``: incremented by the scan's reservation of a dead execution
  (a lapsed lease, a restarted owner, an overdue one); an unclaimed reservation re-sent keeps
  it, like its epoch. The epoch alone cannot say it: an approval's hand-back and a suppression
  move the epoch too. The console shows it ("recovered ×N") and filters on it.

A new column with a constant default: no rewrite of the table (PostgreSQL 11+). Rows recovered
before this migration count from it on (no backfill: a full-table UPDATE is what a large table's
upgrade must not do).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "subagent_execution", sa.Column("recoveries", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )


def downgrade() -> None:
    op.drop_column("subagent_execution", "recoveries")
