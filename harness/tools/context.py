"""What a running tool may know about its call: ``ToolContext``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from models.base import utcnow


@dataclass
class ToolContext:
    """The call a tool runs for. A tool receives it when its first parameter is annotated
    ``ToolContext``; it is never part of the tool's JSON schema."""

    session_id: int
    tool_call_id: str
    #: Absolute deadline (UTC) of the loop running the tool, or None.
    deadline: datetime | None
    #: True when the session was cancelled or this worker lost its lease.
    cancelled: Callable[[], bool] = field(default=lambda: False)
    #: Child loops mark tool steps with crash points under this prefix ("child" / "parent").
    kind: str = "parent"

    def seconds_left(self) -> float | None:
        """Seconds to the deadline (negative once passed); None when the loop has none."""
        if self.deadline is None:
            return None
        return (self.deadline - utcnow()).total_seconds()

    @property
    def idempotency_key(self) -> str:
        """The same for this tool call across every recovery: the sha256 hex of
        ``"<session id>:<tool call id>"``. A recovery keeps the session (a child resumes in its
        original child session) and the tool call id (it comes from the journaled model reply),
        so a tool may hand this key to the service it calls and let that service deduplicate.
        Two different calls never share a key (call ids are unique within a session)."""
        return hashlib.sha256(f"{self.session_id}:{self.tool_call_id}".encode()).hexdigest()
