"""agent_release: the whole agent configuration in force, stored once under its content hash
(docs/releases.md). A session records the release it started in (``agent_session.release_id``)
and its rounds use that release's agent definitions, whatever the resuming worker's file says.
A release row is never updated nor deleted: its definition is what the hash names.

A session tree moves to another release only at its root's round boundary (``move_at_boundary``:
by the policy ``latest``, or to the target an operator set with ``mark_upgrade``), each move one
row of ``release_move``. A session of a newer release than its worker's, whose tools the worker
lacks, waits for a worker of its release (``wait_for_release``) like one waiting for the model:
its lease lapses after a back-off and the scan resumes it."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, String, func, insert, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, UTCDateTime, utcnow
from models.db import cas


class AgentRelease(Base):
    __tablename__ = "agent_release"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    #: sha256 (hex) of the canonical JSON of ``definition``: one row per configuration.
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: Every agent's definition and every tool's schema and flags; no secret (docs/releases.md).
    definition: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MoveReason(StrEnum):
    """Why a session tree moved to another release (``release_move.reason``)."""

    LATEST = "latest"  #: AGENT_RELEASE_POLICY=latest: the worker's release was newer
    UPGRADE = "upgrade"  #: an operator's ``sessions upgrade`` set the target


class ReleaseMove(Base):
    """One move of a session tree (its root named) from one release to another: the session's
    release history. Rows are never updated."""

    __tablename__ = "release_move"
    __table_args__ = (Index("ix_release_move_session", "session_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())
    #: The tree's root (a top-level session); its children moved with it.
    session_id: Mapped[int] = mapped_column(BigInteger)
    from_release_id: Mapped[int] = mapped_column(BigInteger)
    to_release_id: Mapped[int] = mapped_column(BigInteger)
    #: Sessions of the tree that moved (the root included).
    sessions: Mapped[int] = mapped_column(Integer)
    #: A ``MoveReason``.
    reason: Mapped[str] = mapped_column(String(16))


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


def tree_ids(root_id: int) -> Any:
    """SQL: the ids of ``root_id``'s session and every session below it (a recursive CTE)."""
    from models.session import AgentSession as S

    tree = select(S.id).where(S.id == root_id).cte("release_tree", recursive=True)
    below = select(S.id).where(S.parent_session_id == tree.c.id)
    tree = tree.union_all(below)
    return select(tree.c.id)


def move_at_boundary(
    s: Session, session_id: int, *, epoch: int, from_release: int, to_release: int, reason: MoveReason
) -> bool:
    """At a round boundary of a top-level session held at ``epoch`` (no round of it in flight):
    move its tree from ``from_release`` to ``to_release`` and record the move. One conditional
    UPDATE of the root decides (an ``upgrade`` only while the operator's target is still
    ``to_release``; a ``latest`` move only while no target is set); the tree's other sessions
    follow in the same transaction (none runs while its root is between rounds). False, nothing
    written: the epoch, the release or the target moved meanwhile."""
    from models.session import AgentSession as S

    upgrade = reason == MoveReason.UPGRADE
    wanted = S.release_target_id == to_release if upgrade else S.release_target_id.is_(None)
    root = update(S).where(S.id == session_id, S.epoch == epoch, S.release_id == from_release, wanted)
    if cas(s, root.values(release_id=to_release, release_target_id=None)) != 1:
        return False
    below = cas(
        s,
        update(S)
        .where(S.id.in_(tree_ids(session_id)), S.id != session_id, S.release_id == from_release)
        .values(release_id=to_release),
    )
    s.execute(
        insert(ReleaseMove).values(
            session_id=session_id,
            from_release_id=from_release,
            to_release_id=to_release,
            sessions=below + 1,
            reason=str(reason),
        )
    )
    return True


def target_of(s: Session, session_id: int) -> int | None:
    """The release an operator moved the session's tree to, not taken yet (None: none)."""
    from models.session import AgentSession as S

    return s.execute(select(S.release_target_id).where(S.id == session_id)).scalar_one_or_none()


def mark_upgrade(s: Session, root_id: int, *, to_release: int, from_release: int | None = None) -> bool:
    """Ask that a top-level session's tree move to ``to_release`` at its next round boundary.
    False, nothing written: no such live top-level session, it has no release yet, it is on
    ``to_release`` already, or it is not on ``from_release``."""
    from models.enums import SessionType
    from models.session import AgentSession as S
    from models.session import not_stopped

    conditions = [
        S.id == root_id,
        S.session_type != SessionType.SUBAGENT,
        not_stopped(),
        S.release_id.is_not(None),
        S.release_id != to_release,
    ]
    if from_release is not None:
        conditions.append(S.release_id == from_release)
    return cas(s, update(S).where(*conditions).values(release_target_id=to_release)) == 1


def moves_of(s: Session, session_id: int) -> list[dict[str, Any]]:
    """The release moves of a session's tree (its root's rows), oldest first."""
    rows = s.execute(select(ReleaseMove).where(ReleaseMove.session_id == session_id).order_by(ReleaseMove.id))
    return [
        {
            "at": r.at.isoformat(),
            "from_release_id": r.from_release_id,
            "to_release_id": r.to_release_id,
            "sessions": r.sessions,
            "reason": r.reason,
        }
        for r in rows.scalars()
    ]


def wait_for_release(
    s: Session, session_id: int, *, epoch: int, backoff_seconds: float, execution_id: int | None = None
) -> bool:
    """Mark the session waiting for a worker of its release (since now, unless it already was)
    and let its lease (a child's: its execution's, ``execution_id``) lapse ``backoff_seconds``
    from now: the scan resumes it then, on whichever worker takes the task. False, nothing
    done: another epoch holds it (or the execution is no longer active)."""
    from models.enums import ACTIVE_EXECUTION
    from models.execution import SubagentExecution as E
    from models.session import AgentSession as S

    now = utcnow()
    until = now + timedelta(seconds=backoff_seconds)
    since = func.coalesce(S.release_wait_since, now)
    if execution_id is None:
        stmt = update(S).where(S.id == session_id, S.epoch == epoch, S.lease_owner.is_not(None))
        return cas(s, stmt.values(release_wait_since=since, lease_expires_at=until)) == 1
    owned = update(E).where(
        E.id == execution_id, E.epoch == epoch, E.status.in_(ACTIVE_EXECUTION), E.lease_owner.is_not(None)
    )
    if cas(s, owned.values(lease_expires_at=until)) != 1:
        return False
    cas(s, update(S).where(S.id == session_id).values(release_wait_since=since))
    return True


def release_found(s: Session, session_id: int, *, epoch: int | None) -> bool:
    """A worker of the session's release runs it: it waits no more (``epoch``: the parent's,
    None for a child session, whose execution's fence its caller holds). False, nothing done:
    it was not waiting, or another epoch holds it."""
    from models.session import AgentSession as S

    stmt = update(S).where(S.id == session_id, S.release_wait_since.is_not(None))
    if epoch is not None:
        stmt = stmt.where(S.epoch == epoch)
    return cas(s, stmt.values(release_wait_since=None)) == 1


def waiting_for_release(s: Session) -> list[tuple[int, int]]:
    """(release id, sessions) of the live sessions waiting for a worker of their release."""
    from models.enums import ACTIVE_PHASES
    from models.session import AgentSession as S

    rows = s.execute(
        select(S.release_id, func.count())
        .where(S.release_wait_since.is_not(None), S.phase.in_(ACTIVE_PHASES), S.release_id.is_not(None))
        .group_by(S.release_id)
    )
    return [(int(r[0] or 0), int(r[1])) for r in rows]
