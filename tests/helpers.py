"""Row factories and bounded waits shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from crashpoints import armed_fault
from harness.history import pair_state
from harness.parent import run_agent
from harness.views import create_session
from models import (
    AgentSession,
    DeliveryStatus,
    ExecutionMode,
    ExecutionStatus,
    InvocationType,
    Phase,
    Role,
    SessionType,
    SubagentExecution,
    transaction,
)
from models.base import utcnow


def make_session(
    *,
    session_type: SessionType = SessionType.NORMAL,
    phase: Phase | None = Phase.RUNNING,
    agent_type: str = "main",
    parent_session_id: int | None = None,
    user_id: str = "u1",
    **extra: Any,
) -> int:
    with transaction() as s:
        row = AgentSession(
            user_id=user_id,
            session_type=session_type,
            parent_session_id=parent_session_id,
            agent_type=agent_type,
            phase=phase,
            started_at=utcnow(),
            updated_at=utcnow(),
            **extra,
        )
        s.add(row)
        s.flush()
        return row.id


def make_execution(
    parent_id: int,
    child_id: int | None = None,
    *,
    status: ExecutionStatus = ExecutionStatus.RUNNING,
    delivery: DeliveryStatus = DeliveryStatus.PENDING,
    tool_call_id: str | None = None,
    invocation: InvocationType | None = InvocationType.DELEGATE,
    agent_type: str = "reviewer",
    task: str = "review the change",
    started_ago_seconds: float = 0.0,
    **extra: Any,
) -> int:
    if child_id is None:
        child_id = make_session(
            session_type=SessionType.SUBAGENT, phase=None, agent_type=agent_type, parent_session_id=parent_id
        )
    with transaction() as s:
        row = SubagentExecution(
            parent_session_id=parent_id,
            child_session_id=child_id,
            agent_type=agent_type,
            task_description=task,
            status=status,
            delivery_status=delivery,
            invocation_type=invocation,
            parent_tool_call_id=tool_call_id,
            started_at=utcnow() - timedelta(seconds=started_ago_seconds),
            **extra,
        )
        s.add(row)
        s.flush()
        return row.id


def add_message(session_id: int, role: Role, content: str | None = "", **kw: Any) -> int:
    from harness.history import append_message

    with transaction() as s:
        return append_message(s, session_id, role, content, **kw)


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class RecordingScheduler:
    """A Scheduler that records instead of enqueueing: the test drives each step in-process."""

    def __init__(self) -> None:
        self.children: list[tuple[int, int, list[tuple[int, int]]]] = []
        self.recoveries: list[tuple[int, int, list[tuple[int, int]]]] = []
        self.deliveries: list[tuple[int, int]] = []
        self.resumed: list[tuple[int, int]] = []

    def start_children(self, parent_id: int, parent_epoch: int, children: Any) -> None:
        self.children.append((parent_id, parent_epoch, list(children)))

    def recover_many(self, rounds: Any) -> None:
        for parent_id, parent_epoch, children in rounds:
            self.recoveries.append((parent_id, parent_epoch, list(children)))

    def deliver_many(self, parents: Any) -> None:
        self.deliveries.extend(parents)

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        self.resumed.append((parent_id, epoch))

    def pending(self) -> bool:
        return bool(self.children or self.recoveries or self.deliveries or self.resumed)


def loop_deps(model_url: str, scheduler: RecordingScheduler | None = None, lease_seconds: float = 5.0) -> Any:
    from harness.loop import LoopDeps
    from harness.model import ModelClient

    model = ModelClient(model_url, "", "scripted", connect_timeout=2, read_timeout=30)
    return LoopDeps(
        scheduler=scheduler or RecordingScheduler(),
        model=model,
        owner="test",
        lease_seconds=lease_seconds,
    )


def messages_of(session_id: int) -> list[Any]:
    from sqlalchemy import select

    from models import Message

    with transaction() as s:
        return list(
            s.execute(
                select(Message).where(Message.session_id == session_id, Message.deleted.is_(False)).order_by(Message.id)
            ).scalars()
        )


def executions_of(parent_id: int) -> list[SubagentExecution]:
    from sqlalchemy import select

    with transaction() as s:
        return list(
            s.execute(
                select(SubagentExecution)
                .where(SubagentExecution.parent_session_id == parent_id)
                .order_by(SubagentExecution.id)
            ).scalars()
        )


def invariants(settled: bool = True) -> list[str]:
    from recovery.invariants import check_all

    with transaction() as s:
        return check_all(s, settled=settled)


def expire_leases() -> None:
    """Simulate the passage of time after a crash: every lease and reservation has lapsed."""
    from datetime import timedelta

    from sqlalchemy import update

    from models import AgentSession

    past = utcnow() - timedelta(seconds=1)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.lease_expires_at.is_not(None))
            .values(lease_expires_at=past)
        )
        s.execute(update(AgentSession).where(AgentSession.lease_expires_at.is_not(None)).values(lease_expires_at=past))


def drive(model_url: str, *, max_steps: int = 20, after_crash: bool = True, deps: Any = None) -> RecordingScheduler:
    """Run recovery and the normal path in-process until nothing is left to do: scan ->
    recover_child per execution (the last one asks for delivery) -> deliver_round -> agent
    loop (-> its own children) -> ..."""
    from recovery.scan import scan

    deps = deps or loop_deps(model_url)
    sched: RecordingScheduler = deps.scheduler
    for _ in range(max_steps):
        if after_crash:
            expire_leases()
        scan(sched, callback_grace_seconds=0)
        if not sched.pending():
            return sched
        while sched.pending():
            run_one_scheduled(deps)
    raise AssertionError("recovery did not settle")


def run_one_scheduled(deps: Any) -> None:
    """Run the oldest kind of work ``deps``' RecordingScheduler holds (recoveries first, then
    children's starts, deliveries, parents' runs), as the tasks would."""
    from harness.child import start_child
    from harness.delivery import deliver_and_resume
    from harness.parent import run_agent
    from recovery.child import recover_child

    sched: RecordingScheduler = deps.scheduler
    if sched.recoveries:
        _, _, children = sched.recoveries.pop(0)
        for eid, e in children:
            recover_child(eid, e, deps)
    elif sched.children:
        _, _, children = sched.children.pop(0)
        for eid, e in children:
            start_child(eid, e, deps)  # the last one delivers (no callback after them)
    elif sched.deliveries:
        parent, epoch = sched.deliveries.pop(0)
        deliver_and_resume(parent, epoch, sched)
    else:
        sid, e = sched.resumed.pop(0)
        run_agent(sid, e, deps)


def children_done_delivery_lost(model_url: str, text: str = "go") -> tuple[int, int]:
    """A parent that delegated and whose children all completed, but whose round was never
    delivered: the last child's worker died right after its final commit (child.after_final,
    before it could deliver the round itself). Returns
    (parent id, the epoch its deliver_round was handed)."""
    from crashpoints import InjectedKill
    from harness.child import start_child
    from harness.parent import run_agent
    from harness.views import create_session

    deps = loop_deps(model_url, RecordingScheduler())
    sid = create_session("main", text)
    assert run_agent(sid, 0, deps) == "yielded"
    _, epoch, children = deps.scheduler.children.pop()
    *first, (last, last_epoch) = children
    for eid, e in first:
        assert start_child(eid, e, deps) == "completed"
    with armed_fault("child.after_final", kill=True):
        try:
            start_child(last, last_epoch, deps)
        except InjectedKill:
            pass
        else:
            raise AssertionError("the last child did not reach child.after_final")
    assert not deps.scheduler.resumed  # nothing delivered
    return sid, epoch


# --- Recovery cases (docs/fault-model.md, R1-R25): scripts and probes shared by the test_recovery_* modules ---

MAIN = "main agent"


def one_child_script(child_reply: dict[str, Any] | None = None, task: str = "check X") -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": task}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done: {tool_results}"}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": child_reply or {"content": "reviewed"}},
    ]


def sessions_count(kind: SessionType) -> int:
    with transaction() as s:
        return len(s.execute(select(AgentSession.id).where(AgentSession.session_type == kind)).all())


def phase_of(sid: int) -> Phase | None:
    with transaction() as s:
        return s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one()


def rule_calls(model: Any, index: int) -> int:
    return sum(1 for j in model.journal() if j["rule"] == index)


def parent_yielded(model_url: str, text: str = "go") -> tuple[int, RecordingScheduler]:
    """A parent that delegated and whose worker died right after (its children never sent)."""
    deps = loop_deps(model_url)
    sid = create_session("main", text)
    assert run_agent(sid, 0, deps) == "yielded"
    return sid, deps.scheduler


def assert_one_delivered_pair(parent: int, execution: SubagentExecution) -> None:
    msgs = messages_of(parent)
    tools = [m for m in msgs if m.role == Role.TOOL and m.tool_call_id == execution.parent_tool_call_id]
    assert len(tools) == 1
    calls = [m for m in msgs if m.role == Role.ASSISTANT and execution.parent_tool_call_id in (m.tool_calls or "")]
    assert len(calls) == 1


TWO: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "a"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "b"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done"}},
    {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
]


def make_local(child_session_id: int) -> None:
    with transaction() as s:
        s.execute(
            update(AgentSession).where(AgentSession.id == child_session_id).values(execution_mode=ExecutionMode.LOCAL)
        )


def legacy_parent_with_child(*, status: ExecutionStatus = ExecutionStatus.RUNNING) -> tuple[int, int, int]:
    """Pre-upgrade shape: no invocation_type, no parent_tool_call_id, no start message id."""
    parent = make_session(phase=Phase.RUNNING)
    add_message(parent, Role.USER, "old request")
    child = make_session(
        session_type=SessionType.SUBAGENT, phase=Phase.RUNNING, agent_type="reviewer", parent_session_id=parent
    )
    add_message(child, Role.USER, "legacy task")
    eid = make_execution(
        parent,
        child,
        status=status,
        invocation=None,
        tool_call_id=None,
        task="legacy task",
        result={"success": True, "result": "old answer"} if status != ExecutionStatus.RUNNING else None,
    )
    return parent, child, eid


def execution_row(eid: int) -> SubagentExecution:
    with transaction() as s:
        return s.execute(select(SubagentExecution).where(SubagentExecution.id == eid)).scalar_one()


#: Two delegates around an inline tool in one round.
TWO_CHILDREN: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "a"}},
                {"name": "echo", "arguments": {"text": "inline"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "b"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final"}},
    {"when": {"system_contains": "subagent"}, "reply": {"content": "child result"}},
]


def yielded_with_children(model_url: str) -> tuple[int, int, list[tuple[int, int]], Any]:
    """A parent that delegated two children and yielded: (session, epoch, children, loop deps)."""
    sched = RecordingScheduler()
    deps = loop_deps(model_url, sched)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    _, epoch, children = sched.children.pop()
    return sid, epoch, children, deps


def redis_db_url(which: str = "broker") -> str:
    """This test process's ``broker``, ``backend`` or ``events`` Redis database (tests/conftest.py
    gives each xdist worker its own), for tests that talk to Redis without a Stack. Never a fixed
    database number: another worker, or another run on the same server, would share it."""
    import os

    broker, backend, events = os.environ["STACK_REDIS_DBS"].split(",")
    db = {"broker": broker, "backend": backend, "events": events}[which]
    return f"{os.environ['STACK_REDIS_URL']}/{db}"


def model_ids(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Local call id -> the model's own id, from a snapshot's assistant tool_calls (a call
    journaled before local ids existed maps to itself)."""
    out: dict[str, str] = {}
    for m in messages:
        for c in m.get("tool_calls") or ():
            out[c["id"]] = c.get("provider_id", c["id"])
    return out


