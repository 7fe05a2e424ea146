"""subagent_execution and its state machine as compare-and-set updates (docs/state-machines.md).

Execution status: RUNNING -> COMPLETED|FAILED|CANCELLED; RUNNING -> RECOVERING;
RECOVERING -> COMPLETED|FAILED|CANCELLED. Delivery: PENDING -> DELIVERED|SUPPRESSED; LEGACY is
terminal. Every helper is ONE conditional UPDATE whose rowcount says if it landed. When it did
not land, the row is read once to classify: a different epoch means a newer owner (a normal
outcome, the helper returns False/None); the same epoch in a state the transition cannot start
from is a caller bug (IllegalTransition).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    case,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

import models.clock as db_clock
from models import lease
from models.base import Base, BigId, StrEnumType, UTCDateTime, check_in, utcnow
from models.db import built_once, cas
from models.enums import (
    ACTIVE_EXECUTION,
    TERMINAL_EXECUTION,
    DeliveryStatus,
    ExecutionStatus,
    InvocationType,
)
from models.errors import IllegalTransition
from models.worker import generation_of, identity, identity_for, lease_takeable, still_current_as, superseded


class SubagentExecution(Base):
    __tablename__ = "subagent_execution"
    __table_args__ = (
        CheckConstraint(check_in("status", ExecutionStatus), name="status"),
        CheckConstraint(check_in("delivery_status", DeliveryStatus), name="delivery_status"),
        CheckConstraint(check_in("invocation_type", InvocationType, nullable=True), name="invocation_type"),
        # A delivered execution is terminal and carries its parent message ids.
        CheckConstraint(
            "delivery_status <> 'DELIVERED' OR (status IN ('COMPLETED', 'FAILED', 'CANCELLED')"
            " AND parent_result_delivered_at IS NOT NULL)",
            name="delivered_is_terminal",
        ),
        UniqueConstraint("parent_session_id", "parent_tool_call_id", name="uq_sae_parent_tool_call"),
        # NOTE: no index names ``status`` (as a key or in its WHERE): every state change of an
        # execution then updates the row in place (HOT, migration 0010), writing no index.
        Index(
            "ix_sae_settled_unfinished",
            "id",
            postgresql_where=text("delivery_status <> 'PENDING' AND completed_at IS NULL"),
            sqlite_where=text("delivery_status <> 'PENDING' AND completed_at IS NULL"),
        ),
        Index(
            "idx_sae_pending",
            "parent_session_id",
            postgresql_where=text("delivery_status = 'PENDING'"),
            sqlite_where=text("delivery_status = 'PENDING'"),
        ),
        Index("ix_sae_child_session", "child_session_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    parent_session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    child_session_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("agent_session.id"))
    agent_type: Mapped[str] = mapped_column(String(64))
    task_description: Mapped[str] = mapped_column(Text)
    status: Mapped[ExecutionStatus] = mapped_column(StrEnumType(ExecutionStatus))
    #: NULL on pre-upgrade rows (inferred and written back by models.legacy).
    invocation_type: Mapped[InvocationType | None] = mapped_column(StrEnumType(InvocationType), nullable=True)
    #: The parent's tool_call id; NULL on pre-upgrade rows.
    parent_tool_call_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    delivery_status: Mapped[DeliveryStatus] = mapped_column(
        StrEnumType(DeliveryStatus), server_default=text("'PENDING'")
    )
    parent_result_delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    parent_assistant_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    parent_tool_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    execution_start_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    final_message_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    total_tool_calls: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    rounds: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    total_tokens: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: The absolute deadline base; never reset by a restart (I5).
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: The boot generation of ``lease_owner`` when it took the lease (models.worker).
    lease_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Times the scan re-sent this unclaimed reservation (each doubles the reservation window).
    resends: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Times recovery took this execution back (the scan's reservation of a dead execution; an
    #: unclaimed reservation re-sent keeps it). Counted since migration 0015.
    recoveries: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    #: Set once by the scan when the row holds a status this code does not know (a corrupt or
    #: a future value): the row and its parent are left alone until an operator repairs them.
    quarantined_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: The parent round this execution belongs to; NULL on pre-upgrade rows.
    pending_round_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("pending_round.id"), nullable=True)


#: Legal sources of each target status (docs/state-machines.md). RUNNING -> RUNNING is the normal path's take
#: (the normal path's run_child takes the execution it was created for: epoch + 1, same status); no
#: other status ever goes back to RUNNING.
STATUS_SOURCES: dict[ExecutionStatus, tuple[ExecutionStatus, ...]] = {
    ExecutionStatus.RUNNING: (ExecutionStatus.RUNNING,),
    ExecutionStatus.RECOVERING: ACTIVE_EXECUTION,
    ExecutionStatus.COMPLETED: ACTIVE_EXECUTION,
    ExecutionStatus.FAILED: ACTIVE_EXECUTION,
    ExecutionStatus.CANCELLED: ACTIVE_EXECUTION,
}

E = SubagentExecution


def _classify(s: Session, eid: int, epoch: int | None, what: str) -> None:
    """After a CAS missed: return if a newer owner moved on, raise if the move was illegal."""
    row = s.execute(select(E.status, E.delivery_status, E.epoch).where(E.id == eid)).one_or_none()
    if row is None:
        raise IllegalTransition(f"execution {eid} does not exist ({what})")
    if epoch is not None and row.epoch != epoch:
        return
    raise IllegalTransition(
        f"execution {eid}: {what} is illegal from status={row.status} delivery={row.delivery_status}"
    )


@built_once
def _take_stmt(to_status: ExecutionStatus, creation: bool, me: tuple[str, int] | None, pg: bool) -> Any:
    """take_execution's compare-and-set for one target status; ``creation``: handed epoch 0;
    ``pg``: the lease it writes must lie in the database's future (models.clock.in_time)."""
    in_time = (db_clock.in_time(bindparam("until", type_=UTCDateTime())),) if pg else ()
    takeable = lease_takeable(E, bindparam("now"))
    if creation:
        # The creation reservation names its creator but belongs to the epoch-0 message,
        # whoever runs it.
        takeable = or_(takeable, E.epoch == 0)
    return (
        update(E)
        .where(
            E.id == bindparam("eid"),
            E.status.in_(STATUS_SOURCES[to_status]),
            E.delivery_status == DeliveryStatus.PENDING,
            E.epoch == bindparam("epoch"),
            *still_current_as(me),  # never taken by a process a newer boot of its name replaced
            takeable,
            *in_time,
        )
        .values(
            status=to_status,
            epoch=E.epoch + 1,
            lease_owner=bindparam("owner"),
            lease_generation=bindparam("generation"),
            lease_expires_at=bindparam("until"),
            # A taken reservation was claimed: a later one, lost, is re-sent after the first window.
            resends=0,
        )
        .execution_options(synchronize_session=False)
    )


