"""Ours: the scan's reservation, a take, a heartbeat and a child's end update an execution in
place (HOT), writing no index (docs/tables.md, subagent_execution).

PostgreSQL updates a row in place, without a new entry in every index of the table, only when
no column that an index names (as a key, an INCLUDE column or in its WHERE) changed and the
row's page has room. ``idx_sae_recovery (status, delivery_status)`` named ``status``, which
every state change of an execution writes: the scan's reservation of 5,000 executions wrote
5 index entries per row (EXPLAIN ANALYZE: 178 ms a batch; 42 ms in place).

- ``idx_sae_recovery`` goes. What it served is served by ``idx_sae_pending`` (every statement
  of the scan and the live metrics: O(pending)), except the live count of executions settled
  while still active, now ``ix_sae_settled_unfinished`` (``WHERE delivery_status <> 'PENDING'
  AND completed_at IS NULL``: no status in it; a child's end writes ``completed_at`` and
  delivery writes ``delivery_status``, both already writing the indexes), and the count of
  settled executions that the metrics recount now and then (O(history) before as well: a
  sequential scan instead of an index-only one).
- ``fillfactor = 70`` on ``subagent_execution``: new pages keep 30 % free for the in-place
  versions (a full page cannot take one). Pages written before the upgrade keep what they have
  until a ``VACUUM FULL`` (not run here: it locks the table).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

T = "subagent_execution"
#: Free room per page for in-place (HOT) row versions.
FILLFACTOR = 70


def upgrade() -> None:
    """PostgreSQL: the new index is built CONCURRENTLY and the old one dropped CONCURRENTLY
    after it, outside the migration's transaction: a plain build holds a lock that blocks every
    writer for the whole build, and the drop's ACCESS EXCLUSIVE lock, held to the end of the
    migration's transaction, blocked readers too (minutes on a large table). A build that fails
    (or is interrupted) leaves an INVALID index: drop it (``DROP INDEX CONCURRENTLY
    ix_sae_settled_unfinished``) and run the upgrade again."""
    unfinished = sa.text("delivery_status <> 'PENDING' AND completed_at IS NULL")
    if op.get_bind().dialect.name != "postgresql":
        op.drop_index("idx_sae_recovery", table_name=T)
        op.create_index("ix_sae_settled_unfinished", T, ["id"], sqlite_where=unfinished)
        return
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_sae_settled_unfinished", T, ["id"], postgresql_where=unfinished, postgresql_concurrently=True
        )
        op.drop_index("idx_sae_recovery", table_name=T, postgresql_concurrently=True)
    # SHARE UPDATE EXCLUSIVE: readers and writers go on.
    op.execute(f"ALTER TABLE {T} SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {T} RESET (fillfactor)")
    op.drop_index("ix_sae_settled_unfinished", table_name=T)
    op.create_index("idx_sae_recovery", T, ["status", "delivery_status"])
