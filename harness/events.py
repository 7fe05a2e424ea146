"""session_status events on Redis pub/sub and the external phase view (docs/state-machines.md, "Session phase").

RESUMING means "recovery owns this session" inside; everywhere a client can see a phase it is
shown as RUNNING.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

from logfmt import log_event
from models import Phase
from settings import get_settings

log = logging.getLogger(__name__)

CHANNEL = "session_status"


def external_phase(phase: Phase | str | None) -> str | None:
    """The phase a client may see: RESUMING is shown as RUNNING."""
    if phase is None:
        return None
    value = str(phase)
    return Phase.RUNNING.value if value == Phase.RESUMING.value else value


@lru_cache(maxsize=1)
def _redis() -> Any:
    import redis

    return redis.Redis.from_url(get_settings().REDIS_URL, socket_connect_timeout=1, socket_timeout=1)


def publish_status(session_id: int, phase: Phase | str | None) -> None:
    """Best effort: an event lost here is repaired by the next snapshot a client reads."""
    url = get_settings().REDIS_URL
    if not url.startswith("redis"):
        return
    event = {"type": CHANNEL, "session_id": session_id, "phase": external_phase(phase)}
    try:
        _redis().publish(CHANNEL, json.dumps(event))
    except Exception:  # a missing event never stops the work
        log_event(log, "session_status_not_published", logging.DEBUG, exc_info=True, session_id=session_id)
