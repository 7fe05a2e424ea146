"""Field-recovery tables: the invocation record and the artifacts (docs/tables.md).

They use their own DeclarativeBase and MetaData, in the PostgreSQL schema named by
``booking.field-recovery.db-schema`` (default ``th_hotel_booking``): the tables are declared in
DEFAULT_SCHEMA and the store maps that name to the configured one with SQLAlchemy's
``schema_translate_map``. ``migrations/versions/0004_field_recovery.py`` creates the same
tables (0006 adds the artifacts' retention); tests/integration/test_field_migration.py checks
that the two agree.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, CheckConstraint, Index, Integer, MetaData, String, UniqueConstraint, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from models.base import NAMING, BigId, UTCDateTime, check_in

#: The schema the tables are declared in; translated to the configured one at run time.
DEFAULT_SCHEMA = "th_hotel_booking"
#: How long invocations and artifacts are kept by default (retention_until = creation + this).
DEFAULT_RETENTION_DAYS = 90


class InvocationStatus(StrEnum):
    IN_PROGRESS = "IN_PROGRESS"  #: an owner (owner_id, epoch) is calling the provider under a lease
    SUCCEEDED = "SUCCEEDED"  #: terminal: a strict PatchSet was stored; replays use it
    FAILED = "FAILED"  #: terminal: the call failed closed; error_code says why


class ArtifactType(StrEnum):
    """The artifact-type whitelist (a CHECK constraint in the table)."""

    PARSED_FACT_SET = "PARSED_FACT_SET"  #: the deterministic parser's facts
    RECOVERY_REQUEST = "RECOVERY_REQUEST"  #: the minimal RecoveryRequestSet that was (to be) sent
    RECOVERY_ASSEMBLY = "RECOVERY_ASSEMBLY"  #: accepted and rejected patches with reasons
    EFFECTIVE_FACT_VIEW = "EFFECTIVE_FACT_VIEW"  #: facts with provenance after apply-once


class FieldBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING, schema=DEFAULT_SCHEMA)


class FieldRecoveryInvocation(FieldBase):
    """One row per idempotency key: the persistent owner, audit and replay record."""

    __tablename__ = "field_recovery_invocation"
    __table_args__ = (
        UniqueConstraint("idempotency_key", name="uq_field_recovery_invocation_idempotency_key"),
        CheckConstraint(check_in("status", InvocationStatus), name="status"),
        # A success has its PatchSet and end time; a failure names its safe error code.
        CheckConstraint(
            "status <> 'SUCCEEDED' OR (patch_set IS NOT NULL AND completed_at IS NOT NULL)",
            name="succeeded_has_patch_set",
        ),
        CheckConstraint(
            "status <> 'FAILED' OR (error_code IS NOT NULL AND completed_at IS NOT NULL)",
            name="failed_has_error_code",
        ),
        CheckConstraint("assembly_result IS NULL OR status = 'SUCCEEDED'", name="assembly_only_on_success"),
        Index("ix_field_recovery_invocation_source", "source_message_id", "source_revision"),
        Index(
            "ix_field_recovery_invocation_in_progress",
            "lease_expires_at",
            postgresql_where=text("status = 'IN_PROGRESS'"),
        ),
        Index("ix_field_recovery_invocation_retention_until", "retention_until"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer)
    source_message_id: Mapped[str] = mapped_column(String(512))
    source_revision: Mapped[int] = mapped_column(Integer)
    observation_hash: Mapped[str] = mapped_column(String(64))
    profile_version: Mapped[str] = mapped_column(String(128))
    request_hash: Mapped[str] = mapped_column(String(64))
    response_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(20))
    owner_id: Mapped[str] = mapped_column(String(128))
    #: Fencing token: bumped by every takeover; every owner write names the epoch it holds.
    epoch: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    provider_session_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    provider_run_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    resolved_profile_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    resolved_profile_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    model: Mapped[str | None] = mapped_column(String(128), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    duration_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_summary: Mapped[str | None] = mapped_column(String(512), nullable=True)
    patch_set: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    assembly_result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    assembled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    retention_until: Mapped[datetime] = mapped_column(UTCDateTime)


class FieldRecoveryArtifact(FieldBase):
    """An immutable pipeline artifact; identical content for the same source is stored once."""

    __tablename__ = "field_recovery_artifact"
    __table_args__ = (
        CheckConstraint(check_in("artifact_type", ArtifactType), name="artifact_type"),
        UniqueConstraint(
            "source_message_id",
            "source_revision",
            "artifact_type",
            "content_hash",
            name="uq_field_recovery_artifact_content",
        ),
        Index("ix_field_recovery_artifact_key", "idempotency_key"),
        Index("ix_field_recovery_artifact_retention_until", "retention_until"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    source_message_id: Mapped[str] = mapped_column(String(512))
    source_revision: Mapped[int] = mapped_column(Integer)
    artifact_type: Mapped[str] = mapped_column(String(32))
    idempotency_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    content: Mapped[dict[str, Any]] = mapped_column(JSON)
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: After this the artifact is purged (migration 0006); created_at + the retention days.
    retention_until: Mapped[datetime] = mapped_column(UTCDateTime)
