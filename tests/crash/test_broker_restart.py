"""A Redis restart under a busy worker: the worker must outlive its broker.

celery 5.7.0 closes the lost broker connection after collecting it; the close restores the
in-flight ``acks_late`` message through a transport whose client is already gone, and the
worker dies with ``Unrecoverable error: AttributeError("'NoneType' object has no attribute
'hostname'")`` (pyproject pins celery below 5.7 for it). This
test keeps an upgrade that brings it back out of CI: a real prefork worker with one slot busy
in a child's run and one slot free (polling Redis), its private redis-server killed with
SIGKILL and started again EMPTY; the worker must still be alive and must run the next task.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError

from devstack.processes import Worker, service_env
from doubles.scripted_model import ScriptedModelServer
from harness.views import create_session
from tests.helpers import executions_of, wait_until
from tests.services import RedisServer, private_redis_fixture  # noqa: F401 - the private_redis fixture

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]

MAIN = "main agent"
#: Long enough that the child is still running when Redis comes back and the next task is sent.
CHILD_WAIT_SECONDS = 20
#: How long Redis stays down: the worker sees refused connections, not only a reset.
REDIS_DOWN_SECONDS = 1.0
NEXT_TASK_TIMEOUT_SECONDS = 30.0

SCRIPT = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}}]},
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
    {
        "when": {"system_contains": "subagent", "last_role": "user"},
        "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": CHILD_WAIT_SECONDS}}]},
    },
    {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
]


@pytest.fixture
def model() -> Iterator[ScriptedModelServer]:
    server = ScriptedModelServer(SCRIPT)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def worker_env(db: str, model: ScriptedModelServer, private_redis: RedisServer) -> dict[str, str]:
    """The stack's environment with broker, result backend and events on the private Redis."""
    return service_env(db, model.base_url, redis_base=private_redis.url, broker="redis")


@pytest.fixture
def sender(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """A Celery app of this test's own that sends by task name to the private Redis. NOTE: not
    ``tasks.app``: its broker pool and result backend are cached per process, and later tests
    in this session must not inherit a URL whose server this test stops."""
    # Celery prefers CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment to the URLs
    # given to Celery(): the test process's own (tests/conftest.py) would send elsewhere.
    monkeypatch.setenv("CELERY_BROKER_URL", worker_env["CELERY_BROKER_URL"])
    monkeypatch.setenv("CELERY_RESULT_BACKEND", worker_env["CELERY_RESULT_BACKEND"])
    app = Celery(
        "broker_restart_test",
        broker=worker_env["CELERY_BROKER_URL"],
        backend=worker_env["CELERY_RESULT_BACKEND"],
    )
    app.conf.update(broker_connection_retry_on_startup=True, task_serializer="json", accept_content=["json"])
    yield app
    app.close()


def _one_child_running(parent: int) -> bool:
    execs = executions_of(parent)
    return len(execs) == 1 and execs[0].status == "RUNNING" and execs[0].epoch >= 1  # taken, not only reserved


def _worker_report(worker: Worker) -> str:
    log = worker.log()
    critical = [line for line in log.splitlines() if "CRITICAL" in line or "Unrecoverable" in line]
    return f"alive={not worker.exited}; critical lines: {critical}\n---- log tail:\n{log[-3000:]}"


def test_a_busy_worker_survives_a_redis_restart_and_runs_the_next_task(
    private_redis: RedisServer, worker_env: dict[str, str], sender: Celery, tmp_path: Path
) -> None:
    worker = Worker(worker_env, tmp_path, name="wr", concurrency=2, pool="prefork").start()
    try:
        sid = create_session("main", "go")
        sender.send_task("agent.run", args=(sid, 0))
        wait_until(lambda: _one_child_running(sid), timeout=30, what="the child running on the worker")

        private_redis.restart(down_seconds=REDIS_DOWN_SECONDS)
        assert private_redis.starts == 2

        # The child still runs in one slot; the other slot must take the next message.
        result = sender.send_task("recovery.scan")
        try:
            report = result.get(timeout=NEXT_TASK_TIMEOUT_SECONDS)
        except CeleryTimeoutError:
            pytest.fail(f"the worker ran no task after the Redis restart: {_worker_report(worker)}")
        assert set(report) >= {"parents", "resumed"}
        assert not worker.exited, _worker_report(worker)
        assert "Unrecoverable error" not in worker.log(), _worker_report(worker)
    finally:
        worker.kill()  # no warm shutdown: it would wait for the child's long run
        worker.stop()
