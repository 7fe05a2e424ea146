"""Prometheus metrics: the real `agent-recovery metrics serve` over HTTP, parsed with
prometheus_client's own parser and checked against rows the test created; and the plans of the
scrape's queries against a million settled executions."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from models import DeliveryStatus, ExecutionStatus, PendingRound, transaction
from models.base import utcnow
from models.worker import record_scan
from settings import get_settings
from tests.helpers import make_execution, make_session

ROOT = Path(__file__).resolve().parents[2]
FIELD_TABLE = f'"{get_settings().booking_field_recovery.db_schema}".field_recovery_invocation'

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(body: str) -> Samples:
    """Every sample of an exposition text, keyed by (sample name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def add_field_invocation(conn: Any, key: str, status: str, *, lease_seconds: float | None = None) -> None:
    """One field_recovery_invocation row in the shape the CHECK constraints of migration 0004 ask."""
    finished = status != "IN_PROGRESS"
    conn.execute(
        text(
            f"INSERT INTO {FIELD_TABLE} (idempotency_key, request_id, attempt, source_message_id, source_revision,"
            " observation_hash, profile_version, request_hash, status, owner_id, epoch, lease_expires_at,"
            " error_code, patch_set, created_at, started_at, completed_at, updated_at, retention_until)"
            " VALUES (:key, 'frq', 1, '<m@test>', 1, 'h', 'p', 'h', :status, 'w1', 1,"
            " CASE WHEN CAST(:lease AS float) IS NULL THEN NULL ELSE now() + make_interval(secs => :lease) END,"
            " :error_code, CAST(:patch_set AS json), now(), now(), :completed, now(), now() + interval '30 days')"
        ),
        {
            "key": key,
            "status": status,
            "lease": lease_seconds,
            "error_code": "timeout" if status == "FAILED" else None,
            "patch_set": json.dumps({"patches": []}) if status == "SUCCEEDED" else None,
            "completed": utcnow() if finished else None,
        },
    )


@pytest.fixture
def field_table(db: str) -> Iterator[Any]:
    """The field invocation table and the last scan's row emptied before and after (the db fixture
    truncates the delegation tables only)."""
    engine = create_engine(db)
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {FIELD_TABLE}"))
        conn.execute(text("DELETE FROM recovery_scan"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {FIELD_TABLE}"))
        conn.execute(text("DELETE FROM recovery_scan"))
    engine.dispose()


@pytest.fixture
def metrics_server(db: str) -> Iterator[str]:
    """`agent-recovery metrics serve --port 0` as a subprocess; yields its /metrics URL."""
    env = {**os.environ, "DATABASE_URL": db, "SCAN_INTERVAL_SECONDS": "30", "PYTHONPATH": str(ROOT)}
    snippet = "import sys; from cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = ["metrics", "serve", "--port", "0", "--settled-refresh-seconds", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-c", snippet, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed at once; bounded by the test timeout
    match = re.fullmatch(r"metrics listening on (http://127\.0\.0\.1:\d+/metrics)\n", line)
    if match is None:
        proc.kill()
        pytest.fail(f"unexpected first line {line!r}; stderr: {proc.communicate(timeout=5)[1]}")
    try:
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 0, stderr


def test_a_scrape_over_http_reports_the_rows_the_test_created(field_table: Any, metrics_server: str) -> None:
    now = utcnow()
    waiting_a, waiting_b, settled_parent = make_session(), make_session(), make_session()
    # parent A: a child nobody picks up (lease expired an hour ago) and a finished, undelivered one
    make_execution(waiting_a, tool_call_id="a1", started_ago_seconds=600, lease_expires_at=now - timedelta(hours=1))
    make_execution(
        waiting_a, tool_call_id="a2", status=ExecutionStatus.COMPLETED, started_ago_seconds=100, completed_at=now
    )
    # parent B: a recovering child under a live lease, and one whose lease expired a moment ago
    make_execution(
        waiting_b,
        tool_call_id="b1",
        status=ExecutionStatus.RECOVERING,
        started_ago_seconds=50,
        lease_expires_at=now + timedelta(seconds=60),
    )
    make_execution(waiting_b, tool_call_id="b2", started_ago_seconds=40, lease_expires_at=now - timedelta(seconds=1))
    # settled history
    delivered = {"parent_result_delivered_at": now, "completed_at": now}
    for i in range(3):
        make_execution(
            settled_parent,
            tool_call_id=f"d{i}",
            status=ExecutionStatus.COMPLETED,
            delivery=DeliveryStatus.DELIVERED,
            **delivered,
        )
    make_execution(
        settled_parent, tool_call_id="f1", status=ExecutionStatus.FAILED, delivery=DeliveryStatus.DELIVERED, **delivered
    )
    make_execution(settled_parent, tool_call_id="s1", status=ExecutionStatus.FAILED, delivery=DeliveryStatus.SUPPRESSED)
    make_execution(settled_parent, tool_call_id="s2", delivery=DeliveryStatus.SUPPRESSED)  # child still being fenced
    make_execution(settled_parent, tool_call_id=None, status=ExecutionStatus.CANCELLED, delivery=DeliveryStatus.LEGACY)
    with transaction() as s:
        s.add(PendingRound(session_id=waiting_a, tool_calls=[], inline_results={}))
        s.add(PendingRound(session_id=waiting_b, tool_calls=[], inline_results={}, closed_at=now))
        record_scan(s, started_at=now - timedelta(seconds=7), duration_ms=1250, parents=2, executions=3)
    with field_table.begin() as conn:
        add_field_invocation(conn, "live", "IN_PROGRESS", lease_seconds=30)
        add_field_invocation(conn, "dead", "IN_PROGRESS", lease_seconds=-5)
        add_field_invocation(conn, "ok1", "SUCCEEDED")
        add_field_invocation(conn, "ok2", "SUCCEEDED")
        add_field_invocation(conn, "bad", "FAILED")

    response = requests.get(metrics_server, timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = parse(response.text)
    print(response.text)  # one real scrape, for a reader of the test log

    assert value(samples, "agent_recovery_database_up") == 1
    pending = {s.value.lower(): 0 for s in ExecutionStatus} | {"running": 2, "recovering": 1, "completed": 1}
    for status, expected in pending.items():
        assert value(samples, "agent_recovery_executions", status=status, delivery_status="pending") == expected
    assert value(samples, "agent_recovery_executions", status="running", delivery_status="suppressed") == 1
    assert value(samples, "agent_recovery_parents_waiting") == 2
    # started 600 s before the test by this process's clock; the age is the database's
    assert 595 <= value(samples, "agent_recovery_oldest_pending_execution_age_seconds") < 660
    # a1 only: b2's lease expired one second ago, less than one scan interval (30 s)
    assert value(samples, "agent_recovery_executions_lease_expired") == 1
    assert value(samples, "agent_recovery_pending_rounds_open") == 1

    settled = {("completed", "delivered"): 3, ("failed", "delivered"): 1, ("failed", "suppressed"): 1}
    settled[("cancelled", "legacy")] = 1
    for status in ("completed", "failed", "cancelled"):
        for delivery in ("delivered", "suppressed", "legacy"):
            got = value(samples, "agent_recovery_executions_settled_total", status=status, delivery_status=delivery)
            assert got == settled.get((status, delivery), 0), (status, delivery)

    assert value(samples, "agent_recovery_field_invocations", status="in_progress") == 2
    assert value(samples, "agent_recovery_field_invocations_stale") == 1
    assert value(samples, "agent_recovery_field_invocations_finished_total", status="succeeded") == 2
    assert value(samples, "agent_recovery_field_invocations_finished_total", status="failed") == 1

    assert value(samples, "agent_recovery_last_scan_timestamp_seconds") == pytest.approx(
        (now - timedelta(seconds=7)).timestamp(), abs=0.01
    )
    assert value(samples, "agent_recovery_last_scan_duration_seconds") == 1.25
    assert value(samples, "agent_recovery_last_scan_parents") == 2
    assert value(samples, "agent_recovery_last_scan_executions") == 3
    assert 6 <= value(samples, "agent_recovery_last_scan_age_seconds") < 60

    # Prometheus conventions: one prefix, lower-case labels, units in names
    for (name, labels), _ in samples.items():
        assert name.startswith("agent_recovery_"), name
        assert all(v == v.lower() for _, v in labels), (name, labels)

    # the values follow the database from one scrape to the next: a delivery lands
    with transaction() as s:
        s.execute(
            text(
                "UPDATE subagent_execution SET delivery_status = 'DELIVERED', parent_result_delivered_at = now()"
                " WHERE parent_tool_call_id = 'a2'"
            )
        )
    again = parse(requests.get(metrics_server, timeout=10).text)
    assert value(again, "agent_recovery_executions", status="completed", delivery_status="pending") == 0
    assert value(again, "agent_recovery_executions_settled_total", status="completed", delivery_status="delivered") == 4


def test_before_any_scan_the_last_scan_time_is_zero_and_no_age_is_shown(field_table: Any) -> None:
    from recovery.metrics import RecoveryCollector, build_registry

    samples = parse(generate_latest(build_registry(RecoveryCollector())).decode())
    assert value(samples, "agent_recovery_last_scan_timestamp_seconds") == 0
    assert ("agent_recovery_last_scan_age_seconds", ()) not in samples
    assert value(samples, "agent_recovery_oldest_pending_execution_age_seconds") == 0


def test_pending_rounds_open_counts_open_rounds_beside_live_sessions_pinned_to_a_release(field_table: Any) -> None:
    """The by-release gauges once reused the variable of the open rounds' count: the gauge then
    reported the last release's live sessions (3 here) instead of the open rounds (1)."""
    from models.release import AgentRelease
    from recovery.metrics import RecoveryCollector, build_registry

    with transaction() as s:
        release = AgentRelease(content_hash="r" * 64, definition={})
        s.add(release)
        s.flush()
        release_id = release.id
    pinned = [make_session(release_id=release_id) for _ in range(3)]
    with transaction() as s:
        s.add(PendingRound(session_id=pinned[0], tool_calls=[], inline_results={}))
    samples = parse(generate_latest(build_registry(RecoveryCollector())).decode())
    assert value(samples, "agent_recovery_sessions_by_release", release=str(release_id)) == 3
    assert value(samples, "agent_recovery_pending_rounds_open") == 1


def test_settled_counters_are_recounted_only_once_their_refresh_interval_passed(field_table: Any) -> None:
    from recovery.metrics import RecoveryCollector, build_registry

    collector = RecoveryCollector(settled_refresh_seconds=3600)
    registry = build_registry(collector)
    parent = make_session()
    done = {"status": ExecutionStatus.COMPLETED, "delivery": DeliveryStatus.DELIVERED}
    make_execution(parent, tool_call_id="x1", parent_result_delivered_at=utcnow(), **done)
    name, labels = "agent_recovery_executions_settled_total", {"status": "completed", "delivery_status": "delivered"}
    assert value(parse(generate_latest(registry).decode()), name, **labels) == 1
    make_execution(parent, tool_call_id="x2", parent_result_delivered_at=utcnow(), **done)
    make_execution(parent, tool_call_id="x3")
    samples = parse(generate_latest(registry).decode())
    assert value(samples, name, **labels) == 1  # the count of an hour ago is reused
    assert value(samples, "agent_recovery_executions", status="running", delivery_status="pending") == 1  # live
    collector.settled_refresh_seconds = 0
    assert value(parse(generate_latest(registry).decode()), name, **labels) == 2


def test_a_database_that_does_not_answer_is_database_up_zero_not_a_failed_scrape() -> None:
    from recovery.metrics import RecoveryCollector, build_registry

    engine = create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/nowhere", connect_args={"connect_timeout": 2})
    samples = parse(generate_latest(build_registry(RecoveryCollector(engine))).decode())
    assert samples == {("agent_recovery_database_up", ()): 0.0}


# --- cost: a million settled executions ----------------------------------------------------------

HISTORY_ROWS = 1_000_000


def _plan(conn: Any, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    raw = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql), params).scalar_one()
    return dict((json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"])


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _text_plan(conn: Any, sql: str, params: dict[str, Any]) -> str:
    return "\n".join(r[0] for r in conn.execute(text("EXPLAIN ANALYZE " + sql), params))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_scrape_reads_only_live_rows_through_the_partial_indexes_beside_a_million_settled_ones(
    fresh_db_url: str,
) -> None:
    from migrations import upgrade
    from recovery import metrics

    upgrade(fresh_db_url)
    engine = create_engine(fresh_db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, epoch, started_at, updated_at)"
                " VALUES ('u', 'NORMAL', 'main', 'RUNNING', 0, now(), now()),"
                " ('u', 'SUBAGENT', 'reviewer', NULL, 0, now(), now())"
            )
        )
        conn.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
                " status, delivery_status, total_tool_calls, rounds, prompt_tokens, completion_tokens, total_tokens,"
                " epoch, started_at, completed_at, parent_result_delivered_at)"
                " SELECT 1, 2, 'reviewer', 't', CASE WHEN g % 10 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,"
                " CASE WHEN g % 50 = 0 THEN 'SUPPRESSED' ELSE 'DELIVERED' END, 0, 0, 0, 0, 0, 0,"
                " now() - interval '30 days', now() - interval '30 days', now() - interval '30 days'"
                " FROM generate_series(1, :n) AS g"
            ),
            {"n": HISTORY_ROWS},
        )
        # the live work: a few PENDING executions, one open round
        conn.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
                " status, delivery_status, total_tool_calls, rounds, prompt_tokens, completion_tokens, total_tokens,"
                " epoch, started_at, lease_expires_at)"
                " SELECT 1, 2, 'reviewer', 't', 'RUNNING', 'PENDING', 0, 0, 0, 0, 0, 0,"
                " now(), now() - interval '1 hour'"
                " FROM generate_series(1, 5)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO pending_round (session_id, tool_calls, inline_results, prompt_tokens, completion_tokens,"
                " created_at, closed_at) SELECT 1, '[]', '{}', 0, 0, now(), CASE WHEN g = 1 THEN NULL ELSE now() END"
                " FROM generate_series(1, 200000) AS g"
            )
        )
        for i in range(100_000 // 1000):
            conn.execute(
                text(
                    f"INSERT INTO {FIELD_TABLE} (idempotency_key, request_id, attempt, source_message_id,"
                    " source_revision, observation_hash, profile_version, request_hash, status, owner_id, epoch,"
                    " lease_expires_at, patch_set, created_at, started_at, completed_at, updated_at, retention_until)"
                    " SELECT 'k' || g, 'r', 1, 'm', 1, 'h', 'p', 'h',"
                    " CASE WHEN g = 1 THEN 'IN_PROGRESS' ELSE 'SUCCEEDED' END, 'w', 1,"
                    " now() + interval '1 hour', '{}', now(), now(),"
                    " now(), now(), now() FROM generate_series(:lo, :hi) AS g"
                ),
                {"lo": i * 1000 + 1, "hi": i * 1000 + 1000},
            )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))

    schema = get_settings().booking_field_recovery.db_schema
    live = {
        "PENDING_SQL": (metrics.PENDING_SQL, {"scan_interval": 30.0}, "idx_sae_pending"),
        "PARENTS_SQL": (metrics.PARENTS_SQL, {}, "idx_sae_pending"),
        "ACTIVE_SETTLED_SQL": (metrics.ACTIVE_SETTLED_SQL, {}, "ix_sae_settled_unfinished"),
        "OPEN_ROUNDS_SQL": (metrics.OPEN_ROUNDS_SQL, {}, "uq_pending_round_open"),
        "FIELD_LIVE_SQL": (
            metrics.FIELD_LIVE_SQL.format(schema=schema),
            {},
            "ix_field_recovery_invocation_in_progress",
        ),
    }
    with engine.connect() as conn:
        for name, (sql, params, index) in live.items():
            plan = _plan(conn, sql, params)
            shown = _text_plan(conn, sql, params)
            print(f"---- {name}\n{shown}")
            nodes = list(_nodes(plan))
            assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], shown
            assert index in {n.get("Index Name") for n in nodes}, shown
            # O(live rows): no node touches more than the handful of live rows
            assert max(n["Actual Rows"] * n.get("Actual Loops", 1) for n in nodes) <= 10, shown

    collector = metrics.RecoveryCollector(engine, scan_interval_seconds=30, field_schema=schema)
    samples = parse(generate_latest(metrics.build_registry(collector)).decode())
    # every tenth history row FAILED, every fiftieth (all of them FAILED) SUPPRESSED
    completed_delivered = HISTORY_ROWS - HISTORY_ROWS // 10
    got = value(samples, "agent_recovery_executions_settled_total", status="completed", delivery_status="delivered")
    assert got == completed_delivered
    assert value(samples, "agent_recovery_executions", status="running", delivery_status="pending") == 5
    assert value(samples, "agent_recovery_executions_lease_expired") == 5
    assert value(samples, "agent_recovery_pending_rounds_open") == 1
    assert value(samples, "agent_recovery_field_invocations_stale") == 0
    engine.dispose()


