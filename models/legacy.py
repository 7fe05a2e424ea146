"""Pre-upgrade rows (docs/glossary.md, "Legacy row"): infer what the upgrade did not record, stably.

For a row without ``invocation_type``: the earliest execution of its child session is
DELEGATE, later ones FOLLOWUP. Its tool_call id is ``recovered_subagent_execution_<id>``. The
inferred values are written back in the first recovery transaction, so every later restart
sees the same values.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models import InvocationType, SubagentExecution
from models.execution import store_inferred

SYNTHETIC_PREFIX = "recovered_subagent_execution_"


def synthetic_tool_call_id(execution_id: int) -> str:
    return f"{SYNTHETIC_PREFIX}{execution_id}"


def infer_and_store(s: Session, execution_id: int) -> tuple[InvocationType, str]:
    """The execution's (invocation type, parent tool_call id), inferring and writing back the
    missing ones (only where still NULL, so a concurrent writer cannot be overwritten)."""
    E = SubagentExecution
    row = s.execute(
        select(E.invocation_type, E.parent_tool_call_id, E.child_session_id).where(E.id == execution_id)
    ).one()
    invocation, call_id = row.invocation_type, row.parent_tool_call_id
    inferred_invocation = inferred_call = None
    if invocation is None:
        first = s.execute(select(func.min(E.id)).where(E.child_session_id == row.child_session_id)).scalar_one()
        invocation = inferred_invocation = InvocationType.DELEGATE if first == execution_id else InvocationType.FOLLOWUP
    if call_id is None:
        call_id = inferred_call = synthetic_tool_call_id(execution_id)
    store_inferred(s, execution_id, invocation=inferred_invocation, tool_call_id=inferred_call)
    return InvocationType(invocation), call_id
