"""Ours: a token budget per agent tree (docs/usage.md, "Budgets").

- ``tree_budget``: one row per budgeted tree, keyed by its root session: the budget, the tokens
  spent (settled to the provider's figures in each reply's transaction) and the tokens reserved
  by model calls in flight.
- ``agent_session.budget_root_id``: the root of the budgeted tree the session belongs to (its
  own id for a root), copied to each child at its creation; NULL when its tree has no budget.

A new table and a new nullable column: no rewrite, no backfill (trees started before have none).

Revision ID: 0024
Revises: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("agent_session", sa.Column("budget_root_id", sa.BigInteger(), nullable=True))
    op.create_table(
        "tree_budget",
        sa.Column("root_session_id", sa.BigInteger(), sa.ForeignKey("agent_session.id"), primary_key=True),
        sa.Column("budget_tokens", sa.BigInteger(), nullable=False),
        sa.Column("spent_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tree_budget")
    op.drop_column("agent_session", "budget_root_id")