def test_pending_approvals_and_the_oldest_ones_age_are_scraped_from_the_requests(field_table: Any) -> None:
    from recovery.metrics import RecoveryCollector, build_registry

    sid = make_session()
    with transaction() as s:
        journal = s.execute(
            text(
                "INSERT INTO round_journal (session_id, epoch, status, tool_calls, refused, created_at)"
                " VALUES (:sid, 1, 'OPEN', '[]', '{}', now()) RETURNING id"
            ),
            {"sid": sid},
        ).scalar_one()
        for n, (status, age) in enumerate((("PENDING", 600), ("PENDING", 60), ("APPROVED", 9000))):
            s.execute(
                text(
                    "INSERT INTO approval_request (session_id, journal_id, call_id, tool, agent_type, arguments,"
                    " arguments_sha256, status, requested_at, expires_at, decided_at, decided_by)"
                    " VALUES (:sid, :j, :c, 'refund', 'main', '{}', '', :st, now() - make_interval(secs => :age),"
                    " now() + interval '1 day', CASE WHEN :st = 'PENDING' THEN NULL ELSE now() END,"
                    " CASE WHEN :st = 'PENDING' THEN NULL ELSE 'alice' END)"
                ),
                {"sid": sid, "j": journal, "c": f"call-{n}", "st": status, "age": age},
            )
    samples = parse(generate_latest(build_registry(RecoveryCollector())).decode())
    assert value(samples, "agent_recovery_approvals_pending") == 2
    assert 600 <= value(samples, "agent_recovery_oldest_pending_approval_age_seconds") < 700


