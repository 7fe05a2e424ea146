"""Telling people an approval request waits: the ``approval_requested`` signal and the webhook.

1. The transaction that writes a request commits (harness.approval: the reply's journal
   transaction, or a late request of a continued round); then ``approval_requested`` is sent
   in the loop's process, once per request that waits for a person (a request its session's
   grant approved at once is not announced). A handler that raises is logged by the signal
   and never reaches the loop: a lost notification never blocks the approval itself.
2. tasks.approval connects the webhook to it when APPROVAL_WEBHOOK_URL is set: a Celery task
   (``approval.notify``) POSTs ``payload`` signed with APPROVAL_WEBHOOK_SECRET and retries a
   failure with capped exponential back-off and jitter, a bounded number of times.
3. The task records the delivery on the request (``notified_at``);  crash point approval.after_notified

A worker killed between 1 and 2 loses that notification (the request waits as before, listed
by ``agent-recovery approvals``, the console and health); a POST that succeeded and whose
record was lost is sent again by its retry: a receiver deduplicates on ``id``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Sequence
from datetime import UTC
from typing import Any

from celery.utils.dispatch import Signal

from models.approval import Requested

log = logging.getLogger(__name__)

#: Sent after the transaction that wrote a request committed, with ``request`` (a
#: ``models.approval.Requested``: id, session, call, tool, agent, times; never the arguments).
approval_requested = Signal(name="approval_requested")

#: The header that carries ``sha256=HEX``: HMAC-SHA256 of the body under APPROVAL_WEBHOOK_SECRET.
SIGNATURE_HEADER = "X-Agent-Recovery-Signature"
EVENT = "approval.requested"


class NotificationFailed(Exception):
    """Raised when the webhook did not take a notification (no answer, or not a 2xx); retried."""


def payload(r: Requested) -> dict[str, Any]:
    """What the webhook receives: no argument of the call, ever."""
    return {
        "event": EVENT,
        "id": r.id,
        "session_id": r.session_id,
        "call_id": r.call_id,
        "tool": r.tool,
        "agent_type": r.agent_type,
        "requested_at": r.requested_at.astimezone(UTC).isoformat(),
        "expires_at": r.expires_at.astimezone(UTC).isoformat(),
    }


def body_of(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")


def signature(body: bytes, secret: str) -> str:
    """``sha256=`` and the hex HMAC-SHA256 of ``body`` under ``secret`` (what a receiver checks)."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def post(data: dict[str, Any], *, url: str, secret: str, timeout_seconds: float) -> None:
    """POST one notification. Raises NotificationFailed when the receiver did not take it."""
    import requests

    body = body_of(data)
    headers = {"Content-Type": "application/json", "User-Agent": "agent-recovery"}
    if secret:
        headers[SIGNATURE_HEADER] = signature(body, secret)
    try:
        answer = requests.post(url, data=body, headers=headers, timeout=timeout_seconds, allow_redirects=False)
    except requests.RequestException as exc:
        raise NotificationFailed(type(exc).__name__) from exc
    if not 200 <= answer.status_code < 300:
        raise NotificationFailed(f"HTTP {answer.status_code}")


def deliver(data: dict[str, Any]) -> bool:
    """POST ``data`` to APPROVAL_WEBHOOK_URL, then record it on the request (``notified_at``).
    False: no webhook is configured. Raises NotificationFailed (the task retries it)."""
    from crashpoints import crash_point
    from logfmt import log_event
    from models import transaction
    from models.approval import mark_notified
    from settings import get_settings

    settings = get_settings()
    if not settings.APPROVAL_WEBHOOK_URL:
        return False
    try:
        post(
            data,
            url=settings.APPROVAL_WEBHOOK_URL,
            secret=settings.APPROVAL_WEBHOOK_SECRET.get_secret_value(),
            timeout_seconds=settings.APPROVAL_WEBHOOK_TIMEOUT_SECONDS,
        )
    except NotificationFailed as exc:
        log_event(log, "approval_notify_failed", logging.WARNING, request_id=data.get("id"), error=str(exc))
        raise
    with transaction() as s:
        mark_notified(s, int(data["id"]))
    crash_point("approval.after_notified")
    log_event(log, "approval_notified", request_id=data.get("id"), session_id=data.get("session_id"))
    return True


def announce(written: Sequence[Requested]) -> None:
    """After the requests' transaction committed: the ``approval_requested`` signal for each one
    that waits for a person (tasks connects the webhook to it). A handler that fails is logged by
    the signal and never reaches the loop."""
    for r in written:
        if r.grant_id is None:
            approval_requested.send(sender=None, request=r)