def take_execution(
    s: Session,
    eid: int,
    *,
    expected_epoch: int,
    to_status: ExecutionStatus,
    owner: str,
    lease_seconds: float,
) -> int | None:
    """Take a PENDING, active execution for ``owner``: status -> to_status, epoch + 1, new lease,
    and the count of re-sent reservations back to 0 (the one it took was claimed).

    Returns the new epoch, or None when a newer owner holds it: the epoch moved, or a live
    lease (``models.worker.lease_takeable``: a reservation left for the epoch's holder, unowned
    as a scan's hand-over or naming its creator at epoch 0, counts as free). Raises
    IllegalTransition for a terminal or non-PENDING row at the expected epoch (the rule:
    terminal never goes back; only PENDING may be taken over).
    """
    sources = STATUS_SOURCES[to_status]
    now = utcnow()
    params = {
        "eid": eid,
        "epoch": expected_epoch,
        "now": now,
        "owner": owner,
        "generation": generation_of(owner),
        "until": now + timedelta(seconds=lease_seconds),
    }
    pg = s.get_bind().dialect.name == "postgresql"
    rows = cas(s, _take_stmt(to_status, expected_epoch == 0, identity_for(owner), pg), params)
    if rows == 1:
        return expected_epoch + 1
    if db_clock.refused_as_lapsed(s, params["until"]):
        return None  # this process's clock stood still: measured again, the next message takes it
    row = s.execute(select(E.status, E.delivery_status, E.epoch).where(E.id == eid)).one_or_none()
    if row is not None and row.epoch == expected_epoch and row.status in sources and row.delivery_status == "PENDING":
        return None  # a live lease: the owner is still working
    _classify(s, eid, expected_epoch, f"take as {to_status}")
    return None


