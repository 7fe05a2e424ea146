"""Prometheus metrics read from PostgreSQL at scrape time.

The values come from the tables, not from process memory, so they are right whichever worker
did the work and survive every restart. A scrape is one short READ ONLY transaction whose cost
follows the work in flight, not the history:

1. Unsettled executions (delivery PENDING, or a suppressed child still active) by status,
   parents waiting, the oldest PENDING execution's age and the executions whose lease expired
   more than one scan interval ago: the partial index ``idx_sae_pending``
   (``WHERE delivery_status = 'PENDING'``), plus ``ix_sae_settled_unfinished`` (``WHERE
   delivery_status <> 'PENDING' AND completed_at IS NULL``) for the executions settled while
   still active. O(pending).
2. Open pending rounds: the partial unique index ``uq_pending_round_open``; pending approval
   requests and the oldest one's age: the partial index ``ix_approval_request_pending``.
3. Field invocations IN_PROGRESS and the stale ones (lease expired): the partial index
   ``ix_field_recovery_invocation_in_progress``.
4. The last scan: the single ``recovery_scan`` row.
5. Worker names two live processes share: ``worker_boot`` (one row per name).
6. Sessions stopped with a reason, by ``failure_code``: a settled count (below).
7. Stuck tool threads: not a table but Redis (REDIS_URL), where each process with threads it
   cannot get back keeps its count alive (harness.tools.stuck). A Redis that does not answer
   leaves these out of the scrape (logged); the database's metrics are still served.
8. Model tokens by agent, model and kind, and model calls: ``model_call_usage`` rows only ever
   grow, so they are settled counts too (below).
9. Budgets of live trees (root RUNNING, RESUMING, IDLE or WAITING_APPROVAL: the index
   ``ix_agent_session_phase``, then ``tree_budget`` by its key): how many, the least share of a
   limit left, and the budget requests waiting for a person (``ix_approval_request_pending``).
   O(live sessions).

Settled rows (a terminal execution DELIVERED, SUPPRESSED or LEGACY; a SUCCEEDED or FAILED
field invocation) only ever grow, so they are exposed as ``_total`` counters. Counting them
is O(history) (a sequential scan: no index names ``status``, so that every state change of an
execution is an in-place update, migration 0010), so they
are recounted at most every ``settled_refresh_seconds`` and served from the last count in
between: a counter that lags by that much is still right for ``rate()``.

Ages use the database's ``now()`` (docs/glossary.md, "Database time"). Label values are lower
case. A database that does not answer makes the scrape expose ``agent_recovery_database_up 0``
and nothing else, instead of failing the HTTP request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from fieldrecovery.tables import InvocationStatus
from logfmt import log_event
from models import ACTIVE_EXECUTION, TERMINAL_EXECUTION, DeliveryStatus, FailureCode, get_engine, lease
from models.session import LIVE_BY_RELEASE
from settings import get_settings

log = logging.getLogger(__name__)

PREFIX = "agent_recovery"
#: How long the counted settled rows are reused before the next O(history) count.
DEFAULT_SETTLED_REFRESH_SECONDS = 60.0
#: A scrape that the database cannot answer in this time fails (database_up 0) instead of piling up.
STATEMENT_TIMEOUT_MS = 5000

#: Field invocation statuses (fieldrecovery/tables.py, CHECK constraint of migration 0004).
FIELD_IN_PROGRESS = InvocationStatus.IN_PROGRESS.value
FIELD_FINISHED = (InvocationStatus.SUCCEEDED.value, InvocationStatus.FAILED.value)
SETTLED_DELIVERY = (DeliveryStatus.DELIVERED, DeliveryStatus.SUPPRESSED, DeliveryStatus.LEGACY)

# NOTE: every query below names its index in a comment; tests/integration/test_metrics.py checks
# the plans of PENDING_SQL and FIELD_LIVE_SQL against a million settled rows.

#: Executions whose delivery is PENDING, per status (idx_sae_pending).
PENDING_SQL = """
SELECT status,
       count(*) AS executions,
       EXTRACT(EPOCH FROM now() - min(started_at)) AS oldest_age_seconds,
       count(*) FILTER (
           WHERE status IN ('RUNNING', 'RECOVERING')
             AND COALESCE(lease_expires_at, started_at) < now() - make_interval(secs => :scan_interval)
       ) AS lease_expired
