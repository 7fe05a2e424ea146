"""Real worker processes SIGKILLed mid-flight: a new worker's scan recovers; two
workers with two beats (concurrent scans) deliver exactly once; a Redis flush loses nothing.

The worker-killing tests run on both brokers: Redis, and RabbitMQ with Redis as the
result backend (real acks: the killed worker's messages come back at once, and meet the scan's
compare-and-sets)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from devstack.processes import flush_broker
from models import AgentSession, SessionType, SubagentExecution, transaction
from tests.helpers import executions_of, wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"
SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
    {
        "when": {"system_contains": "subagent", "turn": 0},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 4}}]},
    },
    {"when": {"system_contains": "subagent", "turn": 1}, "reply": {"content": "child answer"}},
]


# The amqp runs share RabbitMQ's queues with tests/crash/test_rabbitmq.py: same xdist group.
@pytest.fixture(params=["redis", pytest.param("amqp", marks=pytest.mark.xdist_group("rabbitmq"))])
def broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The stacks of the test run on this broker (STACK_BROKER); RabbitMQ's queues purged after."""
    if request.param == "amqp":
        from tests.crash.test_rabbitmq import AMQP_URL, _missing, socket

        try:
            socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
        except OSError as exc:
            _missing("RabbitMQ", exc)
        monkeypatch.setenv("STACK_BROKER", "amqp")
        yield AMQP_URL
        from devstack.processes import purge_amqp

        purge_amqp()
        return
    monkeypatch.setenv("STACK_BROKER", "redis")
    yield "redis"


def children_running(parent: int) -> bool:
    execs = executions_of(parent)
    return len(execs) == 2 and all(e.epoch >= 1 and e.status == "RUNNING" for e in execs)  # taken, not only reserved


def ids(parent: int) -> list[tuple[int, int]]:
    return [(e.id, e.child_session_id) for e in executions_of(parent)]


def subagent_sessions() -> int:
    with transaction() as s:
        return len(s.execute(select(AgentSession.id).where(AgentSession.session_type == SessionType.SUBAGENT)).all())


def test_sigkilled_worker_mid_flight_is_recovered_by_a_new_worker(broker: str, stack_factory: StackFactory) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1")
    sid = stack.submit("go")
    wait_until(lambda: children_running(sid), timeout=30, what="both children running")
    before = ids(sid)
    w1.kill()
    stack.worker("w2", beat=True)
    snap = stack.wait_phase(sid, timeout=90)
    assert ids(sid) == before  # same executions, same child sessions (I4)
    assert subagent_sessions() == 2
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert sum(1 for j in stack.model.journal() if j["rule"] == 0) == 1  # never delegated again
    assert stack.invariants() == []


def test_two_workers_with_concurrent_scans_deliver_exactly_once(broker: str, stack_factory: StackFactory) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1")
    parents = [stack.submit(f"go {i}") for i in range(3)]
    # Kill once every parent has delegated: some children run, the others wait in the queue.
    wait_until(lambda: all(len(executions_of(sid)) == 2 for sid in parents), timeout=60, what="all delegations")
    w1.kill()
    # Two workers, each with its own beat: two boot scans and two scans every interval.
    stack.worker("w2", beat=True)
    stack.worker("w3", beat=True)
    for sid in parents:
        stack.wait_phase(sid, timeout=120)
    assert subagent_sessions() == 6
    with transaction() as s:
        statuses = {(e.status, e.delivery_status) for e in s.execute(select(SubagentExecution)).scalars()}
    assert statuses == {("COMPLETED", "DELIVERED")}
    assert sum(1 for j in stack.model.journal() if j["rule"] == 0) == 3
    assert stack.invariants() == []


def test_redis_flushed_while_children_run_loses_nothing(stack_factory: StackFactory) -> None:
    stack = stack_factory(SCRIPT)
    stack.worker("w1", beat=True)
    sid = stack.submit("go")
    wait_until(lambda: children_running(sid), timeout=30, what="both children running")
    flush_broker()  # every queued message is gone (I7)
    snap = stack.wait_phase(sid, timeout=90)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert snap["messages"][-1]["role"] == "ASSISTANT"
    assert stack.invariants() == []
