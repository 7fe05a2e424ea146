"""The one seam between the console and human approvals of tool calls.

Every view and action of the console that concerns approvals goes through these functions.
Until approvals are installed they say so: no pending request, no session waiting for one, and
a decision is refused with :class:`ApprovalsNotInstalled` (HTTP 501).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import false
from sqlalchemy.orm import Session


class ApprovalsNotInstalled(RuntimeError):
    """Raised when a decision is asked for and approvals are not installed."""

    def __init__(self, message: str = "approvals are not installed") -> None:
        super().__init__(message)


def installed() -> bool:
    """True once approval requests exist in this deployment's schema."""
    return False


def pending(s: Session, *, limit: int = 100) -> list[dict[str, Any]]:
    """Open approval requests, oldest first: id, session_id, tool name, created_at, expires_at."""
    return []


def waiting_clause() -> Any:
    """SQL over ``agent_session``: the session waits for an approval."""
    return false()


def decide(request_id: int, *, approve: bool, reason: str, actor: str) -> str:
    """Approve or deny one request through the approvals' domain function (a compare-and-set on
    the request); returns its outcome's value. A decision that lost its compare-and-set is an
    outcome, not an error."""
    raise ApprovalsNotInstalled()