FROM subagent_execution
WHERE delivery_status = 'PENDING'
GROUP BY status
"""
#: Parents with at least one PENDING execution (idx_sae_pending: parent_session_id is its key).
PARENTS_SQL = """
SELECT count(DISTINCT parent_session_id) FROM subagent_execution WHERE delivery_status = 'PENDING'
"""
#: Children still active although their delivery ended (a suppressed parent's child being fenced).
ACTIVE_SETTLED_SQL = """
SELECT status, delivery_status, count(*)
FROM subagent_execution
WHERE status IN ('RUNNING', 'RECOVERING') AND delivery_status <> 'PENDING' AND completed_at IS NULL
GROUP BY status, delivery_status
"""
OPEN_ROUNDS_SQL = "SELECT count(*) FROM pending_round WHERE closed_at IS NULL"
#: Active sessions waiting for the model through an outage (ix_agent_session_model_outage).
WAITING_FOR_MODEL_SQL = """
SELECT count(*) FROM agent_session
WHERE model_outage_since IS NOT NULL AND phase IN ('RUNNING', 'RESUMING')
"""
#: Live sessions waiting for a worker of their release, by release (ix_agent_session_release_wait).
WAITING_FOR_RELEASE_SQL = """
SELECT release_id, count(*) FROM agent_session
WHERE release_wait_since IS NOT NULL AND phase IN ('RUNNING', 'RESUMING')
GROUP BY release_id
"""
#: Live sessions (not stopped: children and sessions waiting for the user included) by the
#: release they are pinned to (ix_agent_session_release_live: the same predicate).
LIVE_BY_RELEASE_SQL = f"SELECT release_id, count(*) FROM agent_session WHERE {LIVE_BY_RELEASE} GROUP BY release_id"
#: IN_PROGRESS field invocations and the stale ones (ix_field_recovery_invocation_in_progress).
FIELD_LIVE_SQL = """
SELECT count(*),
       count(*) FILTER (WHERE lease_expires_at IS NULL OR lease_expires_at < now())
FROM "{schema}".field_recovery_invocation
WHERE status = 'IN_PROGRESS'
"""
#: Worker names two live processes share right now: the older one refreshed its conflict within
#: the last lease (worker_boot is one row per name: a sequential scan of a handful of rows).
NAME_CONFLICTS_SQL = """
SELECT count(*) FROM worker_boot
WHERE conflict_seen_at IS NOT NULL AND conflict_seen_at > now() - make_interval(secs => :lease)
"""
#: Workers whose name watcher wrote their presence within the last lease (models.presence).
WORKERS_ALIVE_SQL = """
SELECT count(*) FROM worker_presence WHERE last_seen_at >= now() - make_interval(secs => :lease)
"""
#: Executions the scan quarantined (a status the code does not know) still PENDING
#: (idx_sae_pending).
QUARANTINED_SQL = """
SELECT count(*) FROM subagent_execution WHERE delivery_status = 'PENDING' AND quarantined_at IS NOT NULL
"""
LAST_SCAN_SQL = """
SELECT EXTRACT(EPOCH FROM started_at), duration_ms, parents, executions,
       EXTRACT(EPOCH FROM now() - started_at), COALESCE(skipped, 0)
FROM recovery_scan WHERE id = 1 AND started_at IS NOT NULL
"""
#: Settled executions (O(history): a sequential scan), recounted now and then.
SETTLED_SQL = """
SELECT status, delivery_status, count(*)
FROM subagent_execution
WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED') AND delivery_status <> 'PENDING'
GROUP BY status, delivery_status
"""
#: Sessions that ended FAILED or CANCELLED with a reason, per code (O(history), recounted with the
#: settled rows).
FAILURES_SQL = """
SELECT failure_code, count(*) FROM agent_session WHERE failure_code IS NOT NULL GROUP BY failure_code
"""
#: Tokens and calls of every recorded model call, per agent type and model (O(history), recounted
#: with the settled rows).
TOKENS_SQL = """
SELECT a.agent_type, COALESCE(u.model, 'unknown'), sum(u.prompt_tokens), sum(u.completion_tokens),
       sum(u.cached_tokens), sum(u.reasoning_tokens), sum(u.estimated_tokens),
       count(*) FILTER (WHERE u.estimated_tokens = 0)
