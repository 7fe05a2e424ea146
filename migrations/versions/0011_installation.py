"""Ours: the installation's id (a random id drawn once), the namespace of tool calls'
idempotency keys.

Tool calls get local ids when their reply is journaled (unique in the installation); a key is
derived from the installation id and the local id, so a rebuilt database or a second
environment never reuses one. Rows written before this revision keep the provider's ids and
their keys (``sha256("<session id>:<tool call id>")``): a recovered legacy call is re-run with
the key it had.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "installation",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("installation_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_installation_one_row"),
    )
    op.bulk_insert(table, [{"id": 1, "installation_id": uuid.uuid4().hex, "created_at": datetime.now(UTC)}])


def downgrade() -> None:
    op.drop_table("installation")
