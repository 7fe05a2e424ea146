"""Ours: how many times the scan re-sent an unclaimed reservation.

``subagent_execution.resends`` counts the passes that found the execution still reserved and
unclaimed after its reservation lapsed, and sent its recovery again with the same epoch. Each
re-send doubles the reservation (2 leases, 4, 8 ... up to 64), so a backlog longer than the
workers can drain in two leases is not multiplied by duplicates every pass. It is reset when a
reservation is written for a row an owner held. Additive, with a default: old rows read 0.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("subagent_execution") as batch:
        batch.add_column(sa.Column("resends", sa.Integer, nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    with op.batch_alter_table("subagent_execution") as batch:
        batch.drop_column("resends")