FROM model_call_usage u JOIN agent_session a ON a.id = u.session_id
GROUP BY a.agent_type, COALESCE(u.model, 'unknown')
"""
#: The ``kind`` label of the token counter, in TOKENS_SQL's order.
TOKEN_KINDS = ("prompt", "completion", "cached", "reasoning", "estimated")
FIELD_SETTLED_SQL = """
SELECT status, count(*) FROM "{schema}".field_recovery_invocation
WHERE status <> 'IN_PROGRESS' GROUP BY status
"""


@dataclass
class _Settled:
    """The last count of settled rows and the monotonic time it was taken."""

    executions: dict[tuple[str, str], int] = field(default_factory=dict)
    field_invocations: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    #: (agent, model) -> the token sums in TOKEN_KINDS' order, then the stored calls.
    tokens: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    counted_at: float | None = None


PENDING_APPROVALS_SQL = """
SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(requested_at)), 0)
FROM approval_request WHERE status = 'PENDING'
"""

#: Per live budgeted tree, the least share left of the kinds it limits (LEAST skips NULLs).
LIVE_BUDGETS_SQL = """
SELECT count(*), COALESCE(min(GREATEST(LEAST(
  CASE WHEN b.budget_tokens > 0 THEN
    (b.budget_tokens - b.spent_tokens - b.reserved_tokens - b.estimated_tokens)::float8 / b.budget_tokens END,
  CASE WHEN b.budget_usd > 0 THEN
    ((b.budget_usd - b.spent_usd - b.reserved_usd - b.estimated_usd) / b.budget_usd)::float8 END,
  CASE WHEN b.budget_model_calls > 0 THEN
    (b.budget_model_calls - b.model_calls)::float8 / b.budget_model_calls END), 0)), 1)
