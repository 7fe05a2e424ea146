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
    #: The installation id when ``tool_call_id`` is a local call id (harness.callids); None for
    #: a call journaled before local ids existed (its id is the provider's).
    namespace: str | None = None

    def seconds_left(self) -> float | None:
        """Seconds to the deadline (negative once passed); None when the loop has none."""
        if self.deadline is None:
            return None
        return (self.deadline - utcnow()).total_seconds()

    @property
    def idempotency_key(self) -> str:
        """The same for this tool call across every recovery, and different for every other
        call: the sha256 hex of ``"<installation id>:<local call id>"``. The local call id is
        ours (given when the model's reply is journaled, unique in the installation, read back
        by a recovery); the installation id is drawn once per database, so a rebuilt database
        or a second environment never reuses a key. A tool may hand this key to the service it
        calls and let that service deduplicate a re-run of THIS call.

        It is per call: a model that asks again (after an "interrupted" result, or because it
        wants to) makes a new call with a new key. A side effect that must happen once per
        business fact (a charge per order) also needs a business key the service deduplicates.

        A call journaled before local ids existed (``namespace`` None) keeps the key it had:
        the sha256 hex of ``"<session id>:<tool call id>"``."""
        if self.namespace is not None:
            return hashlib.sha256(f"{self.namespace}:{self.tool_call_id}".encode()).hexdigest()
        return hashlib.sha256(f"{self.session_id}:{self.tool_call_id}".encode()).hexdigest()
