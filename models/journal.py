"""round_journal: the model's reply of a round in flight, and its tools' starts and results
(docs/state-machines.md, "Journal entry"; docs/invariants.md, J1 and J2).

A loop writes one OPEN entry per session right after the model answers with tool calls and
before the first tool runs; each non-repeatable tool's start and each tool's result are
added as they happen; the transaction that lands the round in the history (or creates a
delegating round's children) closes the entry. The journal is not history: the model never
sees it, and a recovered loop only reads it to continue the round it describes.

An entry is only valid for the history it was asked from: ``after_message_id`` is the last
live message of the session when the model was asked. A recovered loop that finds a later
history (a new instruction, a failed execution followed by a followup) abandons the entry.
Every helper is one statement; the compare-and-set ones say in their docstring what "nothing
done" means.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    bindparam,
    exists,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, BigId, StrEnumType, UTCDateTime, check_in, utcnow
from models.db import built_once, cas
from models.message import Message


class JournalStatus(StrEnum):
    OPEN = "OPEN"  #: the round is in flight: its reply is journaled, it is not in the history yet
    CLOSED = "CLOSED"  #: the round landed in the history (or its children were created)
    ABANDONED = "ABANDONED"  #: the history moved on without this round; it is never continued


class CallStatus(StrEnum):
    STARTED = "STARTED"  #: the tool was started; no result was journaled (it may have taken effect)
    FINISHED = "FINISHED"  #: the tool's result is journaled


class RoundJournal(Base):
    __tablename__ = "round_journal"
    __table_args__ = (
        CheckConstraint(check_in("status", JournalStatus), name="status"),
        CheckConstraint("(status = 'OPEN') = (closed_at IS NULL)", name="open_has_no_close"),
        # At most one round in flight per session.
        Index(
            "uq_round_journal_open",
            "session_id",
            unique=True,
            postgresql_where=text("closed_at IS NULL"),
            sqlite_where=text("closed_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    #: The epoch (session's or execution's) of the loop that owns the round now.
    epoch: Mapped[int] = mapped_column(Integer)
    #: The last live message of the session when the model was asked (None: empty history).
    after_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    status: Mapped[JournalStatus] = mapped_column(StrEnumType(JournalStatus), default=JournalStatus.OPEN)
    content: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: The OpenAI list (ids, names, argument strings), after the loop's id checks.
    tool_calls: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    #: tool_call_id -> TOOL error written instead of running the call (e.g. a repeated id).
    refused: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    #: tool_call_id -> what the tool's ``requires_approval`` callable decided for that call,
    #: written with the reply (a continued round reads it, never asks the callable again).
    approval_rules: Mapped[dict[str, bool] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    #: The reply's own fields besides content and tool calls (docs/providers.md), as sent.
    provider_fields: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: How many recovered loops continued this round without asking the model again.
    replays: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class RoundJournalCall(Base):
    __tablename__ = "round_journal_call"
    __table_args__ = (
        CheckConstraint(check_in("status", CallStatus), name="status"),
        UniqueConstraint("journal_id", "tool_call_id", name="uq_round_journal_call"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    journal_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("round_journal.id"))
    tool_call_id: Mapped[str] = mapped_column(String(128))
    tool_name: Mapped[str] = mapped_column(String(128))
    #: Declared read-only or idempotent when it was started: safe to run again.
    repeatable: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[CallStatus] = mapped_column(StrEnumType(CallStatus))
    #: How many times the tool was started (the at-most-once rule checks non-repeatable ones).
    starts: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    result: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def relaxed_commit(s: Session) -> None:
    """Let this transaction's commit return before its WAL is flushed (PostgreSQL's
    ``synchronous_commit = off``, for this transaction only).

    NOTE: the journal's crash model is a worker that dies; the database keeps such a commit
    (it is in PostgreSQL's WAL buffers, flushed within ``wal_writer_delay``). Only a crash of
    PostgreSQL itself can lose it, and losing a reply or a result is safe: the model is asked
    again, or the call counts as interrupted. A tool's START is never relaxed (it guards the
    at-most-once rule), and WAL is sequential: a later synchronous commit flushes the earlier
    relaxed ones with it, so a start or a round never survives without what came before."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SET LOCAL synchronous_commit TO OFF"))


