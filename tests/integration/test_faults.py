"""In-process: faults that must never become results, and the guards around them.

Each test drives the real loop and recovery code against real PostgreSQL; a fault is injected
into the statement itself with a SQLAlchemy event (a connection cut mid-transaction looks the
same to our code: an OperationalError from the driver).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, text, update
from sqlalchemy.exc import OperationalError

from harness.child import start_child
from harness.delivery import deliver_round
from harness.parent import run_agent
from harness.views import create_session
from models import (
    AgentSession,
    ExecutionStatus,
    Message,
    Phase,
    Role,
    SubagentExecution,
    get_engine,
    transaction,
)
from models.base import utcnow
from recovery.child import recover_child
from recovery.scan import scan
from tests.helpers import (
    RecordingScheduler,
    children_done_delivery_lost,
    drive,
    executions_of,
    expire_leases,
    invariants,
    loop_deps,
    messages_of,
    redis_db_url,
    yielded_with_children,
)
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"
TWO: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "parent done"}},
    {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
]


@contextmanager
def statement_fault(pattern: str, times: int = 1) -> Iterator[list[str]]:
    """Raise OperationalError (as a cut connection does) the first ``times`` statements whose
    SQL contains ``pattern``, inside whatever transaction runs it."""
    engine = get_engine()
    hits: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        if pattern in statement and len(hits) < times:
            hits.append(statement)
            raise OperationalError(statement, params, Exception("server closed the connection unexpectedly"))

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield hits
    finally:
        event.remove(engine, "before_cursor_execute", before)


def test_a_database_error_while_finishing_a_child_writes_no_result_and_recovery_completes_it(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO)
    sid, _, children, deps = yielded_with_children(model.base_url)
    with statement_fault("UPDATE subagent_execution SET status") as hits:
        assert start_child(*children[0], deps) == "infra_error"
    assert hits
    first = executions_of(sid)[0]
    assert first.status == ExecutionStatus.RUNNING and first.result is None and first.error is None
    assert start_child(*children[1], deps) == "completed"
    drive(model.base_url)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert invariants() == []


def test_a_database_error_in_the_parent_round_leaves_the_parent_to_the_scan_not_failed(
    model_factory: ModelFactory,
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "answer"}}])
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with statement_fault("INSERT INTO message"):
        assert run_agent(sid, 0, deps) == "infra_error"
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one() == Phase.RUNNING
    drive(model.base_url)
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT"]
    assert invariants() == []


def test_a_database_error_during_recovery_writes_no_failure(model_factory: ModelFactory) -> None:
    model = model_factory(TWO)
    sid, _, _children, deps = yielded_with_children(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    ((_, _, reserved),) = sched.recoveries
    with statement_fault("INSERT INTO message"):
        assert recover_child(*reserved[0], deps) == "infra_error"
    e = executions_of(sid)[0]
    assert e.status in (ExecutionStatus.RECOVERING, ExecutionStatus.RUNNING) and e.error is None
    drive(model.base_url)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}


class _BrokerDown:
    def __init__(self, inner: RecordingScheduler) -> None:
        self.inner = inner

    def start_children(self, *_: Any) -> None:
        raise ConnectionError("broker unreachable after publish retries")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_broker_error_at_hand_off_does_not_fail_the_parent_and_the_scan_starts_the_children(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO)
    deps = loop_deps(model.base_url, _BrokerDown(RecordingScheduler()))  # type: ignore[arg-type]
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one() == Phase.RUNNING
    assert {e.status for e in executions_of(sid)} == {ExecutionStatus.RUNNING}
    sched = drive(model.base_url)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert messages_of(sid)[-1].content == "parent done" and not sched.pending()
    assert invariants() == []


def test_a_repeated_tool_call_id_becomes_that_calls_tool_error(model_factory: ModelFactory) -> None:
    call = {"id": "call_1", "name": "echo", "arguments": {"text": "x"}}
    model = model_factory(
        [
            {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": [call]}},
            {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"tool_calls": [call, call]}},
            {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_user"
    tools = [m for m in messages_of(sid) if m.role == Role.TOOL]
    assert len(tools) == 3 and len({m.tool_call_id for m in tools}) == 3
    # The id of an earlier round is a new call (it runs); the repeat inside the second reply
    # is the one refused.
    assert sum("repeated tool_call id" in (m.content or "") for m in tools) == 1
    assert [m.content for m in tools].count("x") == 2
    assert invariants() == []


def test_an_invalid_parent_boundary_stops_the_parent_instead_of_failing_forever(model_factory: ModelFactory) -> None:
    model = model_factory(TWO)
    sid, epoch = children_done_delivery_lost(model.base_url)
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(compaction_boundary_message_id=10**9))
    assert deliver_round(sid, epoch).kind == "stopped"
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one() == Phase.FAILED
    assert {e.delivery_status for e in executions_of(sid)} == {"SUPPRESSED"}
    assert deliver_round(sid, epoch).kind in ("stale", "suppressed")


def test_the_plain_resume_rechecks_nothing_pending_in_its_update(model_factory: ModelFactory) -> None:
    from recovery.scan import _take_plain

    model = model_factory(TWO)
    sid, _, _, _ = yielded_with_children(model.base_url)
    with transaction() as s:
        epoch = s.execute(select(AgentSession.epoch).where(AgentSession.id == sid)).scalar_one()
    expire_leases()
    # The SELECT of an earlier moment saw nothing pending; the take itself must refuse.
    assert _take_plain(sid, epoch) is None


def test_a_stalled_recoverer_cannot_move_a_finished_child_back_to_resuming(model_factory: ModelFactory) -> None:
    model = model_factory(TWO)
    _sid, _, _children, deps = yielded_with_children(model.base_url)
    expire_leases()
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    ((_, _, reserved),) = sched.recoveries
    eid, epoch = reserved[0]
    assert recover_child(eid, epoch, deps) == "completed"
    assert recover_child(eid, epoch, deps) == "stale"  # the late duplicate
    with transaction() as s:
        child = s.execute(select(SubagentExecution.child_session_id).where(SubagentExecution.id == eid)).scalar_one()
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == child)).scalar_one() == Phase.COMPLETED


def test_leases_are_written_in_the_databases_time_whatever_the_workers_clock(model_factory: ModelFactory) -> None:
    from models import clock

    model = model_factory(TWO)
    try:
        clock.set_local_skew(-600)  # this worker's clock is ten minutes slow
        _sid, _, children, deps = yielded_with_children(model.base_url)
        assert start_child(*children[0], deps) == "completed"
        with transaction() as s:
            db_now = s.execute(text("SELECT now()")).scalar_one()
            created = s.execute(
                select(SubagentExecution.started_at, SubagentExecution.lease_expires_at).where(
                    SubagentExecution.id == children[1][0]
                )
            ).one()
        assert abs((created.started_at - db_now).total_seconds()) < 5
        assert created.lease_expires_at > db_now  # a slow clock must not write leases already expired
        assert utcnow() - db_now < timedelta(seconds=5)
        report = scan(RecordingScheduler(), callback_grace_seconds=0)
        assert children[1][0] not in report.recovering  # healthy work does not look dead
    finally:
        clock.set_local_skew(0)


def test_a_followup_cleans_the_childs_incomplete_tail_before_its_instruction(model_factory: ModelFactory) -> None:
    model = model_factory(
        [
            {"when": {"system_contains": MAIN, "turn": 0}, "reply": TWO[0]["reply"]},
            {
                "when": {"system_contains": MAIN, "turn": 1},
                "reply": {
                    "tool_calls": [{"name": "delegate_followup", "arguments": {"child_session_id": 2, "task": "again"}}]
                },
            },
            {"when": {"system_contains": MAIN, "turn": 2}, "reply": {"content": "done"}},
            {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
        ]
    )
    sid, _epoch, children, deps = yielded_with_children(model.base_url)
    for child in children:
        start_child(*child, deps)  # the last one delivers the round and resumes the parent
    ((resumed, new_epoch),) = deps.scheduler.resumed
    assert resumed == sid
    child = executions_of(sid)[0].child_session_id
    with transaction() as s:  # an incomplete trailing tool round left in the child
        calls = '[{"id": "t1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}]'
        s.add(Message(session_id=child, role=Role.ASSISTANT, content="", tool_calls=calls))
    assert run_agent(sid, new_epoch, deps) == "yielded"
    rows = messages_of(child)
    assert [m.role for m in rows][-2:] == ["ASSISTANT", "USER"] and rows[-1].content == "again"
    assert not any(m.tool_calls for m in rows)


def test_status_shows_each_queues_oldest_wait_and_leases_nobody_picks_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    import tasks
    from recovery.ops import status_report
    from settings import get_settings
    from tasks.queues import queue_waits

    url = redis_db_url("broker")  # this xdist worker's own database, flushed before and after
    redis.Redis.from_url(url).flushdb()
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    get_settings.cache_clear()
    old = tasks.app.conf.broker_url
    tasks.app.conf.broker_url = url
    try:
        tasks.app.signature("recovery.scan").apply_async()
        time.sleep(1.1)
        waits = {q["queue"]: q for q in queue_waits()}
        assert waits["recovery"]["messages"] == 1 and waits["recovery"]["oldest_wait_seconds"] >= 1.0
        assert waits["celery"]["messages"] == 0
    finally:
        tasks.app.conf.broker_url = old
        redis.Redis.from_url(url).flushdb()
    parent = create_session("main", "go")
    from tests.helpers import make_execution, make_session

    child = make_session(phase=Phase.RUNNING)
    eid = make_execution(parent, child)
    with transaction() as s:
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == eid)
            .values(lease_owner="gone", lease_expires_at=utcnow() - timedelta(seconds=120))
        )
    report = status_report()
    assert report["expired_leases_not_picked_up"] == 1 and report["expired_execution_leases"] == 1


def test_a_scan_pass_longer_than_its_reservations_never_takes_its_own_rows_again(
    model_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools

    import recovery.scan as scan_module

    model = model_factory(TWO)
    for _ in range(3):
        yielded_with_children(model.base_url)
    expire_leases()
    ticks = itertools.count()
    real = scan_module.utcnow
    # Every call is a minute later: each batch's reservations have lapsed by the next batch.
    monkeypatch.setattr(scan_module, "utcnow", lambda: real() + timedelta(seconds=60 * next(ticks)))
    monkeypatch.setattr(scan_module, "BATCH", 2)
    sched = RecordingScheduler()
    scan(sched, callback_grace_seconds=0)
    sent = [eid for _, _, children in sched.recoveries for eid, _ in children]
    assert sorted(sent) == sorted(set(sent)) and len(sent) == 6


def test_a_reservation_nobody_picked_up_is_sent_again_with_the_same_epoch(model_factory: ModelFactory) -> None:
    """A queue slower than two leases: the late message must stay valid, not be fenced over and over."""
    model = model_factory(TWO)
    sid, _, _, deps = yielded_with_children(model.base_url)
    expire_leases()
    first, second = RecordingScheduler(), RecordingScheduler()
    scan(first, callback_grace_seconds=0)
    expire_leases()  # nobody took the reserved executions within the reservation
    scan(second, callback_grace_seconds=0)
    assert first.recoveries[0][2] == second.recoveries[0][2]  # same (execution, epoch) pairs
    for eid, epoch in first.recoveries[0][2]:  # the FIRST (late) messages still work
        assert recover_child(eid, epoch, deps) == "completed"
    for eid, epoch in second.recoveries[0][2]:
        assert recover_child(eid, epoch, deps) == "stale"
    assert {e.status for e in executions_of(sid)} == {ExecutionStatus.COMPLETED}


def test_a_large_pass_is_handed_over_in_fan_out_batches_that_publish_every_recovery() -> None:
    import json

    import redis

    import tasks
    from tasks.scheduler import FAN_OUT_ABOVE, FAN_OUT_BATCH, CeleryScheduler

    url = redis_db_url("broker")  # this xdist worker's own database, flushed before and after
    client = redis.Redis.from_url(url)
    client.flushdb()
    old = tasks.app.conf.broker_url
    tasks.app.conf.broker_url = url
    try:
        children = [(i, 2) for i in range(FAN_OUT_ABOVE + 1)]
        sched = CeleryScheduler(tasks.app)
        sched.recover_many([(1, 0, children)])
        batches = [json.loads(m) for m in client.lrange("recovery", 0, -1)]
        assert len(batches) == -(-len(children) // FAN_OUT_BATCH)
        assert {b["headers"]["task"] for b in batches} == {"recovery.fan_out"}
        client.delete("recovery")
        for b in batches:
            (args, _, _) = json.loads(__import__("base64").b64decode(b["body"]))
            sched.fan_out([tuple(x) for x in args[0]])
        # A recovered child is a child: it runs where children run, never on
        # the recovery queue of short work.
        assert client.llen("recovery") == 0
        singles = [json.loads(m)["headers"] for m in client.lrange("celery", 0, -1)]
        assert len(singles) == len(children) and {h["task"] for h in singles} == {"recovery.recover_child"}
    finally:
        tasks.app.conf.broker_url = old
        client.flushdb()


@contextmanager
def statement_rejected(pattern: str, times: int = 1) -> Iterator[list[str]]:
    """Make PostgreSQL itself reject the first ``times`` statements whose SQL contains
    ``pattern`` with a real DataError (the statement is swapped for one that cannot succeed),
    as a value too long for its column or one of the wrong type does."""
    engine = get_engine()
    hits: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> Any:
        if pattern in statement and len(hits) < times:
            hits.append(statement)
            return "SELECT 'not a number'::integer", {}
        return statement, params

    event.listen(engine, "before_cursor_execute", before, retval=True)
    try:
        yield hits
    finally:
        event.remove(engine, "before_cursor_execute", before)


def test_classification_a_statement_that_cannot_succeed_is_not_an_outage_a_lost_connection_is() -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError

    from harness.errors import is_infrastructure_error
    from tests.services import free_port

    caught: list[BaseException] = []
    for sql, kind in (
        ("SELECT 'x'::integer", DataError),
        ("SELECT * FROM no_such_table_here", ProgrammingError),
        ("INSERT INTO message (id, session_id, role, content) VALUES (1, -1, 'USER', '')", IntegrityError),
    ):
        with pytest.raises(kind) as info, get_engine().connect() as conn:
            conn.execute(text(sql))
        caught.append(info.value)
    assert [is_infrastructure_error(e) for e in caught] == [False, False, False]
    unreachable = create_engine(f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/x")
    with pytest.raises(OperationalError) as down, unreachable.connect():
        pass
    assert is_infrastructure_error(down.value)


def test_a_statement_postgresql_rejects_in_a_parent_round_ends_the_run_failed_instead_of_looping(
    model_factory: ModelFactory,
) -> None:
    model = model_factory([{"when": {"system_contains": MAIN}, "reply": {"content": "answer"}}])
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    with statement_rejected("INSERT INTO message") as hits:
        assert run_agent(sid, 0, deps) == "failed"
    assert hits
    with transaction() as s:
        assert s.execute(select(AgentSession.phase).where(AgentSession.id == sid)).scalar_one() == Phase.FAILED
    assert invariants() == []


def test_a_statement_postgresql_rejects_in_a_child_ends_it_failed_with_the_reason_delivered(
    model_factory: ModelFactory,
) -> None:
    model = model_factory(TWO)
    sid, _, children, deps = yielded_with_children(model.base_url)
    with statement_rejected("INSERT INTO message"):
        assert start_child(*children[0], deps) == "failed"
    first = executions_of(sid)[0]
    assert first.status == ExecutionStatus.FAILED and first.error is not None and "DataError" in first.error
    assert start_child(*children[1], deps) == "completed"
    drive(model.base_url)
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    assert invariants() == []


def test_a_small_pass_sends_one_recover_children_message_per_round_where_children_run() -> None:
    import base64
    import json

    import redis

    import tasks
    from tasks.scheduler import RECOVER_BATCH, CeleryScheduler

    url = redis_db_url("broker")
    client = redis.Redis.from_url(url)
    client.flushdb()
    old = tasks.app.conf.broker_url
    tasks.app.conf.broker_url = url
    try:
        big = [(100 + i, 3) for i in range(RECOVER_BATCH + 1)]  # a round larger than a batch
        CeleryScheduler(tasks.app).recover_many([(1, 0, [(10, 2), (11, 2), (12, 2)]), (2, 0, [(20, 4)]), (3, 0, big)])
        assert client.llen("recovery") == 0  # recovered children run where children run
        sent = [json.loads(m) for m in reversed(client.lrange("celery", 0, -1))]
        shapes = [(m["headers"]["task"], json.loads(base64.b64decode(m["body"]))[0]) for m in sent]
        assert sorted(shapes, key=str) == sorted(
            [
                ("recovery.recover_children", [[[10, 2], [11, 2], [12, 2]]]),
                ("recovery.recover_child", [20, 4]),
                ("recovery.recover_children", [[list(p) for p in big[:RECOVER_BATCH]]]),
                ("recovery.recover_child", list(big[RECOVER_BATCH])),
            ],
            key=str,
        )
    finally:
        tasks.app.conf.broker_url = old
        client.flushdb()
