"""agent_release: the whole agent configuration in force, stored once under its content hash
(docs/releases.md). A session records the release it started in (``agent_session.release_id``)
and its rounds use that release's agent definitions, whatever the resuming worker's file says.
A release row is never updated nor deleted: its definition is what the hash names."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow


class AgentRelease(Base):
    __tablename__ = "agent_release"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    #: sha256 (hex) of the canonical JSON of ``definition``: one row per configuration.
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: Every agent's definition and every tool's schema and flags; no secret (docs/releases.md).
    definition: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def store_release(s: Session, content_hash: str, definition: dict[str, Any]) -> int:
    """The id of the release of ``content_hash``, inserted with ``definition`` when no row holds
    it yet (first writer wins: two processes storing the same configuration share one row)."""
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    s.execute(
        dialect.insert(AgentRelease)
        .values(content_hash=content_hash, definition=definition, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["content_hash"])
    )
    return int(s.execute(select(AgentRelease.id).where(AgentRelease.content_hash == content_hash)).scalar_one())


def release_definition(s: Session, release_id: int) -> tuple[str, dict[str, Any]] | None:
    """The release's (content_hash, definition); None when no row has that id."""
    row = s.execute(
        select(AgentRelease.content_hash, AgentRelease.definition).where(AgentRelease.id == release_id)
    ).first()
    return None if row is None else (str(row.content_hash), dict(row.definition))


def release_rows(s: Session) -> list[Any]:
    """Every release (id, content_hash, definition, created_at, live: its sessions not yet
    stopped, children included), oldest first."""
    from models.session import AgentSession, not_stopped

    live = (
        select(func.count())
        .where(AgentSession.release_id == AgentRelease.id, not_stopped())
        .correlate(AgentRelease)
        .scalar_subquery()
    )
    return list(
        s.execute(
            select(
                AgentRelease.id,
                AgentRelease.content_hash,
                AgentRelease.definition,
                AgentRelease.created_at,
                live.label("live"),
            ).order_by(AgentRelease.id)
        )
    )


def release_of(s: Session, session_id: int) -> int | None:
    """The release ``session_id`` started in; None for a session older than releases (or none)."""
    from models.session import AgentSession

    return s.execute(select(AgentSession.release_id).where(AgentSession.id == session_id)).scalar_one_or_none()


def pin_session_release(s: Session, session_id: int, *, epoch: int, release_id: int) -> bool:
    """A session without a release takes ``release_id`` (its first run's, as the holder of
    ``epoch``). False, and nothing written, when it already has one or the epoch moved on."""
    from sqlalchemy import update

    from models.db import cas
    from models.session import AgentSession

    stmt = (
        update(AgentSession)
        .where(AgentSession.id == session_id, AgentSession.epoch == epoch, AgentSession.release_id.is_(None))
        .values(release_id=release_id)
        .execution_options(synchronize_session=False)
    )
    return cas(s, stmt) == 1
