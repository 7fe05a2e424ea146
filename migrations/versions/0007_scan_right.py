"""Ours: the right to scan is a row with an expiry in the database's clock.

``recovery_scan`` (one row, id = 1) gains ``holder`` and ``held_until``: a scan takes the right
with one conditional UPDATE when it is free or expired (``held_until < now()``), renews it per
batch, and gives it back at the end. A scanner that is frozen, paused or cut off loses it when
``held_until`` passes, whatever its connection does (a session advisory lock lived as long as
the connection). ``started_at`` and the counters become nullable so that the right's row can
exist before the first scan has finished.

``worker_boot`` gains ``conflict_generation`` and ``conflict_seen_at``: a
process that finds a NEWER generation booted under its own name while it still lives (two
processes with one ``-n`` or ``WORKER_ID``) records what it saw there, for ``agent-recovery
status`` and the metrics, and stops taking work.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("worker_boot") as batch:
        batch.add_column(sa.Column("conflict_generation", sa.Integer, nullable=True))
        batch.add_column(sa.Column("conflict_seen_at", TS, nullable=True))
    with op.batch_alter_table("recovery_scan") as batch:
        batch.add_column(sa.Column("holder", sa.String(128), nullable=True))
        batch.add_column(sa.Column("held_until", TS, nullable=True))
        for column in ("started_at",):
            batch.alter_column(column, existing_type=TS, nullable=True)
        for column in ("duration_ms", "parents", "executions"):
            batch.alter_column(column, existing_type=sa.Integer, nullable=True)
    # The right's row exists from now on (a pass before the first finished scan can take it).
    op.execute("INSERT INTO recovery_scan (id) SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM recovery_scan WHERE id = 1)")


def downgrade() -> None:
    op.execute("DELETE FROM recovery_scan WHERE started_at IS NULL")
    with op.batch_alter_table("recovery_scan") as batch:
        for column in ("duration_ms", "parents", "executions"):
            batch.alter_column(column, existing_type=sa.Integer, nullable=False)
        batch.alter_column("started_at", existing_type=TS, nullable=False)
        batch.drop_column("held_until")
        batch.drop_column("holder")
    with op.batch_alter_table("worker_boot") as batch:
        batch.drop_column("conflict_seen_at")
        batch.drop_column("conflict_generation")
