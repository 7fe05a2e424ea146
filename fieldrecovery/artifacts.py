"""Pipeline artifacts (PARSED_FACT_SET, RECOVERY_REQUEST, RECOVERY_ASSEMBLY, EFFECTIVE_FACT_VIEW).

Artifacts are immutable. Writing the same content for the same source twice stores it once
(``ON CONFLICT DO NOTHING`` on source, revision, type and content hash), so a replay or a
concurrent caller adds nothing. The type is whitelisted by a CHECK constraint. Each artifact
is kept until ``retention_until`` (creation + the retention), then ``field.purge_expired``
deletes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from fieldrecovery.schemas import SourceRef, canonical_json, sha256_hex
from fieldrecovery.tables import DEFAULT_RETENTION_DAYS, ArtifactType, FieldRecoveryArtifact

Art = FieldRecoveryArtifact


@dataclass(frozen=True)
class ArtifactDraft:
    artifact_type: ArtifactType
    source: SourceRef
    content: dict[str, Any]
    idempotency_key: str | None = None


def put_artifacts(
    s: Session, drafts: Sequence[ArtifactDraft], *, retention: timedelta = timedelta(days=DEFAULT_RETENTION_DAYS)
) -> int:
    """Insert the drafts that are not stored yet; returns how many were new."""
    written = 0
    for draft in drafts:
        row = s.execute(
            pg_insert(Art)
            .values(
                source_message_id=draft.source.message_id,
                source_revision=draft.source.revision,
                artifact_type=draft.artifact_type.value,
                idempotency_key=draft.idempotency_key,
                content=draft.content,
                content_hash=sha256_hex(canonical_json(draft.content)),
                created_at=func.now(),
                retention_until=func.now() + retention,
            )
            .on_conflict_do_nothing(constraint="uq_field_recovery_artifact_content")
            .returning(Art.id)
        ).scalar_one_or_none()
        written += row is not None
    return written


def list_artifacts(s: Session, source: SourceRef) -> list[tuple[ArtifactType, dict[str, Any]]]:
    """The source's artifacts in write order (tests, ops)."""
    rows = s.execute(
        select(Art.artifact_type, Art.content)
        .where(Art.source_message_id == source.message_id, Art.source_revision == source.revision)
        .order_by(Art.id)
    ).all()
    return [(ArtifactType(r.artifact_type), r.content) for r in rows]
