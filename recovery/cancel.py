"""Cancelling a session: a phase change any process can request (R15, R21)."""

from __future__ import annotations

from harness.events import publish_status
from models import Phase, transaction
from models.session import request_cancel
from recovery.delivery import suppress_parent


def cancel_session(session_id: int) -> tuple[bool, list[int]]:
    """Phase -> CANCELLED (unless already stopped) and, in the same transaction, its PENDING
    executions SUPPRESSED with their children cancelled. Running loops notice and stop."""
    with transaction() as s:
        changed = request_cancel(s, session_id)
        suppressed = suppress_parent(s, session_id) if changed else []
    if changed:
        publish_status(session_id, Phase.CANCELLED)
    return changed, suppressed
