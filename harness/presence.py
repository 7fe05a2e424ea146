"""LOCAL client presence (docs/invariants.md, I5): a gateway marks a user's desktop client connected.

Stored in Redis under ``local_client:<user_id>``; `agent-recovery local-client connect USER_ID`
sets it for operators and tests. A LOCAL child waits for it within its absolute deadline.
"""

from __future__ import annotations

import time
from datetime import datetime

from harness.errors import DeadlineExceeded
from harness.events import _redis
from models.base import utcnow

KEY = "local_client:{user_id}"
POLL_SECONDS = 0.2
LOCAL_NEVER_CONNECTED = "LOCAL client did not connect before the recovery deadline"


def connect(user_id: str, ttl_seconds: int | None = None) -> None:
    _redis().set(KEY.format(user_id=user_id), "1", ex=ttl_seconds)


def disconnect(user_id: str) -> None:
    _redis().delete(KEY.format(user_id=user_id))


def is_connected(user_id: str) -> bool:
    return bool(_redis().exists(KEY.format(user_id=user_id)))


def wait_for_client(user_id: str, deadline: datetime, cancelled: object = None) -> None:
    """Return once the client is connected; DeadlineExceeded when the deadline comes first.
    The waiting consumes the same absolute deadline as the run (I5)."""
    check = cancelled if callable(cancelled) else (lambda: False)
    while not is_connected(user_id):
        if utcnow() >= deadline:
            raise DeadlineExceeded(LOCAL_NEVER_CONNECTED)
        if check():
            return
        time.sleep(POLL_SECONDS)
