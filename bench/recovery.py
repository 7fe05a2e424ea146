"""Recovery throughput: ``python bench/recovery.py --parents P --children K [--workers N]``.

1. Crash: one real prefork worker runs P parents; each delegates K children on the normal
   path (pending round + executions committed, children enqueued); the children hang in their
   model call; once every round is committed and the worker's pool holds children, the worker
   is SIGKILLed and the broker flushed (every delivery must then come from the database, I7).
2. Recover: N fresh workers start (their boot scans find only live leases and do nothing);
   the leases are expired (the time a real restart waits) and ``recovery.scan`` is sent.
   Timed from the scan to every parent resumed: every execution DELIVERED and every parent
   WAITING_USER with its final answer. The model now answers at once.
3. Ceiling: in the same run, as many connections as the recovering workers have pool
   processes commit the delivery's transaction shape (2 message inserts + 1 execution
   update) as fast as PostgreSQL takes them, through the same driver (psycopg2).

Prints deliveries/s, the ceiling and the ratio ours/ceiling (medians of ``--runs`` runs, each
on a fresh database); checks invariants I1–I5 over the whole database and exits 1 when one is
violated.

``--delivered-only`` (docs/fault-model.md, R16): instead of a crash, P parents delegate K children through the
real loop in this process, every child COMPLETES, and the last one's delivery is never run (the
state a crash between the last child and ``deliver_round`` leaves). The children's completion and
the leases are then dated in the past, and ``recovery.scan`` is sent: the scan hands each
parent to ``deliver_round`` alone, no child runs again (checked against the model's journal).
Deliveries/s is then the delivery path alone, beside the same commit ceiling.

``--warm`` (with ``--delivered-only``): before the timed state is made, an untimed R16 round of
P other parents runs through the same workers (scan, delivery, every parent resumed), so the
timed window finds pool processes that have already compiled the delivery's statements and
opened their connections. The difference to a run without it is what a pool process's first
tasks cost.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

MAIN = "main agent"
#: Seconds the children's model call hangs before the crash (the kill comes long before).
HANG_SECONDS = 600
#: Leases written before the crash outlive the new workers' boot (their boot scans must find
#: nothing to take, so that the timed scan does all the work).
CRASH_LEASE_SECONDS = "120"


def crash_script(children: int) -> list[dict[str, Any]]:
    """The model before the crash: the parent delegates K children, the children hang."""
    calls = [
        {
            "name": "delegate",
            "arguments": {"agent_type": ("reviewer", "researcher")[i % 2], "task": f"part {i} of the work"},
        }
        for i in range(children)
    ]
    return [
        {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": calls}},
        {
            "when": {"system_contains": "subagent", "turn": 0},
            "reply": {"content": "never sent"},
            "delay_seconds": HANG_SECONDS,
        },
    ]


#: The model after the crash: children answer at once, the resumed parent answers at once.
#: No rule for the parent's turn 0: a parent that delegated again would fail loudly.
RECOVERY_SCRIPT: list[dict[str, Any]] = [
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "combined: {tool_results}"}},
    {"when": {"system_contains": "subagent", "turn": 0}, "reply": {"content": "child answer"}},
]


@dataclass
class RecoveryFigures:
    parents: int
    children: int
    workers: int
    concurrency: int
    taken_before_crash: int = 0
    first_delivery_s: float = 0.0
    all_delivered_s: float = 0.0
    all_resumed_s: float = 0.0
    invariants: list[str] = field(default_factory=list)
    #: ``--cpu``: the timed window's CPU by process class (bench._cpu)
    cpu: Any = None

    @property
    def executions(self) -> int:
        return self.parents * self.children

    @property
    def connections(self) -> int:
        return self.workers * self.concurrency

    @property
    def deliveries_per_second(self) -> float:
        return self.executions / self.all_resumed_s


def _counts() -> dict[str, int]:
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        row = s.execute(
            text(
                "SELECT"
                " (SELECT count(*) FROM pending_round WHERE closed_at IS NULL) AS open_rounds,"
                " (SELECT count(*) FROM subagent_execution) AS executions,"
                " (SELECT count(*) FROM subagent_execution WHERE lease_owner IS NOT NULL) AS taken,"
                " (SELECT count(*) FROM subagent_execution WHERE delivery_status = 'DELIVERED') AS delivered,"
                " (SELECT count(*) FROM agent_session WHERE session_type = 'NORMAL' AND phase = 'WAITING_USER')"
                "   AS resumed,"
                " (SELECT count(*) FROM agent_session WHERE session_type = 'NORMAL' AND phase = 'FAILED') AS failed,"
                " (SELECT count(*) FROM agent_session WHERE phase = 'RESUMING') AS resuming,"
                " (SELECT count(*) FROM subagent_execution WHERE status = 'RECOVERING') AS recovering"
            )
        ).one()
    return dict(row._mapping)


def _lapse_scan_right() -> None:
    """The right to scan of the killed worker (its boot scan may hold it when the SIGKILL lands)
    has lapsed, as it would have by the time a real restart's workers boot: the fresh workers'
    boot scans run at once instead of waiting for it (with ``CRASH_LEASE_SECONDS`` the right
    lasts as long as a lease)."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        s.execute(
            text("UPDATE recovery_scan SET held_until = now() - interval '1 second' WHERE held_until IS NOT NULL")
        )


