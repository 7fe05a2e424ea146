"""Several parents' rounds delivered by one task (task ``agent.deliver_rounds``), each exactly
once (docs/invariants.md, I1).

``deliver_rounds(parents)`` takes (parent_id, epoch) pairs, as the scan hands them out, and
delivers the common case of all of them in ONE transaction of a fixed number of statements,
whatever the number of parents:
1. lock the parents (ascending id, ``SKIP LOCKED``: a parent another path holds is never waited
   for here);
2. read their PENDING executions and their open rounds (locked), and their live history;
3. keep the parents whose delivery is the common case: the epoch handed, no lease owner, not
   stopped, no compaction boundary, every PENDING execution terminal and a member of the open
   round, a clean tail;
4. write every kept round (one INSERT of every assistant and TOOL), mark every member
   DELIVERED, close every round and hand every parent a new epoch: each a compare-and-set over
   the rows, whose rowcount must be the number of rows (else everything rolls back).
Every other parent (and every parent, when that transaction fails) is delivered on its own by
``harness.delivery.deliver_round``, which handles each case (stale, busy, stopped, waiting,
legacy rows, tail repair, an invalid boundary) in its own transactions: a failure of one
parent never loses nor doubles another's result, because a rolled-back batch wrote nothing,
and every later attempt re-checks under the parent's lock. A batch whose COMMIT raised may still
have landed (its answer lost on the way back): one read of a row it inserted tells, and a batch
that landed is resumed as one that answered (``_landed_after_all``). A parent whose own delivery
raises holds back no other parent's run: ``deliver_rounds_and_resume`` sends every run first,
then raises.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.delivery import DeliveryKind, DeliveryOutcome, deliver_round, round_results
from harness.history import tail_garbage
from harness.rounds import RoundWrite, write_rounds
from harness.scheduler import Scheduler
from logfmt import log_event
from models import (
    ACTIVE_EXECUTION,
    STOPPED_PHASES,
    AgentSession,
    DeliveryStatus,
    Message,
    PendingRound,
    Phase,
    SubagentExecution,
    lease,
    transaction,
)
from models.db import built_once, ids_param
from models.errors import IllegalTransition
from models.execution import mark_rounds_delivered
from models.round import close_rounds
from models.session import hand_over_many, lock_unheld_stmt

log = logging.getLogger(__name__)
E, S = SubagentExecution, AgentSession


@dataclass
class _Parent:
    """One parent of the batch as its transaction read it."""

    id: int
    epoch: int
    pending: list[SubagentExecution]
    rnd: PendingRound | None = None


def deliver_rounds(parents: Sequence[tuple[int, int]]) -> dict[int, DeliveryOutcome]:
    """Deliver each (parent_id, epoch) exactly once; {parent_id: outcome} (see the module doc).
    A parent named twice is delivered once (the first pair counts). Raises only what
    ``deliver_round`` raises for a parent on its own (an infrastructure error), after every
    other parent had its turn."""
    outcomes, failure = _deliver_each(parents)
    if failure is not None:
        raise failure
    return outcomes


def _deliver_each(parents: Sequence[tuple[int, int]]) -> tuple[dict[int, DeliveryOutcome], Exception | None]:
    """``deliver_rounds`` that returns the first error of a parent's own delivery beside the
    outcomes of every other parent, instead of raising it."""
    wanted: dict[int, int] = {}
    for parent_id, epoch in parents:
        wanted.setdefault(int(parent_id), int(epoch))
    together: dict[int, _Delivered] = {}
    if len(wanted) > 1:
        written: dict[int, _Delivered] = {}
        try:
            with transaction() as s:
                written = _deliver_together(s, wanted)
            together = written
        except Exception:
            # NOTE: an error at the COMMIT itself (the connection lost while the server
            # answered) does not say whether it landed: when the transaction got as far as its
            # writes, one read of a row it inserted tells. A batch that landed is the
            # batch's to resume (its parents' own deliveries would find them STALE).
            log_event(log, "deliver_rounds_batch_failed", logging.WARNING, exc_info=True, parents=len(wanted))
            together = _landed_after_all(written)
    outcomes: dict[int, DeliveryOutcome] = {}
    for parent_id, done in together.items():
        for eid, call_id in done.members:
            log_event(log, "subagent_result_delivered", execution_id=eid, parent_id=parent_id, tool_call_id=call_id)
        outcomes[parent_id] = done.outcome
    for parent_id, done in together.items():
        crash_point("deliver.before_resume")
        log_event(
            log,
            "parent_recovery_start",
            parent_id=parent_id,
            epoch=done.outcome.new_epoch,
            delivered=len(done.outcome.delivered),
        )
    failure: Exception | None = None
    for parent_id, epoch in sorted(wanted.items()):
        if parent_id in outcomes:
            continue
        try:
            outcomes[parent_id] = deliver_round(parent_id, epoch)
        except Exception as exc:  # one parent's fault: the others still get theirs
            log_event(log, "deliver_round_failed", logging.WARNING, exc_info=True, parent_id=parent_id)
            failure = failure or exc
    return outcomes, failure


def _landed_after_all(written: dict[int, _Delivered]) -> dict[int, _Delivered]:
    """``written`` when the batch transaction that wrote it committed although its caller got an
    error, else nothing. The batch is one transaction: the assistant row it inserted for one
    parent exists exactly when all of it landed (an id is never reused, a rolled-back insert
    leaves no row). When the read itself fails, nothing is assumed: each parent then goes on
    its own, and one the batch did hand over is resumed by the scan once its reservation lapses.

    NOTE: the server may still be finishing that transaction when the client already saw its
    connection die (the COMMIT on its way, the backend not yet done): its rows are invisible
    until then, and reading at once could answer "not landed" for a commit that lands a moment
    later. So the parent's row is locked first: that waits until the batch's transaction has
    ended either way (it holds that row's lock to its end; the wait is bounded by the
    connection's lock timeout), and the next statement's snapshot sees its outcome."""
    if not written:
        return {}
    parent_id, done = next(iter(written.items()))
    try:
        with transaction() as s:
            s.execute(select(AgentSession.id).where(AgentSession.id == parent_id).with_for_update()).first()
            landed = s.execute(select(Message.id).where(Message.id == done.assistant_id)).first() is not None
    except Exception:
        log_event(log, "deliver_rounds_commit_unknown", logging.WARNING, exc_info=True, parents=len(written))
        return {}
    log_event(log, "deliver_rounds_commit_checked", landed=landed, parents=len(written))
    return written if landed else {}


@dataclass(frozen=True)
class _Delivered:
    """A parent delivered by the batch: its outcome, and its members (execution id, call id)."""

    outcome: DeliveryOutcome
    members: tuple[tuple[int, str | None], ...]
    assistant_id: int  #: the assistant row the batch inserted for this parent


def _deliver_together(s: Session, wanted: dict[int, int]) -> dict[int, _Delivered]:
    """In ``s``: the common case of every parent of ``wanted`` (parent id -> epoch), written
    whole; the parents it delivered. Raises IllegalTransition (rolling everything back) when a
    compare-and-set does not land on every row it must."""
    ids = sorted(wanted)
    ready: dict[int, _Parent] = {}
    for row in s.execute(lock_unheld_stmt(_PARENT_FACTS), {"b_ids": ids}).all():
        if (
            row.epoch == wanted[row.id]
            and row.lease_owner is None
            and row.phase not in STOPPED_PHASES
            and row.compaction_boundary_message_id is None
        ):
            ready[row.id] = _Parent(row.id, row.epoch, [])
    if not ready:
        return {}
    params = {"b_ids": sorted(ready)}
    for execution in s.execute(_pending_stmt(), params).scalars():
        ready[execution.parent_session_id].pending.append(execution)
    for rnd in s.execute(_open_rounds_stmt(), params).scalars():
        ready[rnd.session_id].rnd = rnd
    histories: dict[int, list[Message]] = defaultdict(list)
    for message in s.execute(_history_stmt(), params).scalars():
        histories[message.session_id].append(message)
    kept = [p for p in ready.values() if _common_case(p, histories[p.id])]
    if not kept:
        return {}
    members = [round_results(p.rnd, p.pending) for p in kept if p.rnd is not None]
    written = write_rounds(
        s,
        [
            RoundWrite(p.id, p.rnd.assistant_content, p.rnd.tool_calls, results, p.rnd.provider_fields)
            for p, (_, results) in zip(kept, members, strict=True)
            if p.rnd is not None
        ],
    )
    crash_point("deliver.batch_mid_round")
    marks = {
        m.id: (assistant_id, tool_ids[str(m.parent_tool_call_id)])
        for (assistant_id, tool_ids), (ordered, _) in zip(written, members, strict=True)
        for m in ordered
    }
    if mark_rounds_delivered(s, marks) != len(marks):
        raise IllegalTransition("an execution of the batch was not a terminal PENDING one")
    if close_rounds(s, [p.rnd.id for p in kept if p.rnd is not None]) != len(kept):
        raise IllegalTransition("a round of the batch was closed already")
    epochs = hand_over_many(
        s, {p.id: p.epoch for p in kept}, to_phase=Phase.RUNNING, reserve_seconds=lease.reservation_seconds()
    )
    if len(epochs) != len(kept):
        raise IllegalTransition("a parent of the batch was not held at its epoch")
    return {
        p.id: _Delivered(
            DeliveryOutcome(DeliveryKind.RESUME, new_epoch=epochs[p.id], delivered=tuple(m.id for m in ordered)),
            tuple((m.id, m.parent_tool_call_id) for m in ordered),
            assistant_id,
        )
        for p, (ordered, _), (assistant_id, _ids) in zip(kept, members, written, strict=True)
    }


def _common_case(p: _Parent, history: list[Message]) -> bool:
    """Whether the batch delivers ``p``: an open round, every PENDING execution terminal and a
    member of it, and a clean tail. Anything else is ``deliver_round``'s (alone)."""
    if p.rnd is None or not p.pending:
        return False
    rnd_id = p.rnd.id
    if any(e.status in ACTIVE_EXECUTION or e.pending_round_id != rnd_id for e in p.pending):
        return False
    return not tail_garbage(history)


#: What the lock reads of each parent to know whether its batch may deliver it.
_PARENT_FACTS = ("epoch", "lease_owner", "phase", "compaction_boundary_message_id")


@built_once
def _pending_stmt() -> Any:
    return (
        select(E)
        .where(
            E.parent_session_id.in_(ids_param()),
            E.delivery_status == DeliveryStatus.PENDING,
        )
        .order_by(E.id)
        .with_for_update()
    )


@built_once
def _open_rounds_stmt() -> Any:
    R = PendingRound
    return select(R).where(R.session_id.in_(ids_param()), R.closed_at.is_(None)).with_for_update()


@built_once
def _history_stmt() -> Any:
    """The parents' live rows, in history order (no boundary: the batch takes no compacted parent)."""
    return (
        select(Message)
        .where(Message.session_id.in_(ids_param()), Message.deleted.is_(False))
        .order_by(Message.session_id, Message.id)
    )


def deliver_rounds_and_resume(parents: Sequence[tuple[int, int]], scheduler: Scheduler) -> dict[int, DeliveryOutcome]:
    """``deliver_rounds``, then each parent handed a new epoch is sent its run, also when
    another parent's own delivery raised (that error is raised after the runs were sent). A
    broker error there loses nothing: the parent waits RUNNING under a reservation and the
    scan resumes it once that lapses (R18)."""
    outcomes, failure = _deliver_each(parents)
    for parent_id, outcome in sorted(outcomes.items()):
        if outcome.kind != DeliveryKind.RESUME or outcome.new_epoch is None:
            continue
        try:
            scheduler.resume_parent(parent_id, outcome.new_epoch)
        except Exception as exc:
            log_event(log, "parent_resume_not_enqueued", logging.WARNING, parent_id=parent_id, error=type(exc).__name__)
    if failure is not None:
        raise failure
    return outcomes