def test_stuck_tool_threads_are_a_gauge_summed_over_the_processes_until_their_calls_end(
    field_table: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import redis

    from harness import events
    from harness.tools import ToolContext, registry, run_inline, tool, unregister
    from harness.tools.stuck import INDEX_KEY, process_key
    from recovery.metrics import RecoveryCollector, build_registry
    from tests.helpers import wait_until

    monkeypatch.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    events._redis.cache_clear()
    client = redis.Redis.from_url(redis_url)
    # Another live process with 3 stuck threads, and one that died (its key expired).
    client.set(process_key("other-host", 41), 3, ex=60)
    client.sadd(INDEX_KEY, process_key("other-host", 41), process_key("dead-host", 9))
    release = threading.Event()

    @tool(timeout_seconds=0.2)
    def hangs_for_metrics() -> str:
        release.wait(30)
        return "done"

    metrics = build_registry(RecoveryCollector())

    def stuck() -> tuple[float, float]:
        samples = parse(generate_latest(metrics).decode())
        return (
            value(samples, "agent_recovery_tool_threads_stuck"),
            value(samples, "agent_recovery_tool_threads_stuck_max_per_process"),
        )

    before = registry.stuck_threads()
    try:
        for n in range(2):
            ctx = ToolContext(7, f"call_{n}", None)
            assert "timed out" in run_inline("hangs_for_metrics", "{}", ctx, ("hangs_for_metrics",))
        assert registry.stuck_threads() == before + 2
        wait_until(lambda: stuck() == (5.0 + before, 3.0), timeout=5, what="this process's 2 stuck threads published")
        assert not client.sismember(INDEX_KEY, process_key("dead-host", 9))  # forgotten by the scrape
    finally:
        release.set()
        unregister("hangs_for_metrics")
    wait_until(lambda: stuck() == (3.0, 3.0), timeout=5, what="the ended calls no longer counted")
    client.close()
    events._redis.cache_clear()
    get_settings.cache_clear()


def test_tokens_are_counted_by_agent_model_and_kind_from_the_usage_rows(field_table: Any) -> None:
    from models.usage import record_usage
    from recovery.metrics import RecoveryCollector, build_registry

    main, reviewer = make_session(agent_type="main"), make_session(agent_type="reviewer")
    calls = [
        (main, "m1", 100, 20, 30, 5, 0),
        (main, "m1", 50, 10, 0, 0, 0),
        (reviewer, "m1", 7, 3, 0, 1, 0),
        (main, None, 0, 0, 0, 0, 4200),  # an estimated call (its reply never stored)
    ]
    with transaction() as s:
        for sid, model, prompt, completion, cached, reasoning, estimated in calls:
            record_usage(
                s,
                session_id=sid,
                execution_id=None,
                model=model,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                reasoning_tokens=reasoning,
                estimated_tokens=estimated,
            )
    samples = parse(generate_latest(build_registry(RecoveryCollector(settled_refresh_seconds=0))).decode())
    name = "agent_recovery_model_tokens_total"
    assert value(samples, name, agent="main", model="m1", kind="prompt") == 150
    assert value(samples, name, agent="main", model="m1", kind="completion") == 30
    assert value(samples, name, agent="main", model="m1", kind="cached") == 30
    assert value(samples, name, agent="main", model="m1", kind="reasoning") == 5
    assert value(samples, name, agent="reviewer", model="m1", kind="prompt") == 7
    assert value(samples, name, agent="main", model="unknown", kind="estimated") == 4200
    assert value(samples, "agent_recovery_model_calls_total", agent="main", model="m1") == 2


def test_budget_gauges_name_the_least_budget_left_of_a_live_tree_and_the_trees_waiting_for_a_raise(
    field_table: Any,
) -> None:
    from harness.views import create_session
    from recovery.metrics import RecoveryCollector, build_registry

    def scrape() -> Samples:
        return parse(generate_latest(build_registry(RecoveryCollector())).decode())

    samples = scrape()
    assert value(samples, "agent_recovery_budget_trees_live") == 0
    assert value(samples, "agent_recovery_tree_budget_remaining_ratio") == 1  # nothing to alert on
    low = create_session("main", "go", budget_tokens=10_000)
    calls = create_session("main", "go", budget_model_calls=4)
    ended = create_session("main", "go", budget_tokens=100)
    with transaction() as s:
        s.execute(text("UPDATE agent_session SET phase = 'RUNNING' WHERE id IN (:a, :b)"), {"a": low, "b": calls})
        s.execute(text("UPDATE agent_session SET phase = 'FAILED' WHERE id = :c"), {"c": ended})
        s.execute(
            text("UPDATE tree_budget SET spent_tokens = 8000, reserved_tokens = 500 WHERE root_session_id = :r"),
            {"r": low},
        )
        s.execute(text("UPDATE tree_budget SET model_calls = 1 WHERE root_session_id = :r"), {"r": calls})
        s.execute(text("UPDATE tree_budget SET spent_tokens = 100 WHERE root_session_id = :r"), {"r": ended})
    samples = scrape()
    assert value(samples, "agent_recovery_budget_trees_live") == 2  # the ended tree is not counted
    assert value(samples, "agent_recovery_tree_budget_remaining_ratio") == pytest.approx(0.15)
    assert value(samples, "agent_recovery_budget_requests_pending") == 0
    with transaction() as s:
        s.execute(
            text(
                "INSERT INTO approval_request (session_id, call_id, tool, agent_type, arguments, arguments_sha256,"
                " status, requested_at, expires_at) VALUES (:sid, 'budget-1', 'budget.raise', 'main',"
                " '{\"tokens\": 100}', '', 'PENDING', now(), now() + interval '1 day')"
            ),
            {"sid": low},
        )
        s.execute(text("UPDATE agent_session SET phase = 'WAITING_APPROVAL' WHERE id = :a"), {"a": low})
    samples = scrape()
    assert value(samples, "agent_recovery_budget_requests_pending") == 1
    assert value(samples, "agent_recovery_budget_trees_live") == 2  # a tree waiting for a raise is live
    child = create_session("reviewer", "look")
    with transaction() as s:
        s.execute(text("UPDATE agent_session SET budget_root_id = :r WHERE id = :c"), {"r": low, "c": child})
        s.execute(
            text(
                "INSERT INTO approval_request (session_id, call_id, tool, agent_type, arguments, arguments_sha256,"
                " status, requested_at, expires_at) VALUES (:sid, 'budget-7-1', 'budget.raise', 'reviewer',"
                " '{\"tokens\": 100}', '', 'PENDING', now(), now() + interval '1 day')"
            ),
            {"sid": child},
        )
    # A child of the same tree asking too: still one tree waiting for a raise.
    assert value(scrape(), "agent_recovery_budget_requests_pending") == 1
