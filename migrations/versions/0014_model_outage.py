"""Ours: sessions waiting for the model through a provider outage.

``agent_session.model_outage_since`` is when the model became unreachable for the session's
run (an outage longer than the client's retry window). The run ended without a result and the
session's (or its execution's) lease was set to lapse after a back-off, so the scan resumes it
then; the first model answer clears it. A partial index counts the waiting sessions for
``agent-recovery status`` and the metric. Additive: old rows read NULL (not waiting).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agent_session") as batch:
        batch.add_column(sa.Column("model_outage_since", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_agent_session_model_outage",
        "agent_session",
        ["model_outage_since"],
        postgresql_where=sa.text("model_outage_since IS NOT NULL"),
        sqlite_where=sa.text("model_outage_since IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_agent_session_model_outage", table_name="agent_session")
    with op.batch_alter_table("agent_session") as batch:
        batch.drop_column("model_outage_since")