@built_once
def _finish_stmt(status: ExecutionStatus, keys: tuple[str, ...], me: tuple[str, int] | None) -> Any:
    """finish_execution's compare-and-set for one terminal status and set of written columns."""
    return (
        update(E)
        .where(
            E.id == bindparam("b_eid"),
            E.epoch == bindparam("b_epoch"),
            E.status.in_(STATUS_SOURCES[status]),
            *still_current_as(me),
        )
        .values(status=status, lease_owner=None, lease_expires_at=None, **{k: bindparam(f"v_{k}") for k in keys})
        .execution_options(synchronize_session=False)
    )


def finish_execution(
    s: Session,
    eid: int,
    *,
    epoch: int,
    status: ExecutionStatus,
    result: dict[str, Any],
    error: str | None = None,
    final_message_id: int | None = None,
    rounds: int | None = None,
    total_tool_calls: int | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
) -> bool:
    """Active -> terminal with the result, counters and final message, by the epoch's owner.

    Returns False when a newer owner holds the execution, or a newer process booted under this
    process's worker name (nothing written).
    """
    if status not in TERMINAL_EXECUTION:
        raise IllegalTransition(f"finish_execution needs a terminal status, got {status}")
    values: dict[str, Any] = {"result": result, "error": error, "completed_at": utcnow()}
    for key, value in (
        ("final_message_id", final_message_id),
        ("rounds", rounds),
        ("total_tool_calls", total_tool_calls),
        ("prompt_tokens", prompt_tokens),
        ("completion_tokens", completion_tokens),
    ):
        if value is not None:
            values[key] = value
    if prompt_tokens is not None and completion_tokens is not None:
        values["total_tokens"] = prompt_tokens + completion_tokens
    stmt = _finish_stmt(status, tuple(values), identity_for())
    rows = cas(s, stmt, {**{f"v_{k}": v for k, v in values.items()}, "b_eid": eid, "b_epoch": epoch})
    if rows == 1:
        return True
    if superseded(s):
        return False  # replaced under its worker name: the newer process finishes it
    _classify(s, eid, epoch, f"finish as {status}")
    return False


def fence_execution(
    s: Session, eid: int, *, epoch: int, lease_seconds: float, prompt_tokens: int = 0, completion_tokens: int = 0
) -> bool:
    """Inside a child loop's write transaction (or its heartbeat): renew the lease of the
    epoch's owner and add a reply's token usage. False, nothing written, when the epoch moved
    on, the execution is no longer active, this process was replaced under its name, or
    (PostgreSQL) the lease it would write is already past in the database's time: this
    process's clock stood still (a suspended host), and the clock is measured again."""
    params = {
        "b_eid": eid,
        "b_epoch": epoch,
        "b_until": utcnow() + timedelta(seconds=lease_seconds),
        "b_prompt": prompt_tokens,
        "b_completion": completion_tokens,
    }
    pg = s.get_bind().dialect.name == "postgresql"
    if cas(s, _fence_stmt(identity_for(), pg), params) == 1:
        return True
    db_clock.refused_as_lapsed(s, params["b_until"])
    return False


