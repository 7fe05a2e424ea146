"""Is anything alive (docs/console.md, "Health"): each worker's name watcher records that it is
alive (worker_presence); health is red when no worker is alive, when the last scan is overdue,
when an approval waits past HEALTH_APPROVAL_MAX_AGE_SECONDS, and shows the queues' depths and
the pending approvals: in the console's page and JSON, and `agent-recovery health`. The real
PostgreSQL schema and Redis broker, a real loopback server."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

import models.worker as worker_model
from models import transaction
from models.base import utcnow
from models.presence import silent_after_seconds
from models.worker import boot, record_boot, record_scan
from recovery.health import verdict
from settings import get_settings
from tests.integration.test_approval_display import parked as parked  # the fixture
from tests.integration.test_approvals import Runs
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_api import Serve, client
from tests.integration.test_console_api import console as console  # the fixture


@pytest.fixture
def worker_name(db: str) -> Iterator[str]:
    saved = worker_model.identity()
    yield f"hw-{uuid.uuid4().hex[:8]}@host"
    worker_model._identity = saved


def watcher_of(name: str) -> Any:
    from tasks.signals import NameWatcher

    return NameWatcher(None, name, boot(name), period_seconds=60)


def codes(report: dict[str, Any]) -> list[str]:
    return [p["code"] for p in report["problems"]]


def health() -> dict[str, Any]:
    with transaction() as s:
        return verdict(s)


def scanned(seconds_ago: float = 0.0) -> None:
    with transaction() as s:
        record_scan(s, started_at=utcnow() - timedelta(seconds=seconds_ago), duration_ms=5, parents=0, executions=0)


def test_a_worker_is_alive_while_its_watcher_ticks_and_health_turns_red_without_it(worker_name: str) -> None:
    scanned()
    assert codes(health()) == ["no_worker_alive"]
    watcher = watcher_of(worker_name)
    assert watcher.tick() is None
    report = health()
    assert report["ok"] is True and report["problems"] == []
    (seen,) = report["presence"]["workers"]
    assert (seen["name"], seen["pid"], seen["hostname"], seen["alive"]) == (
        worker_name,
        os.getpid(),
        socket.gethostname(),
        True,
    )
    assert seen["release_id"] is not None  # the release of this process's configuration
    with transaction() as s:  # three ticks missed
        s.execute(
            text("UPDATE worker_presence SET last_seen_at = now() - make_interval(secs => :n)"),
            {"n": silent_after_seconds() + 1},
        )
    report = health()
    assert codes(report) == ["no_worker_alive"]
    assert (report["presence"]["alive"], report["presence"]["silent"]) == (0, 1)
    watcher.tick()
    assert health()["ok"] is True


def test_a_superseded_process_stops_saying_it_is_alive(worker_name: str) -> None:
    watcher = watcher_of(worker_name)
    watcher.tick()
    with transaction() as s:
        record_boot(s, worker_name)  # a newer process under the same name
        s.execute(text("UPDATE worker_presence SET pid = 1"))  # as the newer one wrote it
    assert watcher.tick() is not None
    with transaction() as s:
        assert s.execute(text("SELECT pid FROM worker_presence")).scalar_one() == 1


def test_an_overdue_scan_and_an_approval_waiting_too_long_turn_health_red(
    worker_name: str, parked: tuple[int, str, Any], runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher_of(worker_name).tick()
    interval = get_settings().SCAN_INTERVAL_SECONDS
    scanned(seconds_ago=2 * interval - 1)
    report = health()
    assert report["ok"] is True and report["approvals"]["pending"] == 1
    scanned(seconds_ago=2 * interval + 1)
    assert codes(health()) == ["scan_overdue"]
    scanned()
    monkeypatch.setenv("HEALTH_APPROVAL_MAX_AGE_SECONDS", "60")
    get_settings.cache_clear()
    try:
        with transaction() as s:
            s.execute(text("UPDATE approval_request SET requested_at = now() - interval '61 seconds'"))
        report = health()
        assert codes(report) == ["approvals_waiting"]
        assert report["approvals"]["oldest_age_seconds"] >= 61
    finally:
        monkeypatch.delenv("HEALTH_APPROVAL_MAX_AGE_SECONDS")
        get_settings.cache_clear()


def test_the_console_and_the_cli_show_the_verdict_workers_and_queue_depths(
    console: Serve, worker_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    from cli.main import main

    broker = redis.Redis.from_url(get_settings().CELERY_BROKER_URL)
    broker.delete("celery")
    broker.rpush("celery", *[json.dumps({"headers": {}}) for _ in range(3)])
    try:
        scanned()
        base = console()
        http = client(base)
        red = http.get(f"{base}/api/health", timeout=10).json()
        assert red["ok"] is False and codes(red) == ["no_worker_alive"]
        assert {q["queue"]: q["messages"] for q in red["queues"]}["celery"] == 3
        page = http.get(f"{base}/health", timeout=10).text
        assert 'class="verdict verdict-red"' in page and 'data-code="no_worker_alive"' in page
        assert main(["health"]) == 1
        assert "no_worker_alive" in capsys.readouterr().out

        watcher_of(worker_name).tick()
        green = http.get(f"{base}/api/health", timeout=10).json()
        assert green["ok"] is True and green["presence"]["alive"] == 1
        (row,) = [w for w in green["workers"] if w["name"] == worker_name]
        assert row["alive"] is True and row["pid"] == os.getpid()
        page = http.get(f"{base}/health", timeout=10).text
        assert 'class="verdict verdict-ok"' in page and f'<tr data-worker="{worker_name}">' in page
        assert 'class="badge alive"' in page
        assert main(["health", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["presence"]["alive"] == 1
    finally:
        broker.delete("celery")


def test_queue_depths_are_unknown_when_the_broker_cannot_be_reached() -> None:
    from tasks.queues import amqp_depths

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert amqp_depths(f"amqp://guest:guest@127.0.0.1:{port}//", ("celery", "recovery")) == [
        ("celery", None),
        ("recovery", None),
    ]


def test_the_metrics_count_the_workers_alive(worker_name: str) -> None:
    from prometheus_client import generate_latest

    from recovery.metrics import RecoveryCollector, build_registry
    from tests.integration.test_metrics import parse, value

    def alive() -> float:
        scraped = generate_latest(build_registry(RecoveryCollector())).decode()
        return value(parse(scraped), "agent_recovery_workers_alive")

    assert alive() == 0
    watcher_of(worker_name).tick()
    assert alive() == 1
    with transaction() as s:
        s.execute(text("UPDATE worker_presence SET last_seen_at = now() - interval '1 hour'"))
    assert alive() == 0
