"""A child's facts at the take of its execution, read in the taker's transaction: the one
statement that reads them, and the one that also moves the child session's phase (a state
change, so it lives here with every other one)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, func, select, update

from models.db import built_once
from models.enums import Phase
from models.execution import SubagentExecution
from models.journal import has_open_entry
from models.session import AgentSession, child_not_cancelled, phase_in


@built_once
def child_facts_stmt() -> Any:
    """The facts a taker of an execution reads about its child (``harness.child.ChildInfo``),
    by ``b_eid``: the execution's columns, its child session's, and whether the child has an
    open round journal entry."""
    E = SubagentExecution
    S = AgentSession
    return (
        select(
            E.id,
            E.parent_session_id,
            E.child_session_id,
            E.agent_type,
            E.invocation_type,
            E.started_at,
            E.execution_start_message_id,
            S.execution_mode,
            S.user_id,
            E.task_description,
            S.compaction_boundary_message_id,
            S.compaction_summary,
            E.parent_tool_call_id,
            E.final_message_id,
            S.phase,
            S.model_outage_since,
            S.budget_root_id,
            S.held_tokens,
            S.cap_tokens,
            S.cap_used_tokens,
            S.release_id,
            S.release_wait_since,
            # Whether the child session has an open round journal entry (ChildInfo.journal_open).
            has_open_entry(E.child_session_id),
        )
        .join(S, S.id == E.child_session_id)
        .where(E.id == bindparam("b_eid"))
    )


@built_once
def child_facts_setting_phase_stmt(to_phase: Phase) -> Any:
    """:func:`child_facts_stmt` and the child session's phase moved to ``to_phase`` (a cancelled
    child stays cancelled: ``child_not_cancelled``) in ONE statement (PostgreSQL: a
    data-modifying WITH), by ``b_eid`` and ``b_now``."""
    facts = child_facts_stmt().cte("facts")
    moved = (
        update(AgentSession)
        .where(
            AgentSession.id == select(facts.c.child_session_id).scalar_subquery(),
            child_not_cancelled(),
        )
        .values(phase=to_phase, updated_at=bindparam("b_now"))
        .cte("moved")
    )
    # NOTE: PostgreSQL runs a data-modifying WITH whether or not the query reads it, and the
    # query's snapshot is the one before it ran (the facts show the previous phase).
    return select(facts).add_cte(moved)


@built_once
def child_facts_starting_stmt(to_phase: Phase, from_phases: tuple[Phase | None, ...]) -> Any:
    """:func:`child_facts_stmt` and the child session's phase moved to ``to_phase`` only from
    ``from_phases`` (a compare-and-set: any other phase is kept, as ``models.session.set_phase``
    does) in ONE statement (PostgreSQL: a data-modifying WITH), by ``b_eid`` and ``b_now``. Its
    ``phase_moved`` column is that compare-and-set's rowcount (0 or 1)."""
    facts = child_facts_stmt().cte("facts")
    moved = (
        update(AgentSession)
        .where(AgentSession.id == select(facts.c.child_session_id).scalar_subquery(), phase_in(from_phases))
        .values(phase=to_phase, updated_at=bindparam("b_now"))
        .returning(AgentSession.id)
        .cte("moved")
    )
    # NOTE: as in child_facts_setting_phase_stmt, the facts are the snapshot before the UPDATE
    # ran (the previous phase), and the UPDATE runs whether or not the query reads it.
    phase_moved = select(func.count()).select_from(moved).scalar_subquery().label("phase_moved")
    return select(facts, phase_moved)
