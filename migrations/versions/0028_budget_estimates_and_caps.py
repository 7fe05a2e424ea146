"""Ours: usage and budgets down the agent tree, continued (docs/usage.md).

- ``agent_session.held_tokens``: the reservation of the session's model call in flight (0: none).
  A take of the session (or of its child execution) that finds it above 0 knows the call died
  before its reply was stored, and charges it as ``estimated``.
- ``tree_budget.estimated_tokens``: reservations of calls whose reply was never stored.
- ``model_call_usage.estimated_tokens``: an estimated call's row (its provider's figures are
  unknown: prompt and completion 0).
- Budgets in USD and in model calls beside tokens: ``tree_budget.budget_usd``, ``spent_usd``,
  ``reserved_usd``, ``estimated_usd``, ``budget_model_calls``, ``model_calls``;
  ``budget_tokens`` becomes nullable (a tree may have a USD or calls budget only);
  ``agent_session.held_usd`` beside ``held_tokens``.
- ``operator_action.amount``: what an action asked for (``budget_raise``: the tokens).
- A cap per child (``child_budget``): ``agent_session.cap_tokens`` (the allocation set aside for
  the child's run in the tree's reserved tokens; NULL: not capped) and ``cap_used_tokens``.

New columns with constant defaults: no rewrite, no backfill.

Revision ID: 0028
Revises: 0025
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

#: USD amounts: a call costs fractions of a cent.
USD = sa.Numeric(20, 9)


def upgrade() -> None:
    op.add_column(
        "agent_session", sa.Column("held_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column(
        "tree_budget", sa.Column("estimated_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column(
        "model_call_usage", sa.Column("estimated_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column("agent_session", sa.Column("held_usd", USD, server_default=sa.text("0"), nullable=False))
    with op.batch_alter_table("tree_budget") as batch:  # SQLite (the embedded default) rebuilds the table
        batch.alter_column("budget_tokens", existing_type=sa.BigInteger(), nullable=True)
    op.add_column("tree_budget", sa.Column("budget_usd", USD, nullable=True))
    for name in ("spent_usd", "reserved_usd", "estimated_usd"):
        op.add_column("tree_budget", sa.Column(name, USD, server_default=sa.text("0"), nullable=False))
    op.add_column("tree_budget", sa.Column("budget_model_calls", sa.BigInteger(), nullable=True))
    op.add_column("operator_action", sa.Column("amount", sa.BigInteger(), nullable=True))
    op.add_column("agent_session", sa.Column("cap_tokens", sa.BigInteger(), nullable=True))
    op.add_column(
        "agent_session", sa.Column("cap_used_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column("tree_budget", sa.Column("model_calls", sa.BigInteger(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    for name in ("model_calls", "budget_model_calls", "estimated_usd", "reserved_usd", "spent_usd", "budget_usd"):
        op.drop_column("tree_budget", name)
    op.execute("UPDATE tree_budget SET budget_tokens = 0 WHERE budget_tokens IS NULL")
    with op.batch_alter_table("tree_budget") as batch:
        batch.alter_column("budget_tokens", existing_type=sa.BigInteger(), nullable=False)
    op.drop_column("agent_session", "held_usd")
    op.drop_column("agent_session", "cap_used_tokens")
    op.drop_column("agent_session", "cap_tokens")
    op.drop_column("operator_action", "amount")
    op.drop_column("model_call_usage", "estimated_tokens")
    op.drop_column("tree_budget", "estimated_tokens")
    op.drop_column("agent_session", "held_tokens")