def _expire_leases() -> None:
    """The passage of time after the crash: every lease and reservation has lapsed."""
    from sqlalchemy import text

    from models import transaction

    _lapse_scan_right()
    with transaction() as s:
        for table in ("subagent_execution", "agent_session"):
            s.execute(
                text(
                    f"UPDATE {table} SET lease_expires_at = now() - interval '1 second'"
                    " WHERE lease_expires_at IS NOT NULL"
                )
            )


def delivered_only_script(children: int) -> list[dict[str, Any]]:
    """Every answer at once: the parent delegates K children, each child answers, the resumed
    parent answers. Rule 1 is the children's: the journal counts how often it answered."""
    calls = crash_script(children)[0]
    return [
        calls,
        {"when": {"system_contains": "subagent", "turn": 0}, "reply": {"content": "child answer"}},
        *RECOVERY_SCRIPT[:1],
    ]


def _date_completions_back() -> None:
    """The passage of time after the lost callbacks: the scan's callback grace has run out."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        s.execute(
            text(
                "UPDATE subagent_execution SET completed_at = completed_at - interval '1 hour'"
                " WHERE completed_at IS NOT NULL AND delivery_status = 'PENDING'"
            )
        )


def _db_times(since: datetime | None = None) -> tuple[datetime, datetime, datetime]:
    """(first delivery, last delivery, last parent's final answer) as written by the workers;
    ``since``: only what was written from then on (a warm-up round's rows are older)."""
    from sqlalchemy import text

    from models import transaction

    bound = {"since": since or datetime(1970, 1, 1)}
    with transaction() as s:
        first, last = s.execute(
            text(
                "SELECT min(parent_result_delivered_at), max(parent_result_delivered_at) FROM subagent_execution"
                " WHERE parent_result_delivered_at >= :since"
            ),
            bound,
        ).one()
        resumed = s.execute(
            text(
                "SELECT max(m.created_at) FROM message m JOIN agent_session a ON a.id = m.session_id"
                " WHERE a.session_type = 'NORMAL' AND m.role = 'ASSISTANT' AND m.tool_calls IS NULL"
                " AND NOT m.deleted AND m.created_at >= :since"
            ),
            bound,
        ).scalar_one()
    return first, last, resumed


def run_recovery(
    url: str, *, parents: int, children: int, workers: int, concurrency: int, cpu: bool = False
) -> RecoveryFigures:
    """Crash and recover P x K on ``url`` (a migrated, empty database); see the module doc."""
    import tasks
    from bench._common import Stack, bench_env, flush_redis, progress, wait_for
    from bench._cpu import settle, start_meter
    from devstack.processes import apply_env
    from harness.views import create_session
    from models import transaction
    from models.base import utcnow
    from recovery.invariants import check_all

    figures = RecoveryFigures(parents, children, workers, concurrency)
    expected = parents * children
    flush_redis()
    with Stack("bench-recovery") as stack:
        # 1. the crash
        hanging = stack.model(crash_script(children))
        env = bench_env(url, hanging.base_url, LEASE_SECONDS=CRASH_LEASE_SECONDS)
        apply_env(env)
        # Every parent is queued before the worker starts: the queue is FIFO, so each parent runs
        # before any child (the children hang and would otherwise hold every pool process).
        for i in range(parents):
            sid = create_session("main", f"job {i}: split the work")
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        progress(f"{parents} parents queued; worker 'crash' runs them (each delegates {children} children)")
        doomed = stack.worker(env, "crash", concurrency=concurrency)

        def crashed_state() -> bool:
            c = _counts()
            return (
                c["open_rounds"] == parents and c["executions"] == expected and c["taken"] >= min(expected, concurrency)
            )

        def crash_status() -> str:
            c = _counts()
            return f"{c['open_rounds']}/{parents} rounds committed, {c['taken']} children running"

        wait_for(crashed_state, timeout=60 + parents, what="every round committed", describe=crash_status)
        figures.taken_before_crash = _counts()["taken"]
        doomed.kill()
        hanging.stop()
        flush_redis()
        progress(
            f"worker SIGKILLed with {parents} open rounds and {expected} executions RUNNING "
            f"({figures.taken_before_crash} in a pool process); broker flushed"
        )

        # 2. the recovery
        _lapse_scan_right()
        instant = stack.model(RECOVERY_SCRIPT)
        env = bench_env(url, instant.base_url)
        apply_env(env)
        fresh = [stack.worker(env, f"r{n + 1}", concurrency=concurrency) for n in range(workers)]
        wait_for(
            lambda: all("event=subagent_recovery_scan" in w.log() for w in fresh),
            timeout=30,
            what="the boot scans",
        )
        c = _counts()
        if c["resuming"] or c["recovering"]:
            print(f"  note: a boot scan took work before the timed scan ({c['resuming']} parents)", flush=True)
        _expire_leases()
        progress(settle().note())
        meter = start_meter([w.proc.pid for w in fresh], url) if cpu else None
        t0 = utcnow()
        tasks.app.signature("recovery.scan").apply_async()

        def recovered() -> bool:
            c = _counts()
            if c["failed"]:
                raise RuntimeError(f"{c['failed']} parents FAILED during recovery (see the worker logs)")
            return c["delivered"] == expected and c["resumed"] == parents

        def recovery_status() -> str:
            c = _counts()
            return f"{c['delivered']}/{expected} delivered, {c['resumed']}/{parents} parents resumed"

        try:
            wait_for(recovered, timeout=120 + 2 * expected, what="every parent resumed", describe=recovery_status)
            figures.cpu = meter.stop() if meter else None
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        first, last, resumed = _db_times()
        figures.first_delivery_s = (first - t0).total_seconds()
        figures.all_delivered_s = (last - t0).total_seconds()
        figures.all_resumed_s = (resumed - t0).total_seconds()
        with transaction() as s:
            figures.invariants = check_all(s, settled=True)
    return figures


def _r16_state(model: Any, parents: int, children: int, kind: str) -> dict[str, int]:
    """P parents in R16 (children COMPLETED, results undelivered), completions and leases dated
    back; returns the counts from before they were made."""
    from bench._common import progress
    from tests.helpers import children_done_delivery_lost

    expected = parents * children
    before = _counts()
    for i in range(parents):
        children_done_delivery_lost(model.base_url, f"job {i}: split the work")
    c = _counts()
    if c["executions"] - before["executions"] != expected or c["delivered"] != before["delivered"]:
        raise RuntimeError(f"the R16 state is not what it should be: {c} (before it: {before})")
    progress(
        f"{kind}: {parents} parents delegated {expected} children in this process; "
        "every child COMPLETED, none delivered"
    )
    _date_completions_back()
    _expire_leases()
    return before


def run_delivery_only(
    url: str,
    *,
    parents: int,
    children: int,
    workers: int,
    concurrency: int,
    cpu: bool = False,
    warm: bool = False,
) -> RecoveryFigures:
    """R16 on ``url`` (a migrated, empty database): every child COMPLETED, every result
    undelivered, no delivery on its way; timed from the scan to every parent resumed. ``warm``:
    one untimed R16 round of as many parents through the same workers first."""
    import tasks
    from bench._common import Stack, bench_env, flush_redis, progress, wait_for
    from bench._cpu import settle, start_meter
    from devstack.processes import apply_env
    from models import transaction
    from models.base import utcnow
    from recovery.invariants import check_all

    figures = RecoveryFigures(parents, children, workers, concurrency)
    expected = parents * children
    flush_redis()
    with Stack("bench-delivery") as stack:
        model = stack.model(delivered_only_script(children))
        env = bench_env(url, model.base_url)
        apply_env(env)
        fresh = [stack.worker(env, f"r{n + 1}", concurrency=concurrency) for n in range(workers)]
        wait_for(
            lambda: all("event=subagent_recovery_scan" in w.log() for w in fresh),
            timeout=30,
            what="the boot scans",
        )
        # After the boot scans: no worker scans again (no beat) until a scan is sent.
        if warm:
            warmed = _r16_state(model, parents, children, "warm-up")
            tasks.app.signature("recovery.scan").apply_async()
            wait_for(
                lambda: _counts()["resumed"] == warmed["resumed"] + parents,
                timeout=60 + expected,
                what="every warm-up parent resumed",
            )
            progress(f"warm-up: {parents} parents delivered and resumed by the same workers (untimed)")
        before = _r16_state(model, parents, children, "timed")
        child_answers = sum(1 for entry in model.journal() if entry.get("rule") == 1)
        progress(settle().note())
        meter = start_meter([w.proc.pid for w in fresh], url) if cpu else None
        t0 = utcnow()
        tasks.app.signature("recovery.scan").apply_async()

        def recovered() -> bool:
            c = _counts()
            if c["failed"]:
                raise RuntimeError(f"{c['failed']} parents FAILED during delivery (see the worker logs)")
            return c["delivered"] == before["delivered"] + expected and c["resumed"] == before["resumed"] + parents

        def status() -> str:
            c = _counts()
            return (
                f"{c['delivered'] - before['delivered']}/{expected} delivered, "
                f"{c['resumed'] - before['resumed']}/{parents} parents resumed"
            )

        try:
            wait_for(recovered, timeout=60 + expected, what="every parent resumed", describe=status)
            figures.cpu = meter.stop() if meter else None
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        first, last, resumed = _db_times(since=t0)
        figures.first_delivery_s = (first - t0).total_seconds()
        figures.all_delivered_s = (last - t0).total_seconds()
        figures.all_resumed_s = (resumed - t0).total_seconds()
        with transaction() as s:
            figures.invariants = check_all(s, settled=True)
        rerun = sum(1 for entry in model.journal() if entry.get("rule") == 1) - child_answers
        if rerun:
            figures.invariants.append(f"R16: {rerun} children asked the model again during delivery")
    return figures


# --- the PostgreSQL commit ceiling for the delivery's transaction shape ----------------------

ASSISTANT_CALLS = (
    '[{"id": "call_%s", "type": "function", "function": {"name": "delegate",'
    ' "arguments": "{\\"agent_type\\": \\"reviewer\\", \\"task\\": \\"part 0 of the work\\"}"}}]'
)
TOOL_CONTENT = (
    '{"success": true, "agent_type": "reviewer", "child_session_id": %d, "result": "child answer",'
    ' "rounds": 1, "tool_calls": 0, "prompt_tokens": 40, "completion_tokens": 3}'
)


@dataclass
class CeilingFigures:
    connections: int
    seconds: float
    transactions: int

    @property
    def per_second(self) -> float:
        return self.transactions / self.seconds


def commit_ceiling(url: str, *, connections: int, seconds: float, rows_per_connection: int = 20_000) -> CeilingFigures:
    """``connections`` threads, each on its own psycopg2 connection, commit for ``seconds``:
    INSERT assistant, INSERT TOOL, UPDATE one execution's delivery marker, COMMIT. Scratch
    parents and executions (one stripe per connection, so no row lock is shared) are created
    first; they stay in the throwaway database."""
    import psycopg2
    from sqlalchemy import make_url, text

    from models import transaction

    with transaction() as s:
        stripes: list[tuple[int, int, list[int]]] = []
        for _ in range(connections):
            parent = s.execute(
                text(
                    "INSERT INTO agent_session (user_id, session_type, agent_type, phase, epoch, started_at,"
                    " updated_at) VALUES ('bench', 'NORMAL', 'main', 'WAITING_USER', 0, now(), now()) RETURNING id"
                )
            ).scalar_one()
            child = s.execute(
                text(
                    "INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, phase, epoch,"
                    " started_at, updated_at) VALUES ('bench', 'SUBAGENT', :p, 'reviewer', 'COMPLETED', 0, now(),"
                    " now()) RETURNING id"
                ),
                {"p": parent},
            ).scalar_one()
            ids = (
                s.execute(
                    text(
                        "INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type,"
                        " task_description, status, delivery_status, invocation_type, parent_tool_call_id,"
                        " started_at, completed_at, epoch, total_tool_calls, rounds, prompt_tokens,"
                        " completion_tokens, total_tokens)"
                        " SELECT :p, :c, 'reviewer', 'part 0 of the work', 'COMPLETED', 'PENDING', 'DELEGATE',"
                        " 'ceil_' || g, now(), now(), 1, 0, 1, 40, 3, 43 FROM generate_series(1, :n) g RETURNING id"
                    ),
                    {"p": parent, "c": child, "n": rows_per_connection},
                )
                .scalars()
                .all()
            )
            stripes.append((parent, child, list(ids)))
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    start = threading.Barrier(connections + 1)
    counts = [0] * connections
    errors: list[BaseException] = []
    stop_at = [0.0]

    def commit_loop(n: int) -> None:
        parent, child, ids = stripes[n]
        conn = psycopg2.connect(dsn)
        try:
            cur = conn.cursor()
            start.wait()
            i = 0
            while time.monotonic() < stop_at[0]:
                eid = ids[i % len(ids)]
                call_id = f"ceil_{n}_{i}"
                cur.execute(
                    "INSERT INTO message (session_id, role, content, tool_calls, deleted, created_at)"
                    " VALUES (%s, 'ASSISTANT', '', %s, false, now()) RETURNING id",
                    (parent, ASSISTANT_CALLS % call_id),
                )
                assistant_id = cur.fetchone()[0]
                cur.execute(
                    "INSERT INTO message (session_id, role, content, tool_call_id, source_session_id, deleted,"
                    " created_at) VALUES (%s, 'TOOL', %s, %s, %s, false, now()) RETURNING id",
                    (parent, TOOL_CONTENT % child, call_id, child),
                )
                tool_id = cur.fetchone()[0]
                cur.execute(
                    "UPDATE subagent_execution SET delivery_status = 'DELIVERED', parent_result_delivered_at = now(),"
                    " parent_assistant_message_id = %s, parent_tool_message_id = %s WHERE id = %s",
                    (assistant_id, tool_id, eid),
                )
                conn.commit()
                i += 1
            counts[n] = i
        except BaseException as exc:
            errors.append(exc)
            raise
        finally:
            conn.close()

    threads = [threading.Thread(target=commit_loop, args=(n,), daemon=True) for n in range(connections)]
    for t in threads:
        t.start()
    stop_at[0] = time.monotonic() + seconds + 0.05
    began = time.monotonic()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - began
    if errors:
        raise RuntimeError(f"ceiling measurement failed: {errors[0]!r}")
    return CeilingFigures(connections, elapsed, sum(counts))


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench._cpu import add_cpu_option
    from bench._figures import loads

    parser = argparse.ArgumentParser(prog="bench/recovery.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parents",
        type=loads,
        default=[20],
        help="parents crashed mid-flight (default 20); several, comma-separated (20,50,100): the whole bench "
        "at each count, then its ratios by load",
    )
    parser.add_argument("--children", type=int, default=3, help="children delegated by each parent (default 3)")
    parser.add_argument("--workers", type=int, default=1, help="fresh worker processes that recover (default 1)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size of each worker (default 2)")
    parser.add_argument(
        "--ceiling-seconds", type=float, default=3.0, help="how long the commit ceiling is measured (default 3)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs, each on a fresh database; medians (default 3)")
    parser.add_argument(
        "--delivered-only",
        action="store_true",
        help="R16: every child already COMPLETED, only the delivery runs (no child re-runs)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="with --delivered-only: one untimed round of as many parents through the same workers first "
        "(the timed window then finds warm pool processes)",
    )
    add_cpu_option(
        parser, "also print where each run's CPU went (pool, Celery main, PostgreSQL backends, bench; Linux)"
    )
    args = parser.parse_args(argv)
    if args.warm and not args.delivered_only:
        parser.error("--warm goes with --delivered-only")
    for name in ("children", "workers", "concurrency", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench._figures import run_by_load

    return run_by_load(args, _measure, "ours / the commit ceiling")


def _measure(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
    """The runs at ``args.parents`` parents; prints the figures; returns (exit status, the
    ratio and our deliveries/s by name)."""
    from bench._common import bench_database, progress
    from bench._cpu import settle
    from bench._figures import median, system_load

    mode = "delivery only (R16: children COMPLETED, results undelivered)" if args.delivered_only else "crash"
    if args.warm:
        mode += ", warm pools (one untimed round of as many parents first)"
    run = functools.partial(run_delivery_only, warm=args.warm) if args.delivered_only else run_recovery
    print(
        f"recovery, {mode}: {args.parents} parents x {args.children} children = {args.parents * args.children} "
        f"executions; {args.workers} worker(s) x {args.concurrency} pool processes recover; {args.runs} run(s), "
        f"{system_load()}",
        flush=True,
    )
    runs: list[tuple[RecoveryFigures, CeilingFigures]] = []
    for n in range(1, args.runs + 1):
        with bench_database("bench_recovery") as url:
            ours = run(
                url,
                parents=args.parents,
                children=args.children,
                workers=args.workers,
                concurrency=args.concurrency,
                cpu=args.cpu,
            )
            progress(f"measuring the commit ceiling with {ours.connections} connections for {args.ceiling_seconds:g}s")
            progress(settle().note())
            ceiling = commit_ceiling(url, connections=ours.connections, seconds=args.ceiling_seconds)
        runs.append((ours, ceiling))
        print(
            f"  run {n}: {ours.deliveries_per_second:.1f} deliveries/s (every parent resumed "
            f"{ours.all_resumed_s:.3f} s "
            f"after the scan), ceiling {ceiling.per_second:.0f} tx/s, ratio "
            f"{ours.deliveries_per_second / ceiling.per_second:.4f}; {system_load()}",
            flush=True,
        )
        if ours.cpu is not None:
            print(ours.cpu.report(per=ours.executions, unit="delivery"), flush=True)
    ours, ceiling = runs[len(runs) // 2]
    first = median([o.first_delivery_s for o, _ in runs])
    delivered = median([o.all_delivered_s for o, _ in runs])
    resumed = median([o.all_resumed_s for o, _ in runs])
    rate = median([o.deliveries_per_second for o, _ in runs])
    ceiling_rate = median([c.per_second for _, c in runs])
    ratio = median([o.deliveries_per_second / c.per_second for o, c in runs])
    label = ""
    if args.delivered_only:
        label = "delivery only (R16, warm pools), " if args.warm else "delivery only (R16), "
    print(f"  scan -> first delivery:       {first:8.3f} s (median of {args.runs})")
    print(f"  scan -> all delivered:        {delivered:8.3f} s")
    print(f"  scan -> every parent resumed: {resumed:8.3f} s")
    rates = [o.deliveries_per_second for o, _ in runs]
    each = [o.deliveries_per_second / c.per_second for o, c in runs]
    print(
        f"{label}deliveries/s: {rate:.1f} ({ours.executions} executions, scan -> every parent resumed; "
        f"median of {args.runs}; runs {min(rates):.1f} .. {max(rates):.1f})"
    )
    print(
        f"commit ceiling: {ceiling_rate:.0f} tx/s (2 message inserts + 1 execution update per transaction, "
        f"{ceiling.connections} connections, {ceiling.seconds:.2f} s per run; median of {args.runs})"
    )
    print(
        f"{label}ratio ours/ceiling: {ratio:.4f} (median of the runs' ratios, {min(each):.4f} .. {max(each):.4f}; "
        f"{system_load()})"
    )
    found = {f"{label}ratio ours/ceiling": ratio, f"{label}deliveries/s": rate, "commit ceiling, tx/s": ceiling_rate}
    problems = [f"run {n}: {p}" for n, (o, _) in enumerate(runs, start=1) for p in o.invariants]
    if problems:
        print(f"invariants I1-I5: VIOLATED ({len(problems)})")
        for problem in problems:
            print(f"  {problem}")
        return 1, found
    print(f"invariants I1-I5: ok ({ours.executions} executions, {ours.parents} parents, each run)")
    return 0, found


if __name__ == "__main__":
    raise SystemExit(main())
