"""RabbitMQ as the broker, Redis as the result backend: the normal delegation path, a
worker SIGKILLed mid-flight and recovered, and the operator's `celery call recovery.redeliver`.

On RabbitMQ an unacked message comes back as soon as the killed worker's connection closes (no
visibility timeout): the new worker gets the killed children's run_child messages again AND its
boot scan recovers them. Both paths meet the same compare-and-set rows: exactly once still holds.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from devstack.processes import AMQP_URL, purge_amqp
from models import AgentSession, SessionType, transaction
from tests.conftest import _missing
from tests.helpers import children_done_delivery_lost, executions_of, expire_leases, messages_of, wait_until
from tests.types import StackFactory

#: RabbitMQ's queues (celery, recovery) are one set for every amqp test: under pytest-xdist they
#: all run in one group, on one worker, one after another (test_worker_kill's amqp runs too).
RABBITMQ_GROUP = pytest.mark.xdist_group("rabbitmq")

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180), RABBITMQ_GROUP]

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


@pytest.fixture
def amqp(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The stacks of this test run on RabbitMQ (STACK_BROKER=amqp); its queues purged after."""
    host, port = "127.0.0.1", 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        _missing("RabbitMQ", exc)
    monkeypatch.setenv("STACK_BROKER", "amqp")
    yield AMQP_URL
    purge_amqp()


def children_running(parent: int) -> bool:
    execs = executions_of(parent)
    return len(execs) == 2 and all(e.epoch >= 1 and e.status == "RUNNING" for e in execs)  # taken, not only reserved


def subagent_sessions() -> int:
    with transaction() as s:
        return len(s.execute(select(AgentSession.id).where(AgentSession.session_type == SessionType.SUBAGENT)).all())


def test_delegation_runs_on_rabbitmq_with_redis_as_the_result_backend(amqp: str, stack_factory: StackFactory) -> None:
    stack = stack_factory(SCRIPT)
    assert stack.env["CELERY_BROKER_URL"] == amqp
    assert stack.env["CELERY_RESULT_BACKEND"].startswith("redis://")
    worker = stack.worker("w1")
    sid = stack.submit("go")
    snap = stack.wait_phase(sid, timeout=60)
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert snap["messages"][-1]["content"].count('"result": "child answer"') == 2
    assert "Connected to amqp://guest:**@127.0.0.1:5672//" in worker.log()
    assert stack.invariants() == []


def test_sigkilled_worker_on_rabbitmq_is_recovered_exactly_once(amqp: str, stack_factory: StackFactory) -> None:
    stack = stack_factory(SCRIPT)
    w1 = stack.worker("w1")
    sid = stack.submit("go")
    wait_until(lambda: children_running(sid), timeout=30, what="both children running")
    before = [(e.id, e.child_session_id) for e in executions_of(sid)]
    w1.kill()  # RabbitMQ requeues the unacked run_child messages when the connection drops
    w2 = stack.worker("w2", beat=True)
    snap = stack.wait_phase(sid, timeout=90)
    assert [(e.id, e.child_session_id) for e in executions_of(sid)] == before  # I4
    assert subagent_sessions() == 2
    assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert sum(1 for j in stack.model.journal() if j["rule"] == 0) == 1  # never delegated again
    assert stack.model.rejected() == []  # every history sent to the model was legal (I2)
    assert stack.invariants() == []
    assert "Connected to amqp://" in w2.log()


def test_operator_redeliver_by_celery_call_on_rabbitmq_is_idempotent(amqp: str, stack_factory: StackFactory) -> None:
    script = [*SCRIPT[:2], {"when": {"system_contains": "subagent"}, "reply": {"content": "ok"}}]
    stack = stack_factory(script)
    sid, _ = children_done_delivery_lost(stack.model.base_url)  # the last child died before delivering
    expire_leases()
    worker = stack.worker()
    env = {**os.environ, **stack.env}
    first = executions_of(sid)[0].id
    cmd = [sys.executable, "-m", "celery", "-A", "tasks", "call", "recovery.redeliver", f"--args=[{first}]"]
    sent = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr
    stack.wait_phase(sid, timeout=60)
    assert {e.delivery_status for e in executions_of(sid)} == {"DELIVERED"}
    count = len(messages_of(sid))
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    done = re.compile(r"Task recovery\.redeliver\[[^\]]+\] succeeded")
    wait_until(lambda: len(done.findall(worker.log())) == 2, timeout=20, what="both redeliver calls ran")
    assert len(messages_of(sid)) == count
    assert stack.invariants() == []