@built_once
def _fence_stmt(me: tuple[str, int] | None, pg: bool) -> Any:
    in_time = (db_clock.in_time(bindparam("b_until", type_=UTCDateTime())),) if pg else ()
    return (
        update(E)
        .where(
            E.id == bindparam("b_eid"),
            E.epoch == bindparam("b_epoch"),
            E.status.in_(ACTIVE_EXECUTION),
            *still_current_as(me),
            *in_time,
        )
        .values(
            lease_expires_at=bindparam("b_until"),
            prompt_tokens=E.prompt_tokens + bindparam("b_prompt"),
            completion_tokens=E.completion_tokens + bindparam("b_completion"),
            total_tokens=E.total_tokens + bindparam("b_prompt") + bindparam("b_completion"),
        )
        .execution_options(synchronize_session=False)
    )


def create_execution_row(
    s: Session,
    *,
    parent_id: int,
    child_id: int,
    agent_type: str,
    task: str,
    invocation: InvocationType,
    tool_call_id: str,
    start_message_id: int,
    pending_round_id: int | None,
    lease_seconds: float,
) -> int:
    """Insert the execution row (epoch 0, the creation reservation); its id."""
    now = utcnow()
    booted = identity()
    values = dict(
        parent_session_id=parent_id,
        child_session_id=child_id,
        agent_type=agent_type,
        task_description=task,
        status=ExecutionStatus.RUNNING,
        delivery_status=DeliveryStatus.PENDING,  # always explicit; the default is only a backstop
        invocation_type=invocation,
        parent_tool_call_id=tool_call_id,
        execution_start_message_id=start_message_id,
        started_at=now,
        pending_round_id=pending_round_id,
        # A reservation for the epoch-0 message (agent.run_child), not an owner: it covers
        # the enqueue window so the scan leaves it alone. It names the creating worker's boot
        # identity: when that worker restarts under its name, the reservation is known dead at
        # once (a broker that lost the message then costs no lease wait).
        lease_owner=booted[0] if booted else None,
        lease_generation=booted[1] if booted else None,
        lease_expires_at=now + timedelta(seconds=lease.reservation_seconds(lease_seconds)),
        epoch=0,
    )
    return int(s.execute(_insert_stmt(), values).scalar_one())


@built_once
def _insert_stmt() -> Any:
    table = cast(Table, SubagentExecution.__table__)
    return insert(table).returning(table.c.id)


def store_inferred(s: Session, eid: int, *, invocation: InvocationType | None, tool_call_id: str | None) -> None:
    """Write back what the legacy inference found (models.legacy) where the row still has NULL, so
    a concurrent writer is never overwritten (``None``: nothing to write for that column)."""
    if invocation is not None:
        s.execute(
            update(E)
            .where(E.id == eid, E.invocation_type.is_(None))
            .values(invocation_type=invocation)
            .execution_options(synchronize_session=False)
        )
    if tool_call_id is not None:
        s.execute(
            update(E)
            .where(E.id == eid, E.parent_tool_call_id.is_(None))
            .values(parent_tool_call_id=tool_call_id)
            .execution_options(synchronize_session=False)
        )


def mark_delivered(s: Session, eid: int, *, assistant_message_id: int | None, tool_message_id: int | None) -> bool:
    """PENDING -> DELIVERED for a terminal execution. False when already delivered/suppressed.

    Raises IllegalTransition for an execution that is still active (barrier, I3) or LEGACY.
    """
    rows = cas(
        s,
        update(E)
        .where(
            E.id == eid,
            E.delivery_status == DeliveryStatus.PENDING,
            E.status.in_(TERMINAL_EXECUTION),
        )
        .values(
            delivery_status=DeliveryStatus.DELIVERED,
            parent_result_delivered_at=utcnow(),
            parent_assistant_message_id=assistant_message_id,
            parent_tool_message_id=tool_message_id,
        ),
    )
    if rows == 1:
        return True
    row = s.execute(select(E.status, E.delivery_status).where(E.id == eid)).one_or_none()
    if row is not None and row.delivery_status in (DeliveryStatus.DELIVERED, DeliveryStatus.SUPPRESSED):
        return False
    _classify(s, eid, None, "mark delivered")
    return False


