"""Pipeline artifacts (PARSED_FACT_SET, RECOVERY_REQUEST, RECOVERY_ASSEMBLY, EFFECTIVE_FACT_VIEW).

Artifacts are immutable. Writing the same content for the same source twice stores it once
(``ON CONFLICT DO NOTHING`` on source, revision, type and content hash), so a replay or a
concurrent caller adds nothing. The type is whitelisted by a CHECK constraint. Each artifact
is kept until ``retention_until`` (creation + the retention), then ``field.purge_expired``
deletes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, ScalarSelect, and_, bindparam, func, or_, select
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
    #: sha256 of ``canonical_json(content)`` when the caller has it already (a PARSED_FACT_SET's
    #: is the facts' observation hash); computed here otherwise.
    content_hash: str | None = None

    def hashed(self) -> ArtifactDraft:
        """This draft with its content hash set (computed once, here, if the caller had none)."""
        if self.content_hash is not None:
            return self
        return replace(self, content_hash=sha256_hex(canonical_json(self.content)))

    @property
    def marker(self) -> str:
        """``TYPE/content_hash``: what ``stored_markers`` returns for this draft once it is stored."""
        return f"{self.artifact_type.value}/{self.hashed().content_hash}"


@lru_cache(maxsize=8)
def stored_markers(count: int) -> ScalarSelect[list[str] | None]:
    """A scalar subquery for ``count`` drafts: the markers of those stored already (NULL for none).

    It reads the unique key (source, revision, type, content hash) only, so a caller can leave
    out what is stored without sending (or serialising) any content. Its parameters come from
    ``stored_markers_params``; the statement is built once per count (the hot path only binds).
    """
    match = [
        and_(
            Art.source_message_id == bindparam(f"art_message_id_{i}"),
            Art.source_revision == bindparam(f"art_revision_{i}"),
            Art.artifact_type == bindparam(f"art_type_{i}"),
            Art.content_hash == bindparam(f"art_hash_{i}"),
        )
        for i in range(count)
    ]
    return select(func.array_agg(Art.artifact_type + "/" + Art.content_hash)).where(or_(*match)).scalar_subquery()


def stored_markers_params(drafts: Sequence[ArtifactDraft]) -> dict[str, Any]:
    """The parameters of ``stored_markers(len(drafts))`` for these drafts."""
    params: dict[str, Any] = {}
    for i, d in enumerate(drafts):
        params[f"art_message_id_{i}"] = d.source.message_id
        params[f"art_revision_{i}"] = d.source.revision
        params[f"art_type_{i}"] = d.artifact_type.value
        params[f"art_hash_{i}"] = d.hashed().content_hash
    return params


def put_artifacts(
    s: Session | Connection,
    drafts: Sequence[ArtifactDraft],
    *,
    retention: timedelta = timedelta(days=DEFAULT_RETENTION_DAYS),
) -> int:
    """Insert the drafts that are not stored yet (ONE statement); returns how many were new."""
    if not drafts:
        return 0
    rows = [
        {
            "source_message_id": draft.source.message_id,
            "source_revision": draft.source.revision,
            "artifact_type": draft.artifact_type.value,
            "idempotency_key": draft.idempotency_key,
            "content": draft.content,
            "content_hash": draft.content_hash or sha256_hex(canonical_json(draft.content)),
            "created_at": func.now(),
            "retention_until": func.now() + retention,
        }
        for draft in drafts
    ]
    inserted = s.execute(
        pg_insert(Art)
        .values(rows)
        .on_conflict_do_nothing(constraint="uq_field_recovery_artifact_content")
        .returning(Art.id)
    ).all()
    return len(inserted)
