"""`delegate` / `delegate_followup`: atomic creation of a child execution (docs/tasks.md, "The normal path").

Each call runs inside the parent's round transaction: child session (first delegate), child
USER message, execution row (RUNNING, PENDING, invocation_type, parent_tool_call_id,
execution_start_message_id, started_at) all land together or not at all. A refused call
(unknown agent, busy child, bad arguments) becomes the TOOL error of that call and leaves no
orphan row: a `delegate` is refused before it writes anything (its checks need no database), so
it needs no savepoint; a `delegate_followup` is refused by a compare-and-set on the child, after
which it may have cleaned the child's tail, so it runs in its own SAVEPOINT. The rows are
written with Core statements (no unit of work on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.errors import HarnessError, ToolError, UnknownAgent
from harness.history import append_message, cleanup_incomplete_tail, validated_boundary
from harness.release import session_agent
from harness.tools import arguments_of, lookup, parse_arguments
from models import (
    AgentSession,
    InvocationType,
    Role,
    SessionType,
)
from models.budget import allocate_child
from models.execution import create_execution_row
from models.session import create_child_session, reopen_child_for_followup


class DelegationRefused(HarnessError):
    """The delegation was refused; nothing was written."""


@dataclass(frozen=True)
class CreatedExecution:
    execution_id: int
    child_session_id: int
    tool_call_id: str
    invocation_type: InvocationType


def delegate_arguments(
    invocation: InvocationType, *, agent_type: str, child_session_id: int, task: str
) -> dict[str, Any]:
    """The tool arguments of a delegation, rebuilt the same way everywhere (legacy rows too)."""
    if invocation == InvocationType.DELEGATE:
        return {"agent_type": agent_type, "task": task}
    return {"child_session_id": child_session_id, "task": task}


def tool_name(invocation: InvocationType) -> str:
    return "delegate" if invocation == InvocationType.DELEGATE else "delegate_followup"


@dataclass(frozen=True)
class Parent:
    """What a delegation needs of its parent session: its id (a child's user is the parent's,
    copied by the child's INSERT itself), or ``user_id`` when the caller has it."""

    id: int
    user_id: str | None = None
    #: What one child may draw of the tree's token budget (the parent agent's ``child_budget``).
    child_cap: int | None = None
    #: The release the parent's round runs (its agent's; None: the worker's configuration). It
    #: defines the child's agent; the child session's INSERT copies the parent's column itself.
    release_id: int | None = None


def parent_of(s: Session, session_id: int, *, release_id: int | None, child_cap: int | None = None) -> Parent:
    """The parent of the delegations of ``session_id``'s round, whose agent runs ``release_id``
    (nothing read: only the holder of the parent's epoch moves its release, and its round's
    agent moves with it)."""
    return Parent(session_id, child_cap=child_cap, release_id=release_id)


@dataclass(frozen=True)
class _Call:
    """Where one delegation call stands: its tool call, the parent's round, the lease."""

    tool_call_id: str
    pending_round_id: int | None
    lease_seconds: float


def _start_execution(
    s: Session, parent: Parent, call: _Call, *, child_id: int, agent_type: str, task: str, invocation: InvocationType
) -> CreatedExecution:
    """The child's USER (the task) and the execution row: the last two writes of both kinds."""
    start = append_message(s, child_id, Role.USER, task)
    if parent.child_cap is not None:
        # Set aside in the delegating round's transaction; returned when this run ends.
        allocate_child(s, child_session_id=child_id, cap=parent.child_cap)
    crash_point("delegate.after_user_message")
    execution_id = create_execution_row(
        s,
        parent_id=parent.id,
        child_id=child_id,
        agent_type=agent_type,
        task=task,
        invocation=invocation,
        tool_call_id=call.tool_call_id,
        start_message_id=start,
        pending_round_id=call.pending_round_id,
        lease_seconds=call.lease_seconds,
    )
    return CreatedExecution(execution_id, child_id, call.tool_call_id, invocation)


def _delegate(s: Session, parent: Parent, args: dict[str, Any], call: _Call) -> CreatedExecution:
    agent_type, task = args.get("agent_type"), args.get("task")
    if not isinstance(agent_type, str) or not isinstance(task, str) or not task.strip():
        raise DelegationRefused("delegate needs string arguments 'agent_type' and a non-empty 'task'")
    try:
        # The parent's release defines the child's agent; the child takes that release.
        agent = session_agent(s, agent_type, parent.release_id)
    except UnknownAgent as exc:
        raise DelegationRefused(str(exc)) from None
    # NOTE: nothing below refuses: from here on only the database can fail, and that fails
    # the whole round's transaction (an infrastructure error), never just this call.
    child_id = create_child_session(
        s, parent_id=parent.id, agent_type=agent.name, execution_mode=agent.execution_mode, user_id=parent.user_id
    )
    crash_point("delegate.after_child_session")
    return _start_execution(
        s, parent, call, child_id=child_id, agent_type=agent.name, task=task, invocation=InvocationType.DELEGATE
    )


def _followup(s: Session, parent: Parent, args: dict[str, Any], call: _Call) -> CreatedExecution:
    child_id, task = args.get("child_session_id"), args.get("task")
    if isinstance(child_id, str) and child_id.isdigit():
        child_id = int(child_id)
    if not isinstance(child_id, int) or not isinstance(task, str) or not task.strip():
        raise DelegationRefused("delegate_followup needs an integer 'child_session_id' and a non-empty 'task'")
    child = s.execute(
        select(AgentSession).where(
            AgentSession.id == child_id,
            AgentSession.session_type == SessionType.SUBAGENT,
            AgentSession.parent_session_id == parent.id,
        )
    ).scalar_one_or_none()
    if child is None:
        raise DelegationRefused(f"session {child_id} is not a child session of this session")
    # The child's phase is taken by compare-and-set: a busy (or cancelled) child refuses.
    if not reopen_child_for_followup(s, child_id):
        raise DelegationRefused(f"child session {child_id} is busy or stopped; the follow-up was not sent")
    # The child's incomplete tail goes before the new instruction is added.
    cleanup_incomplete_tail(s, child_id, validated_boundary(s, child_id))
    return _start_execution(
        s, parent, call, child_id=child_id, agent_type=child.agent_type, task=task, invocation=InvocationType.FOLLOWUP
    )


def create_execution(
    s: Session,
    parent: Parent,
    *,
    name: str,
    raw_arguments: str,
    tool_call_id: str,
    pending_round_id: int | None,
    lease_seconds: float,
) -> CreatedExecution | str:
    """Create one delegation (a follow-up in a savepoint: see the module docstring). Returns
    the execution, or the TOOL error text."""
    spec = lookup(name)
    try:
        # What to fix, as for any tool (and counted against max_retries: harness.arguments).
        args = parse_arguments(raw_arguments) if spec is None else arguments_of(spec, raw_arguments)
    except ToolError as exc:
        return f"error: {exc}"
    call = _Call(tool_call_id, pending_round_id, lease_seconds)
    try:
        if name == "delegate":
            return _delegate(s, parent, args, call)
        with s.begin_nested():
            return _followup(s, parent, args, call)
    except DelegationRefused as exc:
        return f"error: {exc}"
