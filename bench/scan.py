"""Scan cost against history: ``python bench/scan.py [--pending 1000] [--history 1000000]``;
scan at scale: ``python bench/scan.py --parents 10000 [--per-parent 3]``.

The recovery scan must cost O(pending), not O(history) (docs/tables.md: the partial index
``idx_sae_pending ... WHERE delivery_status = 'PENDING'``). This benchmark times the scan with
``--pending`` crashed executions (RUNNING, PENDING, lease expired) over an empty history, then
over ``--history`` finished rows (DELIVERED and LEGACY, bulk-inserted with generate_series and
analyzed, as autovacuum would), and prints both times and their ratio. The statements the scan
sends about executions are captured during one more pass and explained (``EXPLAIN (ANALYZE,
BUFFERS)``, in a transaction rolled back): their time inside PostgreSQL over both histories,
the costliest plan, and whether the partial index carries them.

Each pass is the real ``recovery.scan.scan`` with a scheduler that only counts (it takes every
crashed execution, so the crashed state is put back between passes, outside the timing).

``--parents N`` measures the scan at scale instead: N crashed parents with ``--per-parent``
executions each (RUNNING, PENDING, every lease expired), taken by the real scan with the real
Celery scheduler (messages sent to the bench's own Redis broker; no worker consumes them). Timed
from the scan's start until every parent is taken and the broker holds every message the
scheduler sends for it; prints parents taken per second: the median of ``--repeat`` passes with
the slowest and the fastest beside it, and the load average before and after. Between passes,
outside the timing, the crashed state is put back, the broker flushed and both tables vacuumed:
a pass rewrites every crashed execution and parent and the put-back rewrites them again, so
without the vacuum pass n would wade through the dead row versions of the n passes before it
(which no real crash meets: autovacuum keeps a live table near its live size), and autovacuum
waking at random moments would make the passes differ by more than the figure moves.

``--steps N`` times one pass's own steps instead, in this process: N parents in R16 (every child
COMPLETED, the rounds undelivered; ``--per-parent`` children each) are made before each pass,
the pass runs with a scheduler that records (tests.helpers.RecordingScheduler), and the parents
it handed over are then delivered and run, outside the timing, so that every pass finds the same
state. Prints, as medians of ``--repeat`` passes after one untimed pass: the time from the
pass's start to its first hand-over (its delivery step's ``deliver_many``), the whole pass, and
each step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

PENDING_USER = "bench-pending"
HISTORY_USER = "bench-history"
#: History rows inserted per statement (one progress line each).
HISTORY_BATCH = 250_000


class CountingScheduler:
    """A Scheduler (harness.scheduler) that enqueues nothing: the scan's own cost, without the broker.
    It counts the parents and executions of the recoveries the scan hands over in batches (one
    parent's executions may span two batches) and the parents whose delivery it asks for."""

    def __init__(self) -> None:
        self.parent_ids: set[int] = set()
        self.executions = 0

    @property
    def parents(self) -> int:
        return len(self.parent_ids)

    def recover_children(self, parent_id: int, parent_epoch: int, children: Any) -> None:
        self.parent_ids.add(parent_id)
        self.executions += len(children)

    def recover_many(self, rounds: Any) -> None:
        for parent_id, parent_epoch, children in rounds:
            self.recover_children(parent_id, parent_epoch, children)

    def deliver_many(self, parents: Any) -> None:
        self.parent_ids.update(parent_id for parent_id, _ in parents)

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        pass


def insert_pending(pending: int, per_parent: int) -> int:
    """Crashed parents (RUNNING, lease released) with ``per_parent`` executions each, RUNNING
    and PENDING under an expired lease, each in its own child session. Returns the parents."""
    from sqlalchemy import text

    from models import transaction

    parents = -(-pending // per_parent)
    with transaction() as s:
        s.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, epoch, started_at, updated_at)"
                " SELECT :u, 'NORMAL', 'main', 'RUNNING', 1, now(), now() FROM generate_series(1, :n)"
            ),
            {"u": PENDING_USER, "n": parents},
        )
        s.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, phase, epoch,"
                " started_at, updated_at)"
                " SELECT :u, 'SUBAGENT', p.id, 'reviewer', 'RUNNING', 0, now(), now()"
                " FROM (SELECT id, row_number() OVER (ORDER BY id) AS r FROM agent_session"
                "       WHERE user_id = :u AND session_type = 'NORMAL') p, generate_series(1, :k) k"
                " WHERE (p.r - 1) * :k + k <= :pending"
            ),
            {"u": PENDING_USER, "k": per_parent, "pending": pending},
        )
        s.execute(
            text(
                "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,"
                " status, delivery_status, invocation_type, parent_tool_call_id, started_at, epoch, lease_owner,"
                " lease_expires_at, total_tool_calls, rounds, prompt_tokens, completion_tokens, total_tokens)"
                " SELECT c.parent_session_id, c.id, 'reviewer', 'part of the work', 'RUNNING', 'PENDING',"
                " 'DELEGATE', 'call_' || c.id, now(), 1, 'dead-worker', now() - interval '1 minute', 0, 0, 0, 0, 0"
                " FROM agent_session c WHERE c.user_id = :u AND c.session_type = 'SUBAGENT'"
            ),
            {"u": PENDING_USER},
        )
    return parents


