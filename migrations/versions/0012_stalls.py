"""Ours: what the scan passed over, and the parents' re-send back-off.

- ``recovery_scan.skipped``: rows the last pass passed over because another path held their
  lock (the scan never waits on a row): exposed as a metric.
- ``subagent_execution.quarantined_at``: set once by the scan on a row whose status the code
  does not know (corrupt or from a future version), so that its parent's delivery is not asked
  for (and fails) on every pass.
- ``agent_session.resends``: how many times the scan re-sent an unclaimed reservation of a
  parent run; each re-send's reservation lasts twice as long as the last one (as
  ``subagent_execution.resends``), so a long queue is not flooded.

All are new columns, NULL or with a constant default: no rewrite of the table (PostgreSQL 11+).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("recovery_scan", sa.Column("skipped", sa.Integer(), nullable=True))
    op.add_column("agent_session", sa.Column("resends", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.add_column("subagent_execution", sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("subagent_execution", "quarantined_at")
    op.drop_column("agent_session", "resends")
    op.drop_column("recovery_scan", "skipped")
