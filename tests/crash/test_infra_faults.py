"""Infrastructure faults with real workers: the broker and the database go away under running work.

(b) Redis stopped during the parent's delegating model call and restarted EMPTY (the hand-off of
    the children fails; every queued message is gone): the parent finishes, no row FAILED.
(c) PostgreSQL connections cut every 300 ms for 10 s while a parent and two children run (the
    fault proxy resets every open connection, statements die mid-transaction): every child
    COMPLETED, delivered once.
(d) PostgreSQL refusing connections for 20 s in the middle of a recovery: the recovery
    completes after it returns, and nothing is recorded as a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from devstack.processes import Worker, service_env
from doubles.scripted_model import ScriptedModelServer
from harness.views import create_session, snapshot
from models import transaction
from recovery.invariants import check_all
from tests.faultproxy import FaultProxy
from tests.helpers import executions_of, wait_until
from tests.services import RedisServer, private_redis_fixture  # noqa: F401 - the private_redis fixture

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

MAIN = "main agent"


def script(child_wait: float, parent_delay: float = 0.0) -> list[dict[str, Any]]:
    first: dict[str, Any] = {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review A"}},
                {"name": "delegate", "arguments": {"agent_type": "researcher", "task": "research B"}},
            ]
        },
    }
    if parent_delay:
        first["delay_seconds"] = parent_delay
    return [
        first,
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
        {
            "when": {"system_contains": "subagent", "last_role": "user"},
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": child_wait}}]},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]


class Rig:
    """Model, workers and a sender app of this test's own (never ``tasks.app``: its broker
    pool is cached per process and this test stops its broker)."""

    def __init__(self, db: str, redis_base: str, log_dir: Path, rules: list[dict[str, Any]]) -> None:
        self.model = ScriptedModelServer(rules)
        self.model.start()
        self.env = service_env(db, self.model.base_url, redis_base=redis_base, broker="redis")
        self.log_dir = log_dir
        self.workers: list[Worker] = []
        self.app = Celery(
            "infra_faults", broker=self.env["CELERY_BROKER_URL"], backend=self.env["CELERY_RESULT_BACKEND"]
        )
        self.app.conf.update(broker_connection_retry_on_startup=True, task_serializer="json", accept_content=["json"])

    def worker(self, name: str, **env: str) -> Worker:
        w = Worker({**self.env, **env}, self.log_dir, name=name, concurrency=2, beat=True, pool="prefork").start()
        self.workers.append(w)
        return w

    def submit(self) -> int:
        sid = create_session("main", "go")
        self.app.send_task("agent.run", args=(sid, 0))
        return sid

    def wait_done(self, sid: int, timeout: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            with transaction() as s:
                snap = snapshot(s, sid)
            return snap if snap and snap["phase"] == "WAITING_USER" else None

        try:
            return wait_until(done, timeout=timeout, interval=0.2, what=f"session {sid} settled")  # type: ignore[no-any-return]
        except AssertionError:
            for w in self.workers:
                print(f"---- {w.log_path}\n{w.log()[-5000:]}")
            raise

    def close(self) -> None:
        for w in self.workers:
            w.kill()
            w.stop()
        self.app.close()
        self.model.stop()


@pytest.fixture
def rig_factory(db: str, private_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    rigs: list[Rig] = []

    def make(rules: list[dict[str, Any]]) -> Rig:
        rig = Rig(db, private_redis.url, tmp_path, rules)
        # Celery prefers CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment to the
        # URLs given to Celery(): without this the rig's app sends to the test process's Redis.
        monkeypatch.setenv("CELERY_BROKER_URL", rig.env["CELERY_BROKER_URL"])
        monkeypatch.setenv("CELERY_RESULT_BACKEND", rig.env["CELERY_RESULT_BACKEND"])
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def _settled_once(sid: int, snap: dict[str, Any]) -> None:
    execs = executions_of(sid)
    assert {(e.status, e.delivery_status) for e in execs} == {("COMPLETED", "DELIVERED")}, [
        (e.id, e.status, e.delivery_status, e.error) for e in execs
    ]
    assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    with transaction() as s:
        assert check_all(s, settled=True) == []


def test_b_redis_restarted_empty_during_the_delegating_model_call_loses_nothing(
    rig_factory: Any, private_redis: RedisServer
) -> None:
    rig = rig_factory(script(child_wait=1, parent_delay=3.0))
    rig.worker("wb")
    sid = rig.submit()
    wait_until(lambda: len(rig.model.journal()) == 0 and _parent_running(sid), timeout=30, what="parent asking")
    time.sleep(0.5)  # inside the 3 s model call
    private_redis.kill()
    time.sleep(6.0)  # down through the round's commit and the children's hand-off (publish retries)
    private_redis.start()
    snap = rig.wait_done(sid, timeout=90)
    _settled_once(sid, snap)
    assert sum(1 for j in rig.model.journal() if j["rule"] == 0) == 1  # the parent never delegated twice
    assert not any(w.exited for w in rig.workers)


def _parent_running(sid: int) -> bool:
    with transaction() as s:
        snap = snapshot(s, sid)
    return bool(snap and snap["phase"] == "RUNNING")


def test_c_postgres_connections_cut_every_300ms_for_10s_under_a_running_round(rig_factory: Any, db: str) -> None:
    with FaultProxy.for_url(db) as proxy:
        rig = rig_factory(script(child_wait=3))
        rig.worker("wc", DATABASE_URL=proxy.rewrite(db))
        sid = rig.submit()
        wait_until(lambda: len(executions_of(sid)) == 2, timeout=30, what="children created")
        stop = threading.Event()

        def cutter() -> None:
            end = time.monotonic() + 10
            while time.monotonic() < end and not stop.is_set():
                proxy.cut_all()
                time.sleep(0.3)

        thread = threading.Thread(target=cutter)
        thread.start()
        try:
            snap = rig.wait_done(sid, timeout=120)
        finally:
            stop.set()
            thread.join()
        assert proxy.stats().cuts > 0
    _settled_once(sid, snap)


def test_c_a_statement_cut_mid_transaction_is_never_recorded_as_a_failure(rig_factory: Any, db: str) -> None:
    """The cut hits the child's final commit itself (the window the pool's pre-ping hides)."""
    with FaultProxy.for_url(db) as proxy:
        rig = rig_factory(script(child_wait=1))
        rig.worker("wc2", DATABASE_URL=proxy.rewrite(db))
        proxy.cut_on(b"UPDATE subagent_execution SET status", times=2)
        sid = rig.submit()
        snap = rig.wait_done(sid, timeout=120)
        assert proxy.stats().pattern_hits == 2
    _settled_once(sid, snap)


def test_d_postgres_refusing_connections_for_20s_mid_recovery(rig_factory: Any, db: str) -> None:
    with FaultProxy.for_url(db) as proxy:
        rig = rig_factory(script(child_wait=4))
        w1 = rig.worker("wd1", DATABASE_URL=proxy.rewrite(db))
        sid = rig.submit()
        wait_until(
            lambda: len(e := executions_of(sid)) == 2 and all(x.epoch >= 1 for x in e), timeout=30, what="running"
        )
        w1.kill()
        rig.worker("wd2", DATABASE_URL=proxy.rewrite(db))
        wait_until(
            lambda: any(e.status == "RECOVERING" and e.lease_owner for e in executions_of(sid)),
            timeout=30,
            what="a recovery in progress",
        )
        proxy.refuse_for(20, cut_open=True)
        time.sleep(20)
        snap = rig.wait_done(sid, timeout=120)
    _settled_once(sid, snap)