def put_parents_back() -> None:
    """Undo what a pass did to the crashed parents (taken: RESUMING, epoch + 1, reserved) and
    to their executions (whatever a scan may write on them: back to RUNNING under a lease that
    expired a minute ago)."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        s.execute(
            text(
                "UPDATE agent_session SET phase = 'RUNNING', lease_owner = NULL, lease_expires_at = NULL"
                " WHERE user_id = :u AND session_type = 'NORMAL'"
            ),
            {"u": PENDING_USER},
        )
        s.execute(
            text(
                "UPDATE subagent_execution e SET status = 'RUNNING', lease_owner = 'dead-worker',"
                " lease_expires_at = now() - interval '1 minute'"
                " FROM agent_session p WHERE p.id = e.parent_session_id AND p.user_id = :u"
                " AND e.delivery_status = 'PENDING'"
            ),
            {"u": PENDING_USER},
        )


def insert_history(rows: int, per_parent: int = 10) -> None:
    """``rows`` finished executions: 4 in 5 DELIVERED (terminal, delivered_at, tool call id),
    1 in 5 LEGACY (pre-upgrade: no tool call id, no invocation type). Every ``per_parent`` of
    them share one finished parent and one child session (follow-ups), so the foreign keys hold."""
    from sqlalchemy import text

    from bench._common import progress
    from models import transaction

    if rows == 0:
        return
    parents = -(-rows // per_parent)
    with transaction() as s:
        first = s.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, phase, epoch, started_at, updated_at)"
                " SELECT :u, 'NORMAL', 'main', CASE WHEN g % 3 = 0 THEN 'COMPLETED' ELSE 'WAITING_USER' END, 2,"
                " now() - interval '30 days', now() - interval '30 days' FROM generate_series(1, :n) g"
                " RETURNING id"
            ),
            {"u": HISTORY_USER, "n": parents},
        ).scalars()
        ids = sorted(first)
        if ids[-1] - ids[0] + 1 != parents:
            raise RuntimeError("the history parents did not get consecutive ids")
        first_parent = ids[0]
        s.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, phase, epoch,"
                " started_at, updated_at)"
                " SELECT :u, 'SUBAGENT', id, 'reviewer', 'COMPLETED', 1, started_at, updated_at"
                " FROM agent_session WHERE user_id = :u AND session_type = 'NORMAL' ORDER BY id"
            ),
            {"u": HISTORY_USER},
        )
        first_child = s.execute(
            text("SELECT min(id) FROM agent_session WHERE user_id = :u AND session_type = 'SUBAGENT'"),
            {"u": HISTORY_USER},
        ).scalar_one()
    progress(f"history: {2 * parents} finished sessions inserted")
    # Parent n (0-based) is first_parent + n and its child first_child + n (inserted in id order).
    done = 0
    while done < rows:
        batch = min(HISTORY_BATCH, rows - done)
        with transaction() as s:
            s.execute(
                text(
                    "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type,"
                    " task_description, status, delivery_status, invocation_type, parent_tool_call_id,"
                    " parent_result_delivered_at, started_at, completed_at, epoch, total_tool_calls, rounds,"
                    " prompt_tokens, completion_tokens, total_tokens, result)"
                    " SELECT :fp + g / :k, :fc + g / :k, 'reviewer', 'old work ' || g,"
                    " CASE WHEN g % 17 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,"
                    " CASE WHEN g % 5 = 0 THEN 'LEGACY' ELSE 'DELIVERED' END,"
                    " CASE WHEN g % 5 = 0 THEN NULL WHEN g % :k = 0 THEN 'DELEGATE' ELSE 'FOLLOWUP' END,"
                    " CASE WHEN g % 5 = 0 THEN NULL ELSE 'call_h' || g END,"
                    " CASE WHEN g % 5 = 0 THEN NULL ELSE now() - interval '30 days' END,"
                    " now() - interval '30 days', now() - interval '30 days', 1, 1, 2, 120, 30, 150,"
                    ' \'{"success": true, "result": "old answer"}\''
                    " FROM generate_series(:lo, :hi) g"
                ),
                {"fp": first_parent, "fc": first_child, "k": per_parent, "lo": done, "hi": done + batch - 1},
            )
        done += batch
        progress(f"history: {done}/{rows} finished executions inserted")


def vacuum_analyze() -> None:
    """What autovacuum does to a table that grew: visibility map and planner statistics."""
    from sqlalchemy import text

    from models import get_engine

    with get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("agent_session", "subagent_execution"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))


@dataclass
class Timing:
    scan_s: float  #: the median pass
    parents: int
    executions: int
    passes: list[float]  #: every timed pass, in seconds

    @property
    def spread_ms(self) -> str:
        return f"{min(self.passes) * 1000:.1f} .. {max(self.passes) * 1000:.1f} ms"


def time_scan(repeat: int) -> Timing:
    """Median of ``repeat`` full scan passes (and each of them), after one warm-up."""
    from recovery.scan import scan

    scans = []
    sched = CountingScheduler()
    for n in range(repeat + 1):
        put_parents_back()
        sched = CountingScheduler()
        started = time.perf_counter()
        report = scan(sched, callback_grace_seconds=0)
        elapsed = time.perf_counter() - started
        if not report.ran:
            raise RuntimeError("the scan did not run (another process holds the right to scan?)")
        if n:
            scans.append(elapsed)
    return Timing(statistics.median(scans), sched.parents, sched.executions, scans)


@dataclass
class Plan:
    statement: str  #: the statement's first characters
    lines: list[str]

    @property
    def execution_ms(self) -> float:
        return _execution_ms(self.lines)


def explain_scan() -> list[Plan]:
    """The scan's statements that read or write executions, captured during one pass, each
    EXPLAIN (ANALYZE, BUFFERS)-ed with its own parameters in a transaction that is rolled
    back (ANALYZE runs an UPDATE for real)."""
    from sqlalchemy import event

    from models import get_engine
    from recovery.scan import scan

    engine = get_engine()
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        head = statement.lstrip().split(None, 1)[0].upper()
        if "subagent_execution" in statement and head in ("SELECT", "UPDATE", "WITH") and not executemany:
            captured.append((statement, parameters))

    put_parents_back()
    event.listen(engine, "before_cursor_execute", capture)
    try:
        scan(CountingScheduler(), callback_grace_seconds=0)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    put_parents_back()
    plans = []
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        for statement, parameters in captured:
            sql = cursor.mogrify(statement, parameters).decode()
            cursor.execute("SET LOCAL jit = off")  # as the scan runs them (recovery.scan._bound_waits)
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
            plans.append(Plan(" ".join(statement.split())[:60], [r[0] for r in cursor.fetchall()]))
            raw.rollback()
    finally:
        raw.rollback()
        raw.close()
    return plans


def _total_ms(plans: list[Plan]) -> float:
    return sum(p.execution_ms for p in plans)


def _index_verdict(plans: list[Plan]) -> str:
    """yes when the partial index carries the scan and nothing reads executions sequentially."""
    seq = [p.statement for p in plans if any("Seq Scan on subagent_execution" in line for line in p.lines)]
    uses = sum(1 for p in plans if any("idx_sae_pending" in line for line in p.lines))
    if seq or not uses:
        return f"NO ({uses} of {len(plans)} statements use it; sequential scans in: {seq})"
    return f"yes ({uses} of {len(plans)} statements; no sequential scan of subagent_execution)"


def _join_filter_verdict(plans: list[Plan]) -> str:
    """The most rows one join of a statement compared and threw away: a nested loop joining two
    row sets the planner misjudged compares every pair (an upgrade day's backlog: quadratic)."""
    worst, where = 0, ""
    for p in plans:
        for line in p.lines:
            if "Rows Removed by Join Filter:" in line:
                removed = int(line.rsplit(":", 1)[1])
                if removed > worst:
                    worst, where = removed, p.statement
    return f"{worst} rows" + (f" ({where}...)" if where else "")


def _execution_ms(plan: list[str]) -> float:
    line = next((line for line in plan if line.strip().startswith("Execution Time:")), "Execution Time: nan ms")
    return float(line.split(":", 1)[1].split()[0])


# --- the scan at scale: --parents N ------------------------------------------------------------


def _broker_messages() -> int:
    """Messages waiting in the bench's broker database (every queue: Redis lists)."""
    import redis

    from bench._common import REDIS_BASE, REDIS_DBS

    client = redis.Redis.from_url(f"{REDIS_BASE}/{REDIS_DBS[0]}")
    try:
        total = 0
        for key in client.scan_iter(count=1000):
            if client.type(key) == b"list" and not key.startswith(b"_kombu"):
                total += client.llen(key)
        return total
    finally:
        client.close()


@dataclass
class ScalePass:
    scan_s: float  #: the scan call itself
    enqueued_s: float  #: scan start -> every execution's recover_child message in the broker
    taken: int  #: parents the scan reported as taken
    messages: int


def time_counting_pass() -> tuple[float, int]:
    """One pass of the real scan with a scheduler that enqueues nothing: the scan's own cost
    (the database), without the broker. (seconds, parents handed over)."""
    from recovery.scan import scan

    put_parents_back()
    vacuum_analyze()
    scheduler = CountingScheduler()
    started = time.perf_counter()
    report = scan(scheduler, callback_grace_seconds=0)
    elapsed = time.perf_counter() - started
    if not report.ran:
        raise RuntimeError("the scan did not run (another process holds the right to scan?)")
    return elapsed, scheduler.parents


def expected_messages(executions: int) -> int:
    """What the scheduler sends for a pass: one recover_child per execution, or above
    FAN_OUT_ABOVE executions one recovery.fan_out batch per FAN_OUT_BATCH (the workers then
    publish the per-execution messages in parallel; this bench runs no worker)."""
    from tasks.scheduler import FAN_OUT_ABOVE, FAN_OUT_BATCH

    if executions <= FAN_OUT_ABOVE:
        return executions
    return -(-executions // FAN_OUT_BATCH)


def time_scale_pass(parents: int, executions: int) -> ScalePass:
    """One pass of the real scan with the real Celery scheduler over the crashed state. A
    parent's recovery is enqueued when its executions' messages are in the broker (one
    recover_child per execution, or recovery.fan_out batches: ``expected_messages``)."""
    import tasks
    from bench._common import flush_redis, wait_for
    from recovery.scan import scan
    from tasks.scheduler import CeleryScheduler

    put_parents_back()
    vacuum_analyze()
    flush_redis()
    scheduler = CeleryScheduler(tasks.app)
    started = time.perf_counter()
    report = scan(scheduler, callback_grace_seconds=0)
    scan_s = time.perf_counter() - started
    if not report.ran:
        raise RuntimeError("the scan did not run (another process holds the right to scan?)")
    expected = expected_messages(executions)
    wait_for(
        lambda: _broker_messages() >= expected,
        timeout=120 + parents / 100,
        what="every execution's recovery in the broker",
        describe=lambda: f"{_broker_messages()}/{expected} messages",
        interval=0.01,
    )
    enqueued_s = time.perf_counter() - started
    return ScalePass(scan_s, enqueued_s, len(set(report.parents)), _broker_messages())


def run_scale(args: argparse.Namespace) -> int:
    from bench._common import bench_database, flush_redis, progress
    from bench._figures import median, system_load
    from devstack.processes import apply_env

    executions = args.parents * args.per_parent
    with bench_database("bench_scan") as url:
        from bench._common import bench_env

        # The scheduler's broker: the bench's Redis. Production lease settings: the scan reserves
        # executions for 2 x LEASE_SECONDS, and the bench stack's 3 s would lapse mid-pass.
        apply_env(bench_env(url, "http://127.0.0.1:9/v1", LEASE_SECONDS="30", SCAN_INTERVAL_SECONDS="30"))
        insert_pending(executions, args.per_parent)
        vacuum_analyze()
        load_before = system_load()
        print(
            f"scan at scale: {args.parents} crashed parents x {args.per_parent} executions (every lease expired), "
            f"real scan + Celery scheduler (broker only, no worker); {args.repeat} passes + 1 warm-up, "
            f"{load_before}",
            flush=True,
        )
        passes = []
        for n in range(args.repeat + 1):
            one = time_scale_pass(args.parents, executions)
            label = "warm-up" if n == 0 else f"pass {n}"
            progress(
                f"{label}: scan {one.scan_s:.2f} s, every recovery enqueued after {one.enqueued_s:.2f} s "
                f"({one.taken} parents taken, {one.messages} messages)"
            )
            if one.taken != args.parents:
                print(f"a pass took {one.taken} of {args.parents} parents")
                return 1
            if n:
                passes.append(one)
        flush_redis()
        alone = []
        for n in range(args.repeat + 1):
            seconds, handed = time_counting_pass()
            if handed != args.parents:
                print(f"a pass without the broker handed over {handed} of {args.parents} parents")
                return 1
            if n:
                alone.append(seconds)
        progress(f"without the broker: {statistics.median(alone):.2f} s per pass")
    load = system_load()
    enqueued = [p.enqueued_s for p in passes]
    scan_s = [p.scan_s for p in passes]
    print(
        f"scan start -> every parent's recovery enqueued: {median(enqueued):.3f} s "
        f"({_seconds_spread(enqueued)}, median of {args.repeat}; the scan call itself {median(scan_s):.3f} s, "
        f"{_seconds_spread(scan_s)})"
    )
    rates = [args.parents / s for s in enqueued]
    print(
        f"parents taken per second: {args.parents / median(enqueued):.0f} "
        f"(passes {min(rates):.0f} .. {max(rates):.0f}, median of {args.repeat}; {load_before} before, {load} after)"
    )
    print(
        f"the scan without the broker (a scheduler that only counts): {median(alone):.3f} s "
        f"({_seconds_spread(alone)}), {args.parents / median(alone):.0f} parents/s (median of {args.repeat}): "
        f"the rest is sending {expected_messages(executions)} messages "
        f"(recovery.fan_out batches for {executions} executions)"
    )
    return 0


def _seconds_spread(values: list[float]) -> str:
    return f"{min(values):.3f} .. {max(values):.3f} s"


# --- --steps: one pass's own steps, in this process --------------------------------------------


def run_steps(args: argparse.Namespace) -> int:
    import os
    from collections import defaultdict

    import recovery.scan as scan_module
    from bench._common import REDIS_BASE, REDIS_DBS, bench_database, progress
    from bench._figures import spread, system_load
    from bench.recovery import _date_completions_back, _expire_leases, delivered_only_script
    from doubles.scripted_model import ScriptedModelServer
    from harness.delivery_batch import deliver_rounds
    from harness.parent import run_agent
    from tests.helpers import RecordingScheduler, children_done_delivery_lost, loop_deps

    os.environ["REDIS_URL"] = f"{REDIS_BASE}/{REDIS_DBS[2]}"  # the session_status events, as in production
    steps: dict[str, list[float]] = defaultdict(list)
    real_step = scan_module._step

    def timed_step(name: str, *step_args: Any) -> None:
        started = time.perf_counter()
        try:
            real_step(name, *step_args)
        finally:
            steps[name].append((time.perf_counter() - started) * 1000)

    print(
        f"scan steps: {args.steps} parents in R16 x {args.per_parent} children, in this process; median of "
        f"{args.repeat} passes after one untimed; {system_load()}",
        flush=True,
    )
    firsts: list[float] = []
    wholes: list[float] = []
    scan_module._step = timed_step
    try:
        with bench_database("bench_scan_steps"), ScriptedModelServer(delivered_only_script(args.per_parent)) as model:
            for n in range(args.repeat + 1):
                for i in range(args.steps):
                    children_done_delivery_lost(model.base_url, f"job {i}: split the work")
                _date_completions_back()
                _expire_leases()
                sched = RecordingScheduler()
                handed: list[float] = []
                record = sched.deliver_many

                def first_hand_over(parents: Any, record: Any = record, handed: list[float] = handed) -> None:
                    handed.append(time.perf_counter())
                    record(parents)

                sched.deliver_many = first_hand_over
                started = time.perf_counter()
                report = scan_module.scan(sched, callback_grace_seconds=0)
                ended = time.perf_counter()
                if len(report.delivering) != args.steps * args.per_parent or not handed:
                    raise RuntimeError(f"the pass should deliver {args.steps} parents' rounds: {report}")
                if n:  # the first pass is untimed: imports, connections, compiled statements
                    firsts.append((handed[0] - started) * 1000)
                    wholes.append((ended - started) * 1000)
                else:
                    steps.clear()
                # Outside the timing: delivered and run, so that the next pass finds the same state.
                deps = loop_deps(model.base_url, RecordingScheduler(), lease_seconds=30)
                for parent_id, outcome in deliver_rounds(sched.deliveries).items():
                    if outcome.new_epoch is not None:
                        run_agent(parent_id, outcome.new_epoch, deps)
                progress(f"pass {n}{' (untimed)' if not n else ''}: {len(report.parents)} parents handed over")
    finally:
        scan_module._step = real_step
    print(f"scan start -> first hand-over: {statistics.median(firsts):.1f} ms ({spread(firsts, unit=' ms')})")
    print(f"scan start -> end of the pass: {statistics.median(wholes):.1f} ms ({spread(wholes, unit=' ms')})")
    for name, times in steps.items():
        print(f"  step {name:10s} {statistics.median(times):6.2f} ms ({spread(times, unit=' ms')})")
    print(f"median of {args.repeat} passes; {system_load()}")
    return 0


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/scan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--pending", type=int, default=1000, help="crashed executions to recover (default 1000)")
    parser.add_argument("--history", type=int, default=1_000_000, help="finished rows underneath (default 1000000)")
    parser.add_argument(
        "--per-parent", type=int, default=None, help="pending executions per parent (default 4; 3 with --parents)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per case, median printed (default 5)")
    parser.add_argument(
        "--parents", type=int, default=0, help="scan at scale: this many crashed parents instead of the history case"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="time one pass's steps instead, over this many parents in R16 (delivery lost), in this process",
    )
    args = parser.parse_args(argv)
    if args.per_parent is None:
        args.per_parent = 3 if args.parents or args.steps else 4
    if args.pending < 1 or args.history < 0 or args.per_parent < 1 or args.repeat < 1 or args.parents < 0:
        parser.error("--pending, --per-parent and --repeat must be >= 1, --history and --parents >= 0")
    if args.steps < 0 or (args.steps and args.parents):
        parser.error("--steps must be >= 0, and goes without --parents")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parents:
        return run_scale(args)
    if args.steps:
        return run_steps(args)
    import os

    from bench._common import REDIS_BASE, REDIS_DBS, bench_database, progress
    from bench._figures import system_load

    os.environ["REDIS_URL"] = f"{REDIS_BASE}/{REDIS_DBS[2]}"  # the scan's session_status events
    with bench_database("bench_scan") as url:
        del url
        parents = insert_pending(args.pending, args.per_parent)
        vacuum_analyze()
        load_before = system_load()
        print(
            f"scan: {args.pending} pending executions under {parents} crashed parents; median of {args.repeat} "
            f"passes; {load_before}",
            flush=True,
        )
        empty = time_scan(args.repeat)
        empty_plans = explain_scan()
        progress(f"over 0 historic rows: scan {empty.scan_s * 1000:.1f} ms; inserting {args.history} historic rows")
        started = time.monotonic()
        insert_history(args.history)
        vacuum_analyze()
        progress(f"history inserted and analyzed in {time.monotonic() - started:.1f} s")
        full = time_scan(args.repeat)
        plans = explain_scan()
    if (empty.parents, empty.executions) != (full.parents, full.executions) or full.executions != args.pending:
        print(f"each pass should hand over {args.pending} executions: {empty} vs {full}")
        return 1
    print(f"  each pass takes {full.parents} parents and hands over {full.executions} executions")
    print(f"scan over 0 historic rows: {empty.scan_s * 1000:.1f} ms ({empty.spread_ms}, median of {args.repeat})")
    print(
        f"scan over {args.history} historic rows: {full.scan_s * 1000:.1f} ms "
        f"({full.spread_ms}, median of {args.repeat})"
    )
    print(
        f"ratio history/empty: scan {full.scan_s / empty.scan_s:.2f} "
        f"(at the extremes of the passes {min(full.passes) / max(empty.passes):.2f} .. "
        f"{max(full.passes) / min(empty.passes):.2f}; "
        f"{load_before} before, {system_load()} after)"
    )
    print(
        f"the scan's {len(plans)} statements on subagent_execution inside PostgreSQL (EXPLAIN ANALYZE execution "
        f"time, summed): {_total_ms(empty_plans):.3f} ms over 0 rows, {_total_ms(plans):.3f} ms over "
        f"{args.history} rows"
    )
    costliest = max(plans, key=lambda p: p.execution_ms)
    print(f"EXPLAIN (ANALYZE, BUFFERS) of the costliest over {args.history} historic rows ({costliest.statement}...):")
    for line in costliest.lines:
        print(f"  {line}")
    print(f"plan uses idx_sae_pending: {_index_verdict(plans)}")
    print(f"most rows a join of the scan compared and dropped: {_join_filter_verdict(plans)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