FROM agent_session a JOIN tree_budget b ON b.root_session_id = a.id
WHERE a.phase IN ('RUNNING', 'RESUMING', 'IDLE', 'WAITING_APPROVAL')
"""
#: Trees, not requests: the children of one tree may each wait on a request of their own.
BUDGET_REQUESTS_SQL = (
    "SELECT count(DISTINCT s.budget_root_id) FROM approval_request a JOIN agent_session s ON s.id = a.session_id"
    " WHERE a.status = 'PENDING' AND a.tool = 'budget.raise'"
)


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


class RecoveryCollector(Collector):
    """A prometheus_client Collector: each ``collect()`` reads the database once."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        scan_interval_seconds: float | None = None,
        field_schema: str | None = None,
        settled_refresh_seconds: float = DEFAULT_SETTLED_REFRESH_SECONDS,
    ) -> None:
        settings = get_settings()
        self._engine = engine
        self.scan_interval_seconds = (
            lease.scan_interval_seconds() if scan_interval_seconds is None else scan_interval_seconds
        )
        self.field_schema = field_schema or settings.booking_field_recovery.db_schema
        self.settled_refresh_seconds = settled_refresh_seconds
        self._settled = _Settled()
        self._lock = threading.Lock()  # the HTTP server answers scrapes on several threads

    def describe(self) -> Iterable[Metric]:
        """Nothing: registering the collector must not query the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        try:
            with self._lock:
                metrics = self._read()
        except SQLAlchemyError:
            log_event(log, "metrics_scrape_failed", logging.WARNING, exc_info=True)
            yield GaugeMetricFamily(_name("database_up"), "1 when the last scrape read the database", value=0)
            return
        yield GaugeMetricFamily(_name("database_up"), "1 when the last scrape read the database", value=1)
        yield from metrics
        yield from self._tool_threads()
        yield GaugeMetricFamily(
            _name("scrape_duration_seconds"),
            "Time this scrape spent reading the database",
            value=time.monotonic() - started,
        )

    # --- reading ---------------------------------------------------------------------------

    def _read(self) -> list[Metric]:
        engine = self._engine or get_engine()
        with engine.connect() as conn, conn.begin():
            conn.execute(text("SET TRANSACTION READ ONLY"))
            conn.execute(text(f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}"))
            out = self._executions(conn)
            out += self._rounds(conn)
            out += self._approvals(conn)
            out += self._budgets(conn)
            out += self._field(conn)
            out += self._last_scan(conn)
            out += self._name_conflicts(conn)
            out += self._settled_counters(conn)
        return out

    def _executions(self, conn: Connection) -> list[Metric]:
        unsettled = GaugeMetricFamily(
            _name("executions"),
            "Executions not settled yet (delivery pending, or a suppressed child still active), "
            "by status and delivery status",
            labels=["status", "delivery_status"],
        )
        lease_expired = 0
        oldest = 0.0
        by_status = {
            str(r.status): r for r in conn.execute(text(PENDING_SQL), {"scan_interval": self.scan_interval_seconds})
        }
        for status in (*ACTIVE_EXECUTION, *TERMINAL_EXECUTION):
            row = by_status.get(status.value)
            unsettled.add_metric([status.value.lower(), "pending"], float(row.executions) if row else 0.0)
            if row is not None:
                lease_expired += int(row.lease_expired)
                oldest = max(oldest, float(row.oldest_age_seconds))
        for status, delivery, count in conn.execute(text(ACTIVE_SETTLED_SQL)):
            unsettled.add_metric([str(status).lower(), str(delivery).lower()], float(count))
        parents = conn.execute(text(PARENTS_SQL)).scalar_one()
        return [
            unsettled,
            GaugeMetricFamily(
                _name("parents_waiting"),
                "Parent sessions with at least one execution whose result is not delivered yet",
                value=float(parents),
            ),
            GaugeMetricFamily(
                _name("oldest_pending_execution_age_seconds"),
                "Age (database clock) of the oldest execution whose delivery is PENDING; 0 when none",
                value=oldest,
            ),
            GaugeMetricFamily(
                _name("executions_lease_expired"),
                "Active PENDING executions whose lease expired more than one scan interval ago "
                "(SCAN_INTERVAL_SECONDS): work nobody is picking up",
                value=float(lease_expired),
            ),
        ]

    def _rounds(self, conn: Connection) -> list[Metric]:
        open_rounds = conn.execute(text(OPEN_ROUNDS_SQL)).scalar_one()
        waiting = conn.execute(text(WAITING_FOR_MODEL_SQL)).scalar_one()
        for_release = _by_release(
            conn,
            "sessions_waiting_for_release",
            "Live sessions left for a worker of their release (newer than the workers' that took them, "
            "which lacked its tools), by release; each ends FAILED release_unavailable after RELEASE_WAIT_SECONDS",
            WAITING_FOR_RELEASE_SQL,
        )
        by_release = _by_release(
            conn,
            "sessions_by_release",
            "Live sessions (not COMPLETED, FAILED or CANCELLED; children and sessions waiting for the user "
            "included) by the release they are pinned to; a release at 0 or absent has none left",
            LIVE_BY_RELEASE_SQL,
        )
        return [
            for_release,
            by_release,
            GaugeMetricFamily(
                _name("pending_rounds_open"),
                "Parent tool-call rounds waiting for their children (pending_round not closed)",
                value=float(open_rounds),
            ),
            GaugeMetricFamily(
                _name("sessions_waiting_for_model"),
                "Active sessions whose run ended in a model outage longer than the retry window; "
                "each is resumed after a back-off until MODEL_OUTAGE_MAX_SECONDS or its deadline",
                value=float(waiting),
            ),
        ]

    def _approvals(self, conn: Connection) -> list[Metric]:
        count, oldest = conn.execute(text(PENDING_APPROVALS_SQL)).one()
        return [
            GaugeMetricFamily(
                _name("approvals_pending"),
                "Tool calls waiting for a human decision (approval requests PENDING)",
                value=float(count),
            ),
            GaugeMetricFamily(
                _name("oldest_pending_approval_age_seconds"),
                "Age (database clock) of the oldest PENDING approval request; 0 when none",
                value=float(oldest),
            ),
        ]

    def _budgets(self, conn: Connection) -> list[Metric]:
        live, least = conn.execute(text(LIVE_BUDGETS_SQL)).one()
        asked = conn.execute(text(BUDGET_REQUESTS_SQL)).scalar_one()
        return [
            GaugeMetricFamily(
                _name("budget_trees_live"),
                "Live agent trees with a budget (their root running, idle or waiting for an approval)",
                value=float(live),
            ),
            GaugeMetricFamily(
                _name("tree_budget_remaining_ratio"),
                "The least share of a budget left over live budgeted trees and the kinds each limits "
                "((limit - spent - reserved - estimated) / limit, 0 at or past it); 1 when none",
                value=float(least),
            ),
            GaugeMetricFamily(
                _name("budget_requests_pending"),
                "Trees whose budget ran out waiting for a person to raise it (PENDING budget.raise requests)",
                value=float(asked),
            ),
        ]

    def _field(self, conn: Connection) -> list[Metric]:
        in_progress, stale = conn.execute(text(FIELD_LIVE_SQL.format(schema=self.field_schema))).one()
        invocations = GaugeMetricFamily(
            _name("field_invocations"), "Field recovery invocations in flight, by status", labels=["status"]
        )
        invocations.add_metric([FIELD_IN_PROGRESS.lower()], float(in_progress))
        return [
            invocations,
            GaugeMetricFamily(
                _name("field_invocations_stale"),
                "IN_PROGRESS field recovery keys whose owner's lease expired (the owner is presumed dead)",
                value=float(stale),
            ),
        ]

    def _last_scan(self, conn: Connection) -> list[Metric]:
        row = conn.execute(text(LAST_SCAN_SQL)).one_or_none()
        started, duration_ms, parents, executions, age, skipped = row if row is not None else (0, 0, 0, 0, None, 0)
        out: list[Metric] = [
            GaugeMetricFamily(
                _name("last_scan_timestamp_seconds"),
                "Unix time the last recovery scan started; 0 when no scan was ever recorded",
                value=float(started),
            ),
            GaugeMetricFamily(
                _name("last_scan_duration_seconds"), "Duration of the last recovery scan", value=duration_ms / 1000.0
            ),
            GaugeMetricFamily(
                _name("last_scan_parents"), "Parents the last recovery scan took over", value=float(parents)
            ),
            GaugeMetricFamily(
                _name("last_scan_executions"),
                "Executions the last recovery scan handed to recovery",
                value=float(executions),
            ),
            GaugeMetricFamily(
                _name("last_scan_skipped"),
                "Rows the last recovery scan passed over because another path held their lock",
                value=float(skipped),
            ),
        ]
        quarantined = conn.execute(text(QUARANTINED_SQL)).scalar_one()
        out.append(
            GaugeMetricFamily(
                _name("quarantined_executions"),
                "PENDING executions the scan quarantined: a status this code does not know (see the "
                "event=execution_quarantined log line naming each)",
                value=float(quarantined),
            )
        )
        if age is not None:
            out.append(
                GaugeMetricFamily(
                    _name("last_scan_age_seconds"),
                    "Seconds (database clock) since the last recovery scan started",
                    value=float(age),
                )
            )
        return out

    def _name_conflicts(self, conn: Connection) -> list[Metric]:
        count = conn.execute(text(NAME_CONFLICTS_SQL), {"lease": lease.lease_seconds()}).scalar_one()
        alive = conn.execute(text(WORKERS_ALIVE_SQL), {"lease": lease.lease_seconds()}).scalar_one()
        return [
            GaugeMetricFamily(
                _name("workers_alive"),
                "Workers whose name watcher wrote their presence within the last lease (worker_presence)",
                value=float(alive),
            ),
            GaugeMetricFamily(
                _name("worker_name_conflicts"),
                "Worker names (WORKER_ID or -n) under which two live processes run: the older one "
                "saw the newer boot within the last lease and stopped consuming",
                value=float(count),
            ),
        ]

    def _tool_threads(self) -> list[Metric]:
        from redis import RedisError

        from harness.events import _client
        from harness.tools.stuck import read_all

        try:
            stuck = read_all(_client(get_settings().REDIS_URL))
        except RedisError:
            log_event(log, "metrics_tool_threads_not_read", logging.WARNING, exc_info=True)
            return []
        return [
            GaugeMetricFamily(
                _name("tool_threads_stuck"),
                "Tool threads still running a call nobody waits for (timed out, past the deadline or "
                "cancelled), summed over the live processes",
                value=float(stuck.total),
            ),
            GaugeMetricFamily(
                _name("tool_threads_stuck_max_per_process"),
                "The most stuck tool threads of one live process (past TOOL_MAX_STUCK_THREADS it stops after its task)",
                value=float(stuck.max_per_process),
            ),
        ]

    def _settled_counters(self, conn: Connection) -> list[Metric]:
        now = time.monotonic()
        counted_at = self._settled.counted_at
        if counted_at is None or now - counted_at >= self.settled_refresh_seconds:
            executions = {(str(s), str(d)): int(n) for s, d, n in conn.execute(text(SETTLED_SQL))}
            fields = {str(s): int(n) for s, n in conn.execute(text(FIELD_SETTLED_SQL.format(schema=self.field_schema)))}
            failures = {str(c): int(n) for c, n in conn.execute(text(FAILURES_SQL))}
            tokens = {(str(r[0]), str(r[1])): tuple(int(v or 0) for v in r[2:]) for r in conn.execute(text(TOKENS_SQL))}
            self._settled = _Settled(executions, fields, failures, tokens, now)
        settled = CounterMetricFamily(
            _name("executions_settled"),
            "Terminal executions whose delivery ended (delivered, suppressed, legacy), by status and "
            "delivery status; recounted at most every settled_refresh_seconds",
            labels=["status", "delivery_status"],
        )
        for status in TERMINAL_EXECUTION:
            for delivery in SETTLED_DELIVERY:
                count = self._settled.executions.get((status.value, delivery.value), 0)
                settled.add_metric([status.value.lower(), delivery.value.lower()], float(count))
        finished = CounterMetricFamily(
            _name("field_invocations_finished"),
            "Field recovery invocations that ended, by status; recounted at most every settled_refresh_seconds",
            labels=["status"],
        )
        for status_name in FIELD_FINISHED:
            finished.add_metric([status_name.lower()], float(self._settled.field_invocations.get(status_name, 0)))
        reasons = CounterMetricFamily(
            _name("session_failures"),
            "Sessions that ended FAILED or CANCELLED, by failure_code (docs/providers.md); recounted at most "
            "every settled_refresh_seconds",
            labels=["failure_code"],
        )
        for code in sorted({*(c.value for c in FailureCode), *self._settled.failures}):
            reasons.add_metric([code], float(self._settled.failures.get(code, 0)))
        return [settled, finished, reasons, *self._token_counters()]

    def _token_counters(self) -> list[Metric]:
        tokens = CounterMetricFamily(
            _name("model_tokens"),
            "Model tokens of the recorded calls by agent type, model (unknown: not named) and kind (prompt, "
            "completion, cached and reasoning as the provider reported them; estimated: reservations of calls "
            "whose reply was never stored, docs/usage.md); recounted at most every settled_refresh_seconds",
            labels=["agent", "model", "kind"],
        )
        calls = CounterMetricFamily(
            _name("model_calls"),
            "Model calls whose reply was stored, by agent type and model; recounted at most every "
            "settled_refresh_seconds",
            labels=["agent", "model"],
        )
        for (agent, model), sums in sorted(self._settled.tokens.items()):
            for kind, n in zip(TOKEN_KINDS, sums, strict=False):
                tokens.add_metric([agent, model, kind], float(n))
            calls.add_metric([agent, model], float(sums[-1]))
        return [tokens, calls]


def build_registry(collector: RecoveryCollector | None = None) -> CollectorRegistry:
    """A registry holding only our collector (no process or platform metrics of the server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector or RecoveryCollector())
    return registry


def _by_release(conn: Connection, name: str, documentation: str, sql: str) -> GaugeMetricFamily:
    """A gauge labelled by release, from ``sql``'s (release_id, count) rows."""
    gauge = GaugeMetricFamily(_name(name), documentation, labels=["release"])
    for release_id, n in conn.execute(text(sql)):
        gauge.add_metric([str(release_id)], float(n))
    return gauge
