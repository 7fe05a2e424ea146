"""The transaction's Session (models.db): a statement ``built_once`` marked as yielding plain
rows runs on the transaction's Connection, after the Session's autoflush, and returns what the
Session would have returned; a statement that returns mapped objects still goes the Session's
ORM way. Real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import bindparam, event, func, insert, select, text, update
from sqlalchemy.orm import ORMExecuteState, Session

from models import transaction
from models.base import utcnow
from models.db import _yields_plain_rows, built_once
from models.enums import Phase, SessionType
from models.session import AgentSession as S


@built_once
def _count_of_user_stmt() -> Any:
    return select(func.count()).select_from(S).where(S.user_id == bindparam("b_user"))


@built_once
def _session_stmt() -> Any:
    return select(S).where(S.id == bindparam("b_sid"))


@built_once
def _bump_epoch_stmt() -> Any:
    return (
        update(S)
        .where(S.id == bindparam("b_sid"), S.epoch == bindparam("b_epoch"))
        .values(epoch=S.epoch + 1)
        .returning(S.epoch)
        .execution_options(synchronize_session=False)
    )


@pytest.fixture
def orm_executed() -> Iterator[list[Any]]:
    """The statements that went through the Session's ORM execution path."""
    seen: list[Any] = []

    def record(state: ORMExecuteState) -> None:
        seen.append(state.statement)

    event.listen(Session, "do_orm_execute", record)
    try:
        yield seen
    finally:
        event.remove(Session, "do_orm_execute", record)


def _pending_session(s: Session, user: str) -> S:
    now = utcnow()
    row = S(
        user_id=user,
        session_type=SessionType.NORMAL,
        agent_type="main",
        phase=Phase.RUNNING,
        started_at=now,
        updated_at=now,
        epoch=0,
    )
    s.add(row)  # pending: not flushed yet
    return row


def test_a_built_once_select_of_columns_skips_the_orm_path_and_still_sees_what_the_session_holds_unflushed(
    db: str, orm_executed: list[Any]
) -> None:
    stmt = _count_of_user_stmt()
    with transaction() as s:
        _pending_session(s, "unflushed-user")
        count = s.execute(stmt, {"b_user": "unflushed-user"}).scalar_one()
    assert count == 1  # the autoflush ran before the statement, as the Session's own path does
    assert stmt not in orm_executed


def test_a_built_once_compare_and_set_returns_its_rowcount_and_returning_rows_from_the_connection(
    db: str, orm_executed: list[Any]
) -> None:
    with transaction() as s:
        row = _pending_session(s, "cas-user")
        s.flush()
        won = s.execute(_bump_epoch_stmt(), {"b_sid": row.id, "b_epoch": 0})
        assert won.rowcount == 1
        assert won.scalar_one() == 1
        lost = s.execute(_bump_epoch_stmt(), {"b_sid": row.id, "b_epoch": 0})  # epoch is 1 now
        assert lost.rowcount == 0
    assert _bump_epoch_stmt() not in orm_executed


def test_a_built_once_select_of_a_mapped_class_still_returns_orm_objects(db: str, orm_executed: list[Any]) -> None:
    with transaction() as s:
        row = _pending_session(s, "entity-user")
        s.flush()
        sid = row.id
    with transaction() as s:
        found = s.execute(_session_stmt(), {"b_sid": sid}).scalar_one()
        assert isinstance(found, S)
        assert found.user_id == "entity-user"
    assert _session_stmt() in orm_executed


def test_text_skips_the_orm_path_too(db: str, orm_executed: list[Any]) -> None:
    stmt = text("SELECT count(*) FROM agent_session WHERE user_id = :u")
    with transaction() as s:
        _pending_session(s, "text-user")
        assert s.execute(stmt, {"u": "text-user"}).scalar_one() == 1
    assert stmt not in orm_executed


def test_only_statements_whose_rows_are_plain_are_marked() -> None:
    assert _yields_plain_rows(select(S.id, S.epoch))
    assert _yields_plain_rows(select(func.count()).select_from(S))
    assert _yields_plain_rows(update(S).values(epoch=1))
    assert _yields_plain_rows(update(S).values(epoch=1).returning(S.id))
    assert _yields_plain_rows(insert(S).returning(S.id))
    assert _yields_plain_rows(text("SELECT 1"))
    assert not _yields_plain_rows(select(S))
    assert not _yields_plain_rows(select(S.id, S))
    assert not _yields_plain_rows(update(S).values(epoch=1).returning(S))
