"""Moving session trees to another release on purpose (``agent-recovery sessions upgrade``,
docs/releases.md, "Moving sessions").

1. ``plan``: the live top-level sessions to move (by agent, by their release), each with the
   pending approvals of its tree whose tool the target release does not have.
2. ``apply``: such approvals are denied through the ordinary deny path (the model gets
   ``denied by NAME: REASON``), then each tree is marked with its target by ONE conditional
   UPDATE of its root (``models.release.mark_upgrade``); the move itself happens at the root's
   next round boundary (a round never mixes releases). Every attempt is one ``operator_action``
   row naming who asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.agents import DELEGATION_TOOLS
from harness.release import current_release_id
from models.release import release_definition


@dataclass(frozen=True)
class OrphanApproval:
    """A pending approval whose tool the target release does not have."""

    session_id: int
    call_id: str
    tool: str


@dataclass(frozen=True)
class Tree:
    """A live top-level session to move, with its tree's orphaned approvals."""

    session_id: int
    agent_type: str
    release_id: int
    orphans: tuple[OrphanApproval, ...] = ()


@dataclass(frozen=True)
class Plan:
    to_release: int
    trees: tuple[Tree, ...] = field(default_factory=tuple)
    #: Live top-level sessions left where they are: the target release has no such agent.
    agent_missing: tuple[int, ...] = ()

    @property
    def orphans(self) -> tuple[OrphanApproval, ...]:
        return tuple(o for t in self.trees for o in t.orphans)


class MarkOutcome(StrEnum):
    """What ``apply`` did with one tree (``operator_action.outcome`` of its ``upgrade`` row)."""

    SCHEDULED = "scheduled"  #: the tree moves at its root's next round boundary
    #: nothing written: it stopped, it is on the target already, or left the ``--from`` release
    UNCHANGED = "unchanged"


def target_release(s: Session, to: str) -> int | None:
    """``current`` (the release of this process's configuration, stored if new: run the command
    with the workers' AGENTS_FILE and TOOL_MODULES) or a release id; None when no such release."""
    if to == "current":
        return current_release_id(s)
    if not to.isdigit():
        return None
    return int(to) if release_definition(s, int(to)) is not None else None


def _has_tool(definition: dict[str, Any], agent_type: str, tool: str) -> bool:
    """Whether ``agent_type`` of a release can still call ``tool``: a Python tool the release
    has, a delegation, or a tool of an MCP server of that agent (matched by its server name)."""
    if tool in definition.get("tools", {}) or tool in DELEGATION_TOOLS:
        return True
    if "__" in tool:
        servers = {m["name"] for m in definition.get("agents", {}).get(agent_type, {}).get("mcp_servers", [])}
        return tool.split("__", 1)[0] in servers
    return False


def plan(s: Session, *, to_release: int, agent: str | None = None, from_release: int | None = None) -> Plan:
    """The trees ``apply`` would mark, oldest first, each with its orphaned approvals (a session
    whose agent the target release does not have is left out, named in ``agent_missing``)."""
    from models.approval import ApprovalRequest, ApprovalStatus
    from models.enums import SessionType
    from models.release import tree_ids
    from models.session import AgentSession as S
    from models.session import not_stopped

    found = release_definition(s, to_release)
    definition = {} if found is None else found[1]
    query = select(S.id, S.agent_type, S.release_id).where(
        S.session_type != SessionType.SUBAGENT,
        not_stopped(),
        S.release_id.is_not(None),
        S.release_id != to_release,
    )
    if agent is not None:
        query = query.where(S.agent_type == agent)
    if from_release is not None:
        query = query.where(S.release_id == from_release)
    trees, agent_missing = [], []
    for root in s.execute(query.order_by(S.id)).all():
        if root.agent_type not in definition.get("agents", {}):
            agent_missing.append(int(root.id))
            continue
        pending = s.execute(
            select(ApprovalRequest.session_id, ApprovalRequest.call_id, ApprovalRequest.tool, S.agent_type)
            .join(S, S.id == ApprovalRequest.session_id)
            .where(ApprovalRequest.session_id.in_(tree_ids(root.id)), ApprovalRequest.status == ApprovalStatus.PENDING)
            .order_by(ApprovalRequest.id)
        ).all()
        orphans = tuple(
            OrphanApproval(int(p.session_id), p.call_id, p.tool)
            for p in pending
            if not _has_tool(definition, p.agent_type, p.tool)
        )
        trees.append(Tree(int(root.id), root.agent_type, int(root.release_id), orphans))
    return Plan(to_release, tuple(trees), tuple(agent_missing))


def orphan_reason(o: OrphanApproval, to_release: int) -> str:
    return f"tool {o.tool} is not in release {to_release} (sessions upgrade)"


def apply(p: Plan, *, by: str) -> dict[int, MarkOutcome]:
    """Deny every orphaned approval of ``p`` (the ordinary deny path: recorded, the session
    handed back when nothing else of it is pending), then mark each tree; one ``upgrade``
    ``operator_action`` row per tree. Returns each root's outcome."""
    from models import transaction
    from models.operator_action import record
    from models.release import mark_upgrade
    from tasks.approval import deny

    for o in p.orphans:
        deny(o.session_id, o.call_id, reason=orphan_reason(o, p.to_release), by=by)
    done: dict[int, MarkOutcome] = {}
    for tree in p.trees:
        with transaction() as s:
            landed = mark_upgrade(s, tree.session_id, to_release=p.to_release, from_release=tree.release_id)
            outcome = MarkOutcome.SCHEDULED if landed else MarkOutcome.UNCHANGED
            record(s, actor=by, action="upgrade", outcome=str(outcome), session_id=tree.session_id)
        done[tree.session_id] = outcome
    return done
