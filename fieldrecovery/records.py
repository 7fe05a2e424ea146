"""Value records of the invocation store: what a claim records, what an audit writes, what a
read or an operator listing returns. All of it is safe to store, log and print (I8):
ids, hashes, counts, times and codes, never a request, an answer, a key or a header.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fieldrecovery.tables import InvocationStatus


@dataclass(frozen=True)
class InvocationMeta:
    """What a claim records about the request (all of it safe to store)."""

    idempotency_key: str
    request_id: str
    attempt: int
    source_message_id: str
    source_revision: int
    observation_hash: str
    profile_version: str
    request_hash: str


@dataclass(frozen=True)
class ProviderAudit:
    """Safe provider metadata recorded by finish_success / finish_failure."""

    session_id: str | None = None
    run_id: str | None = None
    resolved_profile_id: str | None = None
    resolved_profile_version: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    duration_ms: int | None = None
    response_hash: str | None = None

    def columns(self) -> dict[str, Any]:
        return {
            "provider_session_id": self.session_id,
            "provider_run_id": self.run_id,
            "resolved_profile_id": self.resolved_profile_id,
            "resolved_profile_version": self.resolved_profile_version,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "duration_ms": self.duration_ms,
            "response_hash": self.response_hash,
        }


@dataclass(frozen=True)
class InvocationRecord:
    """A read snapshot of one invocation row."""

    idempotency_key: str
    request_id: str
    status: InvocationStatus
    owner_id: str
    epoch: int
    lease_expires_at: datetime | None
    error_code: str | None
    patch_set: dict[str, Any] | None
    assembly_result: dict[str, Any] | None
    provider_run_id: str | None
    duration_ms: int | None


@dataclass(frozen=True)
class StaleInvocation:
    """An IN_PROGRESS invocation whose lease has expired (no owner renews it)."""

    idempotency_key: str
    request_id: str
    owner_id: str
    epoch: int
    started_at: datetime
    lease_expires_at: datetime
    #: Seconds since the (last) owner started.
    age_seconds: float
    #: Seconds since its lease expired.
    overdue_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "idempotency_key": self.idempotency_key,
            "request_id": self.request_id,
            "owner_id": self.owner_id,
            "epoch": self.epoch,
            "started_at": self.started_at.isoformat(),
            "lease_expires_at": self.lease_expires_at.isoformat(),
            "age_seconds": round(self.age_seconds, 3),
            "overdue_seconds": round(self.overdue_seconds, 3),
        }