def mark_all_delivered(s: Session, tool_message_ids: dict[int, int], *, assistant_message_id: int) -> None:
    """PENDING -> DELIVERED for every execution of one delivered round, in ONE statement
    (execution id -> its TOOL message id). When it does not land on every row, each row is
    classified as ``mark_delivered`` does (IllegalTransition for one still active or LEGACY;
    a row already delivered or suppressed is left as it is)."""
    if not tool_message_ids:
        return
    marks = {eid: (assistant_message_id, tool_id) for eid, tool_id in tool_message_ids.items()}
    if mark_rounds_delivered(s, marks) == len(tool_message_ids):
        return
    for eid, tool_id in tool_message_ids.items():
        mark_delivered(s, eid, assistant_message_id=assistant_message_id, tool_message_id=tool_id)


def mark_rounds_delivered(s: Session, marks: dict[int, tuple[int, int]]) -> int:
    """PENDING -> DELIVERED for the executions of several parents' delivered rounds, in ONE
    statement (execution id -> (its round's ASSISTANT id, its TOOL id)). Returns how many rows
    it moved: fewer than ``len(marks)`` means some row was not a terminal PENDING execution,
    and the caller (which holds the rows' locks and read them so) rolls back."""
    if not marks:
        return 0
    params: dict[str, Any] = {"now": utcnow()}
    for n, (eid, (assistant_id, tool_id)) in enumerate(marks.items()):
        params[f"e{n}"], params[f"a{n}"], params[f"t{n}"] = eid, assistant_id, tool_id
    return cas(s, _mark_rounds_delivered_stmt(len(marks)), params)


@built_once
def _mark_rounds_delivered_stmt(n: int) -> Any:
    """mark_rounds_delivered's compare-and-set for ``n`` executions."""
    ids = [bindparam(f"e{i}", type_=BigInteger()) for i in range(n)]
    return (
        update(E)
        .where(E.id.in_(ids), E.delivery_status == DeliveryStatus.PENDING, E.status.in_(TERMINAL_EXECUTION))
        .values(
            delivery_status=DeliveryStatus.DELIVERED,
            parent_result_delivered_at=bindparam("now"),
            parent_assistant_message_id=case(
                {ids[i]: bindparam(f"a{i}", type_=BigInteger()) for i in range(n)}, value=E.id
            ),
            parent_tool_message_id=case({ids[i]: bindparam(f"t{i}", type_=BigInteger()) for i in range(n)}, value=E.id),
        )
        .execution_options(synchronize_session=False)
    )


def suppress_execution(s: Session, eid: int) -> bool:
    """PENDING -> SUPPRESSED; an active execution is cancelled in the same UPDATE (the parent is stopped).

    Bumps the epoch so that a child still running under the old epoch can no longer write.
    Returns False when the row was already delivered or suppressed.
    """

    rows = cas(
        s,
        update(E)
        .where(E.id == eid, E.delivery_status == DeliveryStatus.PENDING)
        .values(
            delivery_status=DeliveryStatus.SUPPRESSED,
            status=case((E.status.in_(ACTIVE_EXECUTION), ExecutionStatus.CANCELLED.value), else_=E.status),
            completed_at=case((E.status.in_(ACTIVE_EXECUTION), utcnow()), else_=E.completed_at),
            epoch=E.epoch + 1,
            lease_owner=None,
            lease_expires_at=None,
        ),
    )
    if rows == 1:
        return True
    row = s.execute(select(E.delivery_status).where(E.id == eid)).one_or_none()
    if row is not None and row.delivery_status in (DeliveryStatus.DELIVERED, DeliveryStatus.SUPPRESSED):
        return False
    _classify(s, eid, None, "suppress")
    return False


def set_delivery_status(s: Session, eid: int, to: DeliveryStatus) -> bool:
    """Generic delivery move, for callers holding only a target (ops, tests).

    PENDING and LEGACY have no legal source: asking for them always raises.
    """
    if to == DeliveryStatus.DELIVERED:
        return mark_delivered(s, eid, assistant_message_id=None, tool_message_id=None)
    if to == DeliveryStatus.SUPPRESSED:
        return suppress_execution(s, eid)
    raise IllegalTransition(f"execution {eid}: delivery_status can never move to {to}")