def last_live_message_id(s: Session, session_id: int) -> int | None:
    return s.execute(
        select(func.max(Message.id)).where(Message.session_id == session_id, Message.deleted.is_(False))
    ).scalar_one()


#: The label of :func:`has_open_entry` in a row (a take's or a load's fact).
JOURNAL_OPEN = "journal_open"


def has_open_entry(session_id: Any) -> Any:
    """SQL: the session ``session_id`` (a column or a value) has an open entry, labelled
    JOURNAL_OPEN: a caller that reads False reads no entry."""
    J = RoundJournal
    return exists().where(J.session_id == session_id, J.closed_at.is_(None)).label(JOURNAL_OPEN)


def open_entry(s: Session, session_id: int) -> RoundJournal | None:
    """The session's open entry, locked (FOR UPDATE), or None."""
    return s.execute(_open_entry_stmt(), {"b_sid": session_id}).scalar_one_or_none()


@built_once
def _open_entry_stmt() -> Any:
    return (
        select(RoundJournal)
        .where(RoundJournal.session_id == bindparam("b_sid"), RoundJournal.closed_at.is_(None))
        .with_for_update()
    )


def write_reply(
    s: Session,
    *,
    session_id: int,
    epoch: int,
    content: str | None,
    tool_calls: list[dict[str, Any]],
    refused: dict[str, str],
    prompt_tokens: int,
    completion_tokens: int,
    provider_fields: dict[str, Any] | None = None,
    approval_rules: dict[str, bool] | None = None,
) -> int:
    """Insert the session's open entry; returns its id. An entry still open for the session
    (a run that ended without landing its round and was not continued: a failed execution
    before a followup) is abandoned first, in the same transaction. ``approval_rules``: what
    the tools' ``requires_approval`` callables decided for its calls."""
    J = RoundJournal
    cas(
        s,
        update(J)
        .where(J.session_id == session_id, J.closed_at.is_(None))
        .values(status=JournalStatus.ABANDONED, closed_at=utcnow()),
    )
    row = RoundJournal(
        session_id=session_id,
        epoch=epoch,
        after_message_id=last_live_message_id(s, session_id),
        status=JournalStatus.OPEN,
        content=content,
        tool_calls=tool_calls,
        refused=refused,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        provider_fields=provider_fields or None,
        approval_rules=approval_rules or None,
        replays=0,
    )
    s.add(row)
    s.flush()
    return row.id


def approval_rules_of(s: Session, journal_id: int, *, lock: bool = False) -> dict[str, bool]:
    """What the tools' ``requires_approval`` callables decided for the entry's calls (call id ->
    needs approval), as journaled; ``lock`` holds the entry's row (``add_approval_rules``)."""
    stmt = select(RoundJournal.approval_rules).where(RoundJournal.id == journal_id)
    if lock:
        stmt = stmt.with_for_update()
    return dict(s.execute(stmt).scalar_one_or_none() or {})


def add_approval_rules(s: Session, journal_id: int, decided: dict[str, bool]) -> bool:
    """Add callables' decisions for calls of an OPEN entry that has none for them yet (a round
    journaled before the tool had its callable, continued now). A decision already journaled
    for a call is never replaced. The caller holds the fence. False, nothing done: the entry is
    not open, or every call had its decision."""
    had = approval_rules_of(s, journal_id, lock=True)
    fresh = {k: v for k, v in decided.items() if k not in had}
    if not fresh:
        return False
    J = RoundJournal
    return (
        cas(
            s,
            update(J).where(J.id == journal_id, J.status == JournalStatus.OPEN).values(approval_rules={**had, **fresh}),
        )
        == 1
    )


def adopt(s: Session, journal_id: int, *, epoch: int) -> bool:
    """Hand the open entry to the loop holding ``epoch`` (a recovered loop) and count the
    replay. False, nothing done: the entry is no longer open, or a loop with a newer epoch
    already holds it."""
    J = RoundJournal
    rows = cas(
        s,
        update(J)
        .where(J.id == journal_id, J.status == JournalStatus.OPEN, J.epoch <= epoch)
        .values(epoch=epoch, replays=J.replays + 1),
    )
    return rows == 1