def results_by_model_id(messages: list[dict[str, Any]]) -> dict[str, str]:
    """A snapshot's TOOL contents keyed by the model's own tool_call id."""
    ids = model_ids(messages)
    return {ids[m["tool_call_id"]]: m["content"] for m in messages if m["role"] == "TOOL"}


def installation_key(call_id: str) -> str:
    """The idempotency key of a local call id in the test database's installation."""
    import hashlib

    from models import installation_id, transaction

    with transaction() as s:
        space = installation_id(s)
    return hashlib.sha256(f"{space}:{call_id}".encode()).hexdigest()


def approval_environment(monkeypatch: Any, tmp_path: Any, agents_toml: str) -> Iterator[Any]:
    """For an approval fixture: AGENTS_FILE (``agents_toml``) and TOOL_MODULES
    (``tests.approval_tools``: ``refund`` needs approval) for this process and every worker it
    starts; yields the file each run of ``refund`` appends a line to."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml, encoding="utf-8")
    runs = tmp_path / "refund.log"
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    monkeypatch.setenv("TOOL_MODULES", "tests.approval_tools")
    monkeypatch.setenv("APPROVAL_TOOL_LOG", str(runs))
    get_settings.cache_clear()
    _load.cache_clear()
    yield runs
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


def find_complete_pair(s: Session, session_id: int, tool_call_id: str) -> tuple[int, int] | None:
    """(assistant_id, tool_id) of a complete pair for the id on raw rows, else None.

    Malformed tool_calls JSON counts as incomplete. Delivery asks ``pair_state`` (which also
    names the rows to repair); this answer is the complete-pair half of it.
    """
    state = pair_state(s, session_id, tool_call_id)
    if state.assistant_id is not None and state.tool_id is not None:
        return state.assistant_id, state.tool_id
    return None


@contextmanager
def recorded_statements() -> Iterator[list[str]]:
    """The SQL every connection of the engine sends meanwhile, each on one line (whitespace
    folded), in order."""
    from models import get_engine

    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(" ".join(statement.split()))

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


@contextmanager
def infra_fault_at(module: Any, point: str) -> Iterator[None]:
    """Inside the block, ``module``'s crash point ``point`` raises an infrastructure error (an
    OperationalError): the run stops there as a killed worker's would, writing nothing after the
    point's commit, and the test process lives on to take the work back."""
    from sqlalchemy import exc as sa_exc

    real = module.crash_point

    def crash(name: str) -> None:
        if name == point:
            raise sa_exc.OperationalError("crash", None, Exception(f"simulated crash at {point}"))
        real(name)

    module.crash_point = crash
    try:
        yield
    finally:
        module.crash_point = real
