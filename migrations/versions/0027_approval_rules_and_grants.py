"""Ours: approving without a person for the obvious (docs/approvals.md).

- ``round_journal.approval_rules``: what each tool's ``requires_approval`` callable decided for
  the calls of the round (call id -> true/false), written in the reply's transaction; a
  continued round reads it instead of asking the callable again.
- ``approval_grant``: "this tool for the rest of this session", one row per session and tool.
- ``approval_request.grant_id``: the grant that approved the request when it was written.
- ``approval_request.notified_at``: when the webhook (APPROVAL_WEBHOOK_URL) took the request's
  notification.

A new table and new nullable columns: no rewrite, no backfill.

Revision ID: 0027
Revises: 0025
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "approval_grant",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.BigInteger(), sa.ForeignKey("agent_session.id"), nullable=False),
        sa.Column("tool", sa.String(128), nullable=False),
        sa.Column("granted_by", sa.String(128), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_id", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("session_id", "tool", name="uq_approval_grant_session_tool"),
    )
    with op.batch_alter_table("round_journal") as batch:
        batch.add_column(sa.Column("approval_rules", sa.JSON(), nullable=True))
    with op.batch_alter_table("approval_request") as batch:
        batch.add_column(sa.Column("grant_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_foreign_key("fk_approval_request_grant_id_approval_grant", "approval_grant", ["grant_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("approval_request") as batch:
        batch.drop_constraint("fk_approval_request_grant_id_approval_grant", type_="foreignkey")
        batch.drop_column("notified_at")
        batch.drop_column("grant_id")
    with op.batch_alter_table("round_journal") as batch:
        batch.drop_column("approval_rules")
    op.drop_table("approval_grant")
