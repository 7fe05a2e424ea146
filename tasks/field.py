"""Celery adapter for field recovery: `field.recover_eml` (DESIGN §8).

The deadline (max_wait) is computed inside the domain call; the hard time limit is only a
backstop just above it (it works on the prefork pool only, CELERY-NOTES).
"""

from __future__ import annotations

from typing import Any

from recovery.field.orchestrator import recover_eml
from recovery.field.schemas import SourceKind
from settings import get_settings
from tasks import app

#: Seconds above max_wait before the backstop limits fire (the run cancel and the DB writes).
SOFT_LIMIT_MARGIN_SECONDS = 15
HARD_LIMIT_MARGIN_SECONDS = 30

_MAX_WAIT = get_settings().booking_field_recovery.max_wait


@app.task(
    name="field.recover_eml",
    soft_time_limit=_MAX_WAIT + SOFT_LIMIT_MARGIN_SECONDS,
    time_limit=_MAX_WAIT + HARD_LIMIT_MARGIN_SECONDS,
)
def recover_eml_task(eml: str, source: str = "MANUAL_EML", attempt: int = 1) -> dict[str, Any]:
    """Recover one EML given as text; returns the `field recover --json` object."""
    return recover_eml(eml.encode("utf-8"), source=SourceKind(source), attempt=int(attempt)).to_json()