def _finish(s: Session, journal_id: int, status: JournalStatus) -> bool:
    J = RoundJournal
    rows = cas(
        s,
        update(J).where(J.id == journal_id, J.status == JournalStatus.OPEN).values(status=status, closed_at=utcnow()),
    )
    return rows == 1


def close(s: Session, journal_id: int) -> bool:
    """OPEN -> CLOSED, in the transaction that lands the round. False, nothing done: the entry
    was already closed or abandoned (the caller's fence, checked in the same transaction,
    is what keeps a stale loop out)."""
    return _finish(s, journal_id, JournalStatus.CLOSED)


def abandon(s: Session, journal_id: int) -> bool:
    """OPEN -> ABANDONED. False, nothing done: the entry was no longer open."""
    return _finish(s, journal_id, JournalStatus.ABANDONED)


def edit_call(s: Session, journal_id: int, tool_call_id: str, arguments: str) -> bool:
    """Journal ``arguments`` as the arguments of one call of the open entry (an approver edited
    them: the call that runs, is keyed and lands in the history is that one). False, nothing
    done: the entry is no longer open or has no such call. The caller holds the fence of the
    entry's epoch; the entry row is locked while its call list is rewritten."""
    J = RoundJournal
    entry = s.execute(
        select(J.tool_calls).where(J.id == journal_id, J.status == JournalStatus.OPEN).with_for_update()
    ).scalar_one_or_none()
    if entry is None or not any(str(c.get("id")) == tool_call_id for c in entry):
        return False
    calls = [
        {**c, "function": {**c.get("function", {}), "arguments": arguments}} if str(c.get("id")) == tool_call_id else c
        for c in entry
    ]
    return cas(s, update(J).where(J.id == journal_id, J.status == JournalStatus.OPEN).values(tool_calls=calls)) == 1


def calls_of(s: Session, journal_id: int) -> list[RoundJournalCall]:
    return list(s.execute(select(RoundJournalCall).where(RoundJournalCall.journal_id == journal_id)).scalars())


def mark_started(s: Session, journal_id: int, tool_call_id: str, *, tool_name: str, repeatable: bool) -> int:
    """Record one start of a tool call (STARTED, starts + 1); returns how many starts the call
    has now. A call with a journaled result is never started again; the caller holds the fence
    of the entry's epoch."""
    C = RoundJournalCall
    starts = s.execute(
        update(C)
        .where(C.journal_id == journal_id, C.tool_call_id == tool_call_id, C.status == CallStatus.STARTED)
        .values(starts=C.starts + 1, started_at=utcnow())
        .returning(C.starts)
    ).scalar_one_or_none()
    if starts is None:
        s.execute(
            insert(C).values(
                journal_id=journal_id,
                tool_call_id=tool_call_id,
                tool_name=tool_name,
                repeatable=repeatable,
                status=CallStatus.STARTED,
                starts=1,
                started_at=utcnow(),
            )
        )
        return 1
    return int(starts)


def mark_finished(
    s: Session, journal_id: int, tool_call_id: str, result: str, *, tool_name: str, repeatable: bool
) -> None:
    """Record a call's result (FINISHED). A repeatable call journals no start: its first row
    may be this one (starts = 1)."""
    C = RoundJournalCall
    rows = cas(
        s,
        update(C)
        .where(C.journal_id == journal_id, C.tool_call_id == tool_call_id, C.status == CallStatus.STARTED)
        .values(status=CallStatus.FINISHED, result=result, finished_at=utcnow()),
    )
    if rows == 0:
        now = utcnow()
        s.execute(
            insert(C).values(
                journal_id=journal_id,
                tool_call_id=tool_call_id,
                tool_name=tool_name,
                repeatable=repeatable,
                status=CallStatus.FINISHED,
                starts=1,
                result=result,
                started_at=now,
                finished_at=now,
            )
        )
