"""Cancelling a session: a phase change any process can request (spec §7.7)."""

from __future__ import annotations

from harness.events import publish_status
from models import Phase, transaction
from models.approval import cancel_for_tree
from models.session import request_cancel
from recovery.delivery import suppress_parent


def cancel_session(session_id: int) -> tuple[bool, list[int]]:
    """Phase -> CANCELLED (unless already stopped) and, in the same transaction, its PENDING
    executions SUPPRESSED with their children cancelled, and their pending approval requests
    CANCELLED. Running loops notice and stop."""
    with transaction() as s:
        changed = request_cancel(s, session_id)
        suppressed = suppress_parent(s, session_id) if changed else []
        if changed:
            cancel_for_tree(s, session_id)  # its and its children's pending approvals
    if changed:
        publish_status(session_id, Phase.CANCELLED)
    return changed, suppressed
