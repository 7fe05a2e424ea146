"""A property over interleavings (hypothesis, real PostgreSQL): approvals, denials, expiries,
cancels, scans and kills at the named approval points, in any order. Whatever happens, the tool
runs at most once and only after an approval, a decision is never lost or changed, and the
invariants hold; a delegation that needs approval creates its child once, only after an
approval, and nothing of its round runs before the decision."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update

from crashpoints import InjectedKill, armed_fault
from harness.approval import decide
from harness.cancel import cancel_session
from harness.child import start_child
from harness.delivery import deliver_and_resume
from harness.parent import run_agent
from harness.views import create_session
from models import ApprovalRequest, ApprovalStatus, Phase, transaction, utcnow
from models.approval import Decision
from recovery.child import recover_child
from recovery.scan import scan
from tests.helpers import (
    RecordingScheduler,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    messages_of,
    phase_of,
)
from tests.integration.test_approvals import (  # noqa: F401 (fixture)
    Runs,
    call,
    gate_delegations,
    parent_script,
    runs,
)
from tests.types import ModelFactory

#: Points a kill may hit: the reply's commit with its request, the park, a decision's commit
#: before its hand-over is sent, and the approved tool's start.
KILL_POINTS = (
    "approval.after_request",
    "approval.after_park",
    "approval.after_decision",
    "journal.after_tool_start",
    "approval.after_edited_call",
)
ACTIONS = st.one_of(
    st.sampled_from(["step", "step", "step", "approve", "approve_edited", "deny", "expire", "cancel", "scan"]),
    st.tuples(st.just("kill"), st.sampled_from(KILL_POINTS)),
)


def the_request(sid: int) -> ApprovalRequest | None:
    with transaction() as s:
        return s.execute(select(ApprovalRequest).where(ApprovalRequest.session_id == sid)).scalar_one_or_none()


class World:
    def __init__(self, model_url: str) -> None:
        self.deps = loop_deps(model_url, RecordingScheduler())
        self.sid = create_session("main", "go")
        self.deps.scheduler.resumed.append((self.sid, 0))
        self.armed: str | None = None

    def do(self, action: Any) -> None:
        if isinstance(action, tuple):
            self.armed = action[1]
            return
        point, self.armed = self.armed, None
        try:
            if point is None:
                self._do(action)
            else:
                with armed_fault(point, kill=True):
                    self._do(action)
        except InjectedKill:
            pass  # the process died there: nothing after the point ran, open transactions rolled back

    def _do(self, action: str) -> None:
        sched = self.deps.scheduler
        req = the_request(self.sid)
        if action == "step":
            if sched.resumed:
                sid, epoch = sched.resumed.pop(0)
                run_agent(sid, epoch, self.deps)
            else:
                self._scan()
        elif action == "scan":
            self._scan()
        elif action in ("approve", "deny") and req is not None:
            decide(self.sid, req.call_id, Decision(action == "approve", "hypo", "because"), sched)
        elif action == "approve_edited" and req is not None:
            decide(self.sid, req.call_id, Decision(True, "hypo", "because", {"amount": 25, "order": "A-1"}), sched)
        elif action == "expire":
            with transaction() as s:
                s.execute(
                    update(ApprovalRequest)
                    .where(ApprovalRequest.session_id == self.sid)
                    .values(expires_at=utcnow() - timedelta(seconds=1))
                )
        elif action == "cancel":
            cancel_session(self.sid)

    def _scan(self) -> None:
        expire_leases()  # time passes: every lease lapsed (a killed loop's too)
        scan(self.deps.scheduler, callback_grace_seconds=0)

    def settle(self) -> None:
        """Nobody decides any more: the request expires, and the system runs until at rest."""
        for _ in range(12):
            self.do("expire")
            self.do("step")
            if phase_of(self.sid) in (Phase.WAITING_USER, Phase.CANCELLED, Phase.FAILED):
                return
        raise AssertionError(f"session {self.sid} did not settle: {phase_of(self.sid)}")


@pytest.mark.timeout(600)
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=st.lists(ACTIONS, max_size=10))
def test_whatever_the_interleaving_the_tool_runs_at_most_once_and_only_after_an_approval(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
    actions: list[Any],
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30), call("echo", text="hi")))
    world = World(model.base_url)
    decisions: list[tuple[ApprovalStatus, str | None]] = []
    for action in actions:
        world.do(action)
        req = the_request(world.sid)
        if req is not None and req.status != ApprovalStatus.PENDING:
            decisions.append((req.status, req.decided_by))
    world.settle()
    mine = [r for r in runs.starts if r[1] == world.sid]
    req = the_request(world.sid)
    assert len(mine) <= 1, actions
    if mine:
        assert req is not None and req.status == ApprovalStatus.APPROVED, actions
        # It ran with the arguments the approval that stands gave: the approver's, or the model's.
        expected = json.loads(req.approved_arguments or req.arguments)
        assert mine[0][2] == expected, actions
    if req is not None and req.approved_arguments is not None and phase_of(world.sid) == Phase.WAITING_USER:
        (assistant,) = [m for m in messages_of(world.sid) if m.role == "ASSISTANT" and m.tool_calls]
        assert '\\"amount\\":25' in json.dumps(assistant.tool_calls), actions  # the approved call is in the history
    if req is not None:
        assert len(set(decisions)) <= 1, (actions, decisions)  # the first decision stands
        assert req.status != ApprovalStatus.PENDING or phase_of(world.sid) == Phase.CANCELLED, actions
    tool_rows = [m for m in messages_of(world.sid) if m.role == "TOOL"]
    if phase_of(world.sid) == Phase.WAITING_USER:
        assert len(tool_rows) == 2, actions
    assert invariants(settled=False) == [], actions


class DelegatingWorld(World):
    """The same actions over a parent whose reply delegates (the delegation needs approval; an
    inline call beside it does not): a ``step`` runs whatever the scheduler holds next (a
    parent run, a child, a recovery, a delivery), as workers would."""

    def _do(self, action: str) -> None:
        sched = self.deps.scheduler
        if action != "step" or sched.resumed:
            super()._do(action)
        elif sched.children:
            _, _, children = sched.children.pop(0)
            for eid, e in children:
                start_child(eid, e, self.deps)
        elif sched.recoveries:
            _, _, children = sched.recoveries.pop(0)
            for eid, e in children:
                recover_child(eid, e, self.deps)
        elif sched.deliveries:
            deliver_and_resume(*sched.deliveries.pop(0), sched)
        else:
            self._scan()

    def settle_all(self) -> None:
        """Nobody decides any more: requests expire, and whatever is left runs (a child, a
        delivery, the parent) until the parent is at rest with nothing more to run."""
        for _ in range(24):
            self.do("expire")
            self.do("step")
            rest = phase_of(self.sid) in (Phase.WAITING_USER, Phase.CANCELLED, Phase.FAILED)
            if rest and not self.deps.scheduler.pending():
                return
        raise AssertionError(f"session {self.sid} did not settle: {phase_of(self.sid)}")


#: The delegating round's own points beside the approval ones: the children's creation, and the
#: fenced start of the inline call beside the delegation; approvals weigh more, so that more
#: interleavings reach the creation.
DELEGATING_ACTIONS = st.one_of(
    st.sampled_from(["step", "step", "step", "approve", "approve", "deny", "expire", "cancel", "scan"]),
    st.tuples(st.just("kill"), st.sampled_from((*KILL_POINTS, "delegate.after_create", "parent.after_inline_start"))),
)


@pytest.mark.timeout(600)
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=st.lists(DELEGATING_ACTIONS, max_size=12))
def test_whatever_the_interleaving_a_delegation_that_needs_approval_creates_its_child_once_and_only_after_it(
    model_factory: ModelFactory,
    runs: Runs,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    actions: list[Any],
) -> None:
    gate_delegations(monkeypatch, tmp_path, '["delegate"]')
    model = model_factory(
        parent_script(call("delegate", agent_type="reviewer", task="t"), call("wire_money", amount=5))
    )
    world = DelegatingWorld(model.base_url)

    def mine() -> list[Any]:
        return [r for r in runs.starts if r[1] == world.sid]

    for action in ["step", *actions]:  # the parent's first run journals the reply and its request
        world.do(action)
        req = the_request(world.sid)
        if req is None or req.status == ApprovalStatus.PENDING:  # nothing of the round before a decision
            assert executions_of(world.sid) == [] and mine() == [], actions
    world.settle_all()
    req = the_request(world.sid)
    executions = executions_of(world.sid)
    assert len(executions) <= 1, actions
    if executions:
        assert req is not None and req.tool == "delegate" and req.status == ApprovalStatus.APPROVED, actions
    assert len(mine()) <= 1, actions  # the inline call beside the delegation: at most once
    assert phase_of(world.sid) != Phase.FAILED, actions  # nothing here fails the session
    if phase_of(world.sid) == Phase.WAITING_USER:
        assert len([m for m in messages_of(world.sid) if m.role == "TOOL"]) == 2, actions
        assert [e.delivery_status for e in executions] == (["DELIVERED"] if executions else []), actions
    assert invariants(settled=False) == [], actions
