"""How cost grows with load: ``python bench/scale.py [--parents 10,100,1000] [--workers 1,2,4]
[--children 3] [--trials 1] [--pool prefork|threads|gevent] [--concurrency 1] [--model-latency 0]
[--kinds ours,naive] [--kill-at-half] [--topology bare|procfile] [--out docs/img/scale.png]
[--latency-out docs/img/scale-latency.png] [--quick]``.

``--model-latency`` delays every scripted model reply: a fixed ``SECONDS``, or
``lognormal:MU,SIGMA`` (each reply waits exp(N(MU, SIGMA)) seconds: ``lognormal:0.5,0.5`` has a
median of 1.6 s), as a real provider's latency; several fixed delays (``0,1,2,5``) run the whole
load at each and draw parents/s against latency (``--latency-out``) instead of the load plot.
``--pool`` and ``--concurrency`` are Celery's ``-P`` and ``-c`` of every worker, ours and the
naive one alike (the naive workers size their database pool from ``-c`` as ours do;
docs/scaling.md); gevent needs ``pip install gevent psycogreen``.

``--topology procfile`` (ours only, ``--workers 1``) starts ours as the Procfile does, the
README's worker command: each of its ``celery ... worker`` lines with its own arguments, read
from the Procfile (``devstack.processes.procfile_workers``): the ``celery`` queue's threads
worker and the ``recovery`` queue's prefork worker, and its beat (``SCAN_INTERVAL_SECONDS`` 30).
``--concurrency`` then replaces only the threads line's ``-c`` (default: the Procfile's);
``--pool`` is the Procfile's. The workers' figures (CPU, memory, connections) count both
workers; ``all MB`` is the sum of every worker process's peak (``VmHWM``), an upper bound of
their memory at any one moment. The default, ``bare``, starts W workers serving every queue,
each ``-P --pool -c --concurrency``.

``--kill-at-half`` (ours only; a beat runs throughout, as the Procfile's): once half the parents
have answered, every worker is SIGKILLed and started again with the same command under the same
``-n`` name (its boot takes its predecessor's work back); it prints the parents answered at the
kill, the time from the restart to the last answer in leases (LEASE_SECONDS 30), and whether
every parent was answered, and every child delivered, exactly once.

For each worker count W (``--workers``), load N (``--parents``) and trial, W fresh real
``celery -A tasks worker`` processes (each a ``--pool`` pool of ``--concurrency``) and W
fresh naive workers (``bench/_naive_app.py``, its own queue and database, as
``bench/delegation.py`` uses it) start; N parents are submitted at once to ours, then N to the
naive baseline, and each kind's workers stop when their step is done (a PostgreSQL backend
publishes its counters when its connection ends; idle, only every 10 s). Each parent delegates
``--children`` children of the instant scripted model (``doubles/``), gets their results back
in one round and answers. Before a step the parents' sessions and first messages are written
(outside the figures); the step is timed from the first task sent to the last parent's answer,
each parent from its own submission to its answer committed (the message's timestamp, written
by the worker; the session_status events only say when to look). No beat runs: the scan is measured on its own (below).

Per (kind, W, N), medians over the trials (spread beside): throughput (parents/s), p50 and p99
of submission -> answer (p99 over every parent of every trial), and what each parent cost the
database, measured during the step: SQL statements the workers sent (counted by SQLAlchemy in
each worker process, ``bench/_counting/``: the shared server does not preload
pg_stat_statements), transactions committed and rows inserted/updated/deleted
(``pg_stat_database`` of the kind's own database), WAL bytes (``pg_current_wal_lsn()`` before and
after: cluster-wide, so every other writer on the server counts too; take it on a quiet
server); and the high-water mark of resident memory (``VmHWM``) of each worker's main process
and of its pool processes, read at the end of the step; sampled every 0.2 s during the step,
the peak of loops in flight (ours: sessions and executions holding a live lease) and of the
PostgreSQL connections the kind's workers hold open (``application_name``, set by PGAPPNAME).

Then the scan's cost per pass as history grows (``--history``, bench/scan.py's functions): one
pass of the real ``recovery.scan.scan`` over a few crashed parents (``--scan-pending``
executions) above 0, 100k and 1M finished executions.

A PNG of p50/p99 and throughput against N, one line per worker count, ours solid and naive
dashed, is written to ``--out`` (needs the ``bench`` extra's matplotlib; without it the plot is
skipped, said in one line). Exactly-once (I1-I5) is checked over our database at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench._scale_plots import plot, plot_latency
from bench._scale_probes import (
    WORKER_APP_NAME,
    Answers,
    Checker,
    Sampler,
    ServerStatements,
    answer_times,
    close_connections,
    cpu_seconds,
    db_counters,
    not_once,
    peak_memory,
    statements_key,
    storage_per_parent,
    summed_peak_memory,
    table_counters,
    wal_between,
)

ROOT = Path(__file__).resolve().parent.parent
COUNTING = ROOT / "bench" / "_counting"
OURS, NAIVE = "ours", "naive"
#: Celery's -P of the workers: gevent needs the ``gevent`` and ``psycogreen`` packages (not
#: project dependencies; the workers then make psycopg2 cooperative, bench/_counting/).
POOLS = ("prefork", "threads", "gevent")
#: Seconds for an ended backend to publish its counters, and for the statement counters'
#: flusher threads (every 0.1 s).
STATS_SETTLE_SECONDS = 0.5
#: The workers' LEASE_SECONDS: production's (a deep queue is no reason to take work back).
LEASE_SECONDS = 30.0
#: --topology: ``bare`` workers serving every queue, or the Procfile's lines.
TOPOLOGIES = ("bare", "procfile")
QUICK = {"parents": "10,30", "workers": "1,2", "history": "0,2000", "scan_pending": 30}


# --- the two kinds ---------------------------------------------------------------------------


def create_ours(n: int, label: str) -> list[int]:
    """N sessions through the real submit path (``harness.views.create_session``)."""
    from harness.views import create_session

    return [create_session("main", f"{label} parent {i}: split the work") for i in range(n)]


def create_naive(n: int, url: str, label: str) -> list[int]:
    """N sessions and their first USER messages on the naive database (as bench/delegation.py)."""
    from bench._common import naive_sessions

    return naive_sessions(url, [f"{label} parent {i}: split the work" for i in range(n)])


def submit(kind: str, ids: list[int]) -> dict[int, float]:
    """Sends every parent's first task; returns each one's submission time (epoch seconds)."""
    import tasks
    from bench._naive_app import run

    sent: dict[int, float] = {}
    for sid in ids:
        sent[sid] = time.time()
        if kind == OURS:
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        else:
            run.apply_async((sid,))
    return sent


# --- one step ----------------------------------------------------------------------------------


@dataclass
class Step:
    kind: str
    workers: int
    parents: int
    throughput: float  #: parents / (first submission -> last answer)
    latencies: list[float]  #: submission -> answer of each parent, seconds
    cost: dict[str, int]  #: database counters of the step (whole step, not per parent)
    main_mb: float
    pool_mb: float
    tables: dict[str, tuple[int, ...]]  #: per table: rows inserted, updated, HOT updated, deleted
    in_flight: int = 0  #: peak of loops holding a live lease (ours; 0 for naive: not sampled)
    connections: int = 0  #: peak of PostgreSQL connections the workers held open
    kill: Kill | None = None  #: --kill-at-half: what the kill and the restart gave
    all_mb: float = 0.0  #: the sum of every worker process's peak resident memory (VmHWM)

    def per_parent(self, name: str) -> float:
        return self.cost[name] / self.parents


@dataclass(frozen=True)
class Kill:
    """``--kill-at-half``: every worker SIGKILLed once half the parents had answered, then
    started again under its name."""

    answered_before: int  #: parents answered when the workers were killed
    restart_to_last_s: float  #: the restarted workers spawned -> the last parent's answer
    lease_seconds: float
    not_once: list[str]  #: parents answered other than exactly once, children delivered twice

    @property
    def leases(self) -> float:
        return self.restart_to_last_s / self.lease_seconds


@dataclass
class Cell:
    """Every trial of one (kind, workers, parents)."""

    steps: list[Step] = field(default_factory=list)

    def median(self, fn: Any) -> float:
        return float(statistics.median(fn(s) for s in self.steps))

    def spread(self, fn: Any, fmt: str) -> str:
        values = [fn(s) for s in self.steps]
        return "" if len(values) < 2 else f" ({fmt.format(min(values))}..{fmt.format(max(values))})"

    @property
    def p50(self) -> float:
        return self.median(lambda s: statistics.median(s.latencies))

    @property
    def p99(self) -> float:
        from bench._common import percentile

        return percentile([x for s in self.steps for x in s.latencies], 99)


def run_step(
    *,
    kind: str,
    workers: list[Any],
    parents: int,
    children: int,
    label: str,
    answers: Answers,
    admin: Any,
    database: str,
    ours_url: str,
    naive_url: str,
    server: ServerStatements,
    restart: Any = None,
    lease_seconds: float = 30.0,
) -> Step:
    """One load on one kind's fresh workers, which it stops at the end: a PostgreSQL backend
    publishes its counters when idle at most every 10 s, always when its connection ends.
    ``restart`` (--kill-at-half): called with the SIGKILLed workers once half the parents have
    answered; returns the same workers started again (their figures then count both lives)."""
    from bench._common import progress, wait_for

    ids = create_ours(parents, label) if kind == OURS else create_naive(parents, naive_url, label)
    answers.watch(ids)
    url = ours_url if kind == OURS else naive_url
    checker = Checker(url, ids)
    close_connections()  # this process's backends publish the sessions' writes: not the step's
    time.sleep(STATS_SETTLE_SECONDS)
    tables_before = table_counters(url)
    time.sleep(STATS_SETTLE_SECONDS)  # that reading's backend ended and published
    before = db_counters(admin, database, kind, server)
    cpu_before = cpu_seconds(workers)
    cost: dict[str, int] = {}
    sampler = Sampler(admin, url.rsplit("/", 1)[1], url if kind == OURS else None).start()
    sent = submit(kind, ids)
    first_life: tuple[float, float, float] | None = None  #: killed workers' main MB, pool MB, CPU s
    first_all_mb = 0.0
    answered_before, restarted_at = 0, 0.0
    try:
        if restart is not None:
            half = (parents + 1) // 2
            wait_for(
                lambda: checker.at_least(answers, half),
                timeout=120 + parents * children * 0.2,
                what=f"{half} {kind} parents answered",
                describe=lambda: f"{answers.hints()[0]}/{parents} answer events",
                interval=0.02,
            )
            main_mb, pool_mb = peak_memory(workers)
            first_life = (main_mb, pool_mb, cpu_seconds(workers) - cpu_before)
            first_all_mb = summed_peak_memory(workers)
            for w in workers:
                w.kill()
            answered_before = checker.counts()[0]
            progress(f"{kind}: every worker SIGKILLed with {answered_before}/{parents} parents answered")
            restarted_at = time.time()
            workers = restart(workers)
            cpu_before = cpu_seconds(workers)
            progress(f"{kind}: {len(workers)} worker(s) started again under their names")
        wait_for(
            lambda: checker.done(answers),
            timeout=120 + parents * children * 0.2 + (4 * lease_seconds if restart is not None else 0),
            what=f"{parents} {kind} parents answered",
            describe=lambda: f"{answers.hints()[0]}/{parents} answer events",
            interval=0.02,
        )
        main_mb, pool_mb = peak_memory(workers)
        all_mb = max(summed_peak_memory(workers), first_all_mb)
        cost["cpu_ms"] = round((cpu_seconds(workers) - cpu_before) * 1000)
        if first_life is not None:
            main_mb, pool_mb = max(main_mb, first_life[0]), max(pool_mb, first_life[1])
            cost["cpu_ms"] += round(first_life[2] * 1000)
        time.sleep(STATS_SETTLE_SECONDS)  # the statement counters' last flush
        for w in workers:
            w.stop()
    finally:
        checker.close()
        sampler.stop()
    time.sleep(STATS_SETTLE_SECONDS)  # the workers' and the checker's backends ended and published
    after = db_counters(admin, database, kind, server)
    tables_after = table_counters(url)
    tables = {
        name: tuple(a - b for a, b in zip(counts, tables_before.get(name, (0, 0, 0, 0)), strict=True))
        for name, counts in tables_after.items()
    }
    answered = answer_times(url, ids)
    if len(answered) != parents:
        raise RuntimeError(f"{parents - len(answered)} {kind} parents have no answer")
    latencies = [answered[sid] - sent[sid] for sid in ids]
    wall = max(answered.values()) - min(sent.values())
    cost.update(after.minus(before, wal_between(admin, before.wal_lsn, after.wal_lsn)))
    cost["xacts"] -= checker.checks
    kill = None
    if restart is not None:
        kill = Kill(answered_before, max(answered.values()) - restarted_at, lease_seconds, not_once(url, ids))
    return Step(
        kind,
        len(workers),
        parents,
        parents / wall,
        latencies,
        cost,
        main_mb,
        pool_mb,
        tables,
        in_flight=sampler.peak_in_flight,
        connections=sampler.peak_connections,
        kill=kill,
        all_mb=all_mb,
    )


# --- the scan against history -------------------------------------------------------------------


@dataclass
class ScanPass:
    history: int
    ms: float  #: median pass
    spread: str
    executions: int


def measure_scan(history: list[int], pending: int, repeat: int) -> list[ScanPass]:
    """One database; ``pending`` crashed executions (3 per parent), then history added up to
    each size in ``history`` (ascending), timing ``repeat`` scan passes at each."""
    from bench._common import bench_database, progress
    from bench.scan import insert_history, insert_pending, time_scan, vacuum_analyze

    out = []
    with bench_database("bench_scale_scan"):
        insert_pending(pending, 3)
        vacuum_analyze()
        have = 0
        for size in sorted(history):
            if size > have:
                # NOTE: a second call maps its executions onto the first call's child sessions
                # (bench/scan.py numbers children from the first); the foreign keys hold and the
                # scan reads none of those rows, which is what is measured here.
                insert_history(size - have)
                vacuum_analyze()
                have = size
            timing = time_scan(repeat)
            out.append(ScanPass(size, timing.scan_s * 1000, timing.spread_ms, timing.executions))
            progress(f"scan over {size} historic rows: {timing.scan_s * 1000:.1f} ms per pass ({timing.spread_ms})")
    return out


# --- command line ------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parents", default="10,100,1000", help="loads N, concurrent parents (10,100,1000: ~10 min in all)"
    )
    parser.add_argument(
        "--workers", default=None, help="worker processes of each kind (1,2,4; 1 with --topology procfile)"
    )
    parser.add_argument("--children", type=int, default=3, help="children per parent (3)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="pool size (-c) of each worker (1); --topology procfile: of its threads line (the Procfile's)",
    )
    parser.add_argument("--pool", choices=POOLS, default=None, help="Celery's -P (prefork; not with procfile)")
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="bare",
        help="bare: W workers serving every queue (default); procfile: ours as the Procfile's lines (its "
        "threads worker on celery, prefork worker on recovery, a beat), read from the Procfile",
    )
    parser.add_argument(
        "--model-latency",
        default="0",
        help="every model reply waits SECONDS, or a draw of lognormal:MU,SIGMA (seconds = exp(normal)); 0. "
        "Several fixed delays (0,1,2,5): the whole run at each, then parents/s against latency (--latency-out)",
    )
    parser.add_argument(
        "--latency-out",
        default=str(ROOT / "docs" / "img" / "scale-latency.png"),
        help="the PNG of parents/s against the model's latency, drawn when --model-latency lists several",
    )
    parser.add_argument(
        "--kill-at-half",
        action="store_true",
        help="ours only: SIGKILL every worker when half the parents have answered, start them again under "
        "their names (a beat runs throughout); reports exactly-once and restart -> last answer in leases",
    )
    parser.add_argument("--kinds", default="ours,naive", help="which kinds run: ours, naive or both (ours,naive)")
    parser.add_argument("--trials", type=int, default=1, help="trials per (kind, workers, N); medians printed (1)")
    parser.add_argument("--history", default="0,100000,1000000", help="finished executions under the scan")
    parser.add_argument("--scan-pending", type=int, default=300, help="crashed executions each scan pass takes")
    parser.add_argument("--scan-repeat", type=int, default=5, help="timed scan passes per history size (5)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "scale.png"), help="the PNG plot")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test: " + str(QUICK))
    args = parser.parse_args(argv)
    if args.quick:
        args.parents, args.workers, args.history = QUICK["parents"], QUICK["workers"], QUICK["history"]
        args.scan_pending, args.scan_repeat = QUICK["scan_pending"], 1
    if args.workers is None:
        args.workers = "1" if args.topology == "procfile" else "1,2,4"
    args.parents, args.workers, args.history = _ints(args.parents), _ints(args.workers), _ints(args.history)
    if args.topology == "procfile":
        if args.pool is not None:
            parser.error("--topology procfile runs the Procfile's pools: no --pool")
        if args.workers != [1]:
            parser.error("--topology procfile starts the Procfile's pair once: --workers 1")
        args.pool = "threads"  # the Procfile's celery line (the statement counter's patching follows it)
    else:
        args.pool = args.pool or "prefork"
        args.concurrency = args.concurrency or 1
    if (
        not args.parents
        or not args.workers
        or min(args.parents + args.workers) < 1
        or min(args.history or [0]) < 0
        or min(args.children, args.concurrency or 1, args.trials, args.scan_pending, args.scan_repeat) < 1
    ):
        parser.error("loads, worker counts, --children, --concurrency, --trials and the scan's sizes must be >= 1")
    try:
        args.latencies = parse_latencies(args.model_latency)
    except ValueError as exc:
        parser.error(str(exc))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kinds or set(args.kinds) - {OURS, NAIVE}:
        parser.error("--kinds: ours, naive or ours,naive")
    if args.topology == "procfile" and args.kinds != [OURS]:
        parser.error("--topology procfile needs --kinds ours: the naive baseline has no recovery queue")
    if args.kill_at_half and args.kinds != [OURS]:
        parser.error("--kill-at-half needs --kinds ours: the naive baseline has no recovery (a killed worker loses it)")
    args.parents.sort()
    return args


def parse_latencies(text: str) -> list[tuple[str, float | dict[str, list[float]]]]:
    """``--model-latency``: one :func:`parse_latency`, or several fixed delays (``0,1,2,5``),
    each with the text it was given."""
    if text.startswith("lognormal:"):
        return [(text, parse_latency(text))]
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError("--model-latency takes SECONDS, SECONDS,SECONDS,... or lognormal:MU,SIGMA")
    return [(part, parse_latency(part)) for part in parts]


def parse_latency(text: str) -> float | dict[str, list[float]]:
    """``--model-latency``: a fixed delay in seconds (>= 0), or ``lognormal:MU,SIGMA`` (the
    scripted model's ``{"lognormal": [MU, SIGMA]}``: each reply waits exp(N(MU, SIGMA)) s)."""
    if text.startswith("lognormal:"):
        parts = text.removeprefix("lognormal:").split(",")
        try:
            mu, sigma = (float(p) for p in parts)
        except ValueError:
            raise ValueError("--model-latency lognormal:MU,SIGMA takes two numbers") from None
        if sigma < 0:
            raise ValueError("--model-latency lognormal: SIGMA must be >= 0")
        return {"lognormal": [mu, sigma]}
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError("--model-latency takes SECONDS or lognormal:MU,SIGMA") from None
    if seconds < 0:
        raise ValueError("--model-latency must be >= 0")
    return seconds


def workers_shape(args: argparse.Namespace) -> str:
    """The workers a run starts, as its output names them."""
    if args.topology != "procfile":
        return f"{args.workers} worker processes of each kind (celery worker -P {args.pool} -c {args.concurrency})"
    lines = [
        "celery " + " ".join(w.cmd[1:])
        for w in stack_helpers().procfile_workers({}, Path("."), concurrency=args.concurrency)
    ]
    return "the Procfile's workers (" + "; ".join(lines) + ") and its beat"


def stack_helpers() -> Any:
    """The stack helpers' module (Worker, apply_env): the one line to change if it moves."""
    import devstack.processes as helpers

    return helpers


def start_workers(
    stack: Any,
    *,
    count: int,
    concurrency: int | None,
    env: dict[str, str],
    naive_env: dict[str, str],
    pool: str = "prefork",
    kinds: tuple[str, ...] = (OURS, NAIVE),
    topology: str = "bare",
) -> tuple[list[Any], list[Any]]:
    """``count`` fresh workers of each kind, booted in parallel (each ready line awaited); with
    ``topology="procfile"``, ours are the Procfile's worker lines (``count`` is 1)."""
    from concurrent.futures import ThreadPoolExecutor

    from bench._naive_app import NAIVE_QUEUE
    from bench.delegation import app_worker

    ours_env = {**env, "BENCH_STATEMENTS_KEY": statements_key(OURS), "PGAPPNAME": WORKER_APP_NAME}
    ours: list[Any] = []
    if OURS in kinds and topology == "procfile":
        ours = stack_helpers().procfile_workers(ours_env, stack.log_dir, concurrency=concurrency)
    elif OURS in kinds:
        ours = [
            stack_helpers().Worker(ours_env, stack.log_dir, name=f"scale-{i}", concurrency=concurrency, pool=pool)
            for i in range(count)
        ]
    naive = [
        app_worker(
            "bench._naive_app:naive_app",
            NAIVE_QUEUE,
            f"naive-{i}-{int(time.time() * 1000)}",
            {**naive_env, "BENCH_STATEMENTS_KEY": statements_key(NAIVE), "PGAPPNAME": WORKER_APP_NAME},
            stack.log_dir,
            concurrency or 1,
            pool,
        )
        for i in range(count if NAIVE in kinds else 0)
    ]
    for w in ours + naive:
        stack.add_worker(w)
    with ThreadPoolExecutor(len(ours + naive)) as boot:
        for started in [boot.submit(w.start, 90) for w in ours + naive]:
            started.result()
    return ours, naive


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench._common import (
        REDIS_BASE,
        REDIS_DBS,
        Stack,
        admin_engine,
        bench_database,
        bench_env,
        flush_redis,
    )
    from bench._figures import system_load
    from bench._naive_app import naive_app

    started = time.monotonic()
    by_latency: dict[str, dict[tuple[str, int, int], Cell]] = {}
    events_url = f"{REDIS_BASE}/{REDIS_DBS[2]}"
    kill = ", every worker SIGKILLed at half-way and started again" if args.kill_at_half else ""
    shape = workers_shape(args)
    print(
        f"scale: N concurrent parents {args.parents} x {args.children} children (model latency "
        f"{args.model_latency} s) over {shape}, {' then '.join(args.kinds)} "
        f"for each trial, {args.trials} trial(s){kill}; {system_load()}",
        flush=True,
    )
    with (
        bench_database("bench_scale_ours") as url,
        bench_database("bench_scale_naive") as naive_url,
        bench_database("bench_scale_stats", migrate=False) as stats_url,
    ):
        flush_redis()
        admin = admin_engine()
        server = ServerStatements(stats_url)
        if server.engine is None:
            print(
                f"  ({server.why}: statements are counted in the workers only, WAL bytes cluster-wide; a private "
                f"server with shared_preload_libraries = 'pg_stat_statements' via BENCH_PG_ADMIN_URL gives both "
                f"per database)",
                flush=True,
            )
        counting = {
            "PYTHONPATH": f"{COUNTING}{os.pathsep}{ROOT}",
            "BENCH_STATEMENTS_REDIS": events_url,
            "LEASE_SECONDS": f"{LEASE_SECONDS:g}",  # production's: a deep queue is no reason to take work back
            "SCAN_INTERVAL_SECONDS": "30",
        }
        if args.pool == "gevent":
            counting["BENCH_PSYCOGREEN"] = "1"
        answers = Answers(events_url)
        with Stack("bench-scale") as stack:
            beat = None
            try:
                for i, (text, latency) in enumerate(args.latencies):
                    model = stack.model(_script(args.children, latency))
                    env = bench_env(url, model.base_url, **counting)
                    naive_env = bench_env(naive_url, model.base_url, **counting)
                    if i == 0:  # only the model differs from one latency to the next: this process never calls it
                        stack_helpers().apply_env(env)  # (it resets kombu's pools, the naive app's too)
                        naive_app.conf.update(
                            broker_url=env["CELERY_BROKER_URL"], result_backend=env["CELERY_RESULT_BACKEND"]
                        )
                    if (args.kill_at_half or args.topology == "procfile") and not beat:
                        # the scans of the Procfile's beat, across the kills
                        beat = stack.add_worker(stack_helpers().Beat(env, stack.log_dir)).start()
                    by_latency[text] = _run_loads(
                        args,
                        stack=stack,
                        env=env,
                        naive_env=naive_env,
                        answers=answers,
                        admin=admin,
                        url=url,
                        naive_url=naive_url,
                        server=server,
                        latency=text,
                    )
            except Exception:
                stack.failed = True
                stack.dump_logs()
                raise
            finally:
                answers.close()
            from sqlalchemy import text

            from models import transaction
            from recovery.invariants import check_all

            with transaction() as s:
                # a starved bench may pass the workers' idle-in-transaction bound in one long check (bench/soak.py)
                s.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
                problems = check_all(s, settled=True)
            ours_parents = (
                sum(n * args.trials for n in args.parents) * len(args.workers) * len(args.latencies)
                if OURS in args.kinds
                else 0
            )
            storage = {
                kind: storage_per_parent(kind_url, ours_parents) if kind in args.kinds and ours_parents else "-"
                for kind, kind_url in ((OURS, url), (NAIVE, naive_url))
            }
            _drop_result_subscriptions(naive_app)
            naive_app.close()
        per_database = server.engine is not None
        server.close()
        admin.dispose()
    scans = measure_scan(args.history, args.scan_pending, args.scan_repeat) if args.history else []
    load = system_load()
    for text, cells in by_latency.items():
        print(f"model latency {text} s:")
        print_table(cells, args, per_database=per_database)
    problems += print_kills(by_latency)
    if len(by_latency) > 1:
        print_by_latency(by_latency)
    if scans:
        print(
            f"scan per pass ({scans[0].executions} crashed executions taken each pass, median of "
            f"{args.scan_repeat} passes): "
            + ", ".join(f"{s.history} historic rows {s.ms:.1f} ms ({s.spread})" for s in scans)
        )
    title = (
        f"bench/scale.py: {args.children} children per parent, model latency {args.model_latency} s; "
        f"{shape}; "
        f"{args.trials} trial(s); {load}"
    )
    print(f"on disk per parent (tables and their indexes, kB): ours {storage[OURS]}; naive {storage[NAIVE]}")
    if len(by_latency) > 1:
        fixed = {float(text): cells for text, cells in by_latency.items()}
        print(plot_latency(fixed, Path(args.latency_out), title))
    else:
        print(plot(next(iter(by_latency.values())), Path(args.out), title))
    print(f"run time: {time.monotonic() - started:.0f} s; {load}")
    if problems:
        print(f"invariants I1-I5 and exactly once: VIOLATED ({len(problems)})")
        for problem in problems[:50]:
            print(f"  {problem}")
        return 1
    print(f"invariants I1-I5: ok ({ours_parents} parents of ours)")
    return 0


def _run_loads(
    args: argparse.Namespace,
    *,
    stack: Any,
    env: dict[str, str],
    naive_env: dict[str, str],
    answers: Answers,
    admin: Any,
    url: str,
    naive_url: str,
    server: ServerStatements,
    latency: str,
) -> dict[tuple[str, int, int], Cell]:
    """Every (workers, N, trial) of one model latency, each kind on fresh workers."""
    from bench._common import progress
    from bench._figures import system_load

    cells: dict[tuple[str, int, int], Cell] = {}
    for count in args.workers:
        for n in args.parents:
            for trial in range(1, args.trials + 1):
                ours_w, naive_w = start_workers(
                    stack,
                    count=count,
                    concurrency=args.concurrency,
                    env=env,
                    naive_env=naive_env,
                    pool=args.pool,
                    kinds=tuple(args.kinds),
                    topology=args.topology,
                )
                for kind, workers, database in (
                    (OURS, ours_w, url.rsplit("/", 1)[1]),
                    (NAIVE, naive_w, naive_url.rsplit("/", 1)[1]),
                ):
                    if kind not in args.kinds:
                        continue
                    restart = None
                    if args.kill_at_half:

                        def restart(killed: list[Any]) -> list[Any]:
                            return restart_workers(stack, killed)

                    step = run_step(
                        kind=kind,
                        workers=workers,
                        parents=n,
                        children=args.children,
                        label=f"l{latency} w{count} n{n} t{trial}",
                        answers=answers,
                        admin=admin,
                        database=database,
                        ours_url=url,
                        naive_url=naive_url,
                        server=server,
                        restart=restart,
                        lease_seconds=LEASE_SECONDS,
                    )
                    cells.setdefault((kind, count, n), Cell()).steps.append(step)
                    progress(
                        f"{kind:5} latency {latency} s workers {count} N {n:5} trial {trial}: "
                        f"{step.throughput:7.1f} parents/s, "
                        f"p50 {statistics.median(step.latencies) * 1000:8.1f} ms, "
                        f"{step.per_parent('statements'):5.1f} statements/parent, "
                        f"{step.per_parent('xacts'):4.1f} tx/parent, {step.in_flight} in flight, "
                        f"{step.connections} connections; {system_load()}"
                    )
                stopped = {id(w) for w in ours_w + naive_w}
                stack.workers = [w for w in stack.workers if id(w) not in stopped and not w.exited]
    return cells


def restart_workers(stack: Any, killed: list[Any]) -> list[Any]:
    """The SIGKILLed workers started again as an operator (or a supervisor) does: the same
    command, under the same ``-n`` name, so that each boot takes its predecessor's work back at
    once (docs/operations.md); booted in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    again = [
        stack_helpers().Service(w.cmd, w.env, w.log_path.with_suffix(".restarted.log"), w.ready_line) for w in killed
    ]
    for w in again:
        stack.add_worker(w)
    with ThreadPoolExecutor(len(again)) as pool:
        for started in [pool.submit(w.start, 90) for w in again]:
            started.result()
    return again


def print_kills(by_latency: dict[str, dict[tuple[str, int, int], Cell]]) -> list[str]:
    """``--kill-at-half``: one line per step; returns what was not exactly once."""
    problems: list[str] = []
    for text, cells in by_latency.items():
        for (kind, w, n), cell in sorted(cells.items()):
            for trial, step in enumerate(cell.steps, 1):
                if step.kill is None:
                    continue
                k = step.kill
                once = "every parent answered exactly once" if not k.not_once else f"NOT exactly once: {k.not_once[:5]}"
                print(
                    f"kill at half ({kind}, latency {text} s, w{w} N{n} trial {trial}): {k.answered_before}/{n} "
                    f"answered at the kill; restart -> last answer {k.restart_to_last_s:.1f} s = {k.leases:.2f} "
                    f"leases (LEASE_SECONDS {k.lease_seconds:g}); {once}"
                )
                problems += k.not_once
    return problems


def print_by_latency(by_latency: dict[str, dict[tuple[str, int, int], Cell]]) -> None:
    """Parents/s at each model latency, and ours/naive where both ran: the latency curve."""
    print("by model latency (parents/s, medians; ours/naive where both ran):")
    for w, n in sorted({(w, n) for cells in by_latency.values() for _, w, n in cells}):
        row = []
        for text, cells in by_latency.items():
            ours, naive = cells.get((OURS, w, n)), cells.get((NAIVE, w, n))
            figures = [
                f"{kind} {cell.median(lambda s: s.throughput):.1f}"
                for kind, cell in ((OURS, ours), (NAIVE, naive))
                if cell is not None
            ]
            if ours is not None and naive is not None:
                ratio = ours.median(lambda s: s.throughput) / naive.median(lambda s: s.throughput)
                figures.append(f"ratio {ratio:.2f}")
            row.append(f"{text} s: " + ", ".join(figures))
        print(f"  w{w} N{n}: " + "; ".join(row))


def _script(children: int, latency: float | dict[str, list[float]] = 0.0) -> list[dict[str, Any]]:
    """bench/delegation.py's instant script, every reply delayed by ``latency`` (--model-latency)."""
    from bench.delegation import instant_script

    rules = instant_script(children)
    if latency:
        rules = [{**rule, "delay_seconds": latency} for rule in rules]
    return rules


def _drop_result_subscriptions(app: Any) -> None:
    from bench.delegation import _drop_result_subscriptions as drop

    drop(app)


def print_table(cells: dict[tuple[str, int, int], Cell], args: argparse.Namespace, *, per_database: bool) -> None:
    spread = "" if args.trials < 2 else f"; medians of {args.trials} trials, (min..max) of parents/s at the end"
    print(
        f"per (kind, workers, N){spread}; p99 over every parent; per parent = one delegating round of "
        f"{args.children} children and the answer after it"
    )
    header = (
        f"{'kind':5} {'w':>2} {'N':>5} | {'parents/s':>9} {'p50 ms':>8} {'p99 ms':>8} | {'cpu ms':>6} {'stmts':>6} "
        f"{'srv':>6} {'tx':>5} {'rows':>5} {'WAL kB':>7} | {'main MB':>7} {'pool MB':>7} {'all MB':>7} | "
        f"{'flying':>6} {'conns':>5}"
    )
    print(header)
    print("-" * len(header))
    wal = "db_wal" if per_database else "wal"

    def per(cell: Cell, name: str) -> float:
        return cell.median(lambda s: s.per_parent(name))

    for (kind, w, n), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != OURS)):
        server = f"{per(cell, 'server_statements'):6.1f}" if per_database else f"{'-':>6}"
        print(
            f"{kind:5} {w:>2} {n:>5} | {cell.median(lambda s: s.throughput):9.1f} {cell.p50 * 1000:8.1f} "
            f"{cell.p99 * 1000:8.1f} | {per(cell, 'cpu_ms'):6.1f} {per(cell, 'statements'):6.1f} {server} "
            f"{per(cell, 'xacts'):5.1f} "
            f"{per(cell, 'rows'):5.1f} {per(cell, wal) / 1024:7.1f} | {cell.median(lambda s: s.main_mb):7.1f} "
            f"{cell.median(lambda s: s.pool_mb):7.1f} {cell.median(lambda s: s.all_mb):7.1f} | "
            f"{cell.median(lambda s: s.in_flight):6.0f} "
            f"{cell.median(lambda s: s.connections):5.0f}" + cell.spread(lambda s: s.throughput, "{:.1f}")
        )
    parts = []
    for (kind, w, n), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        other = cells.get((NAIVE, w, n))
        if kind != OURS or other is None:
            continue
        parts.append(
            f"w{w} N{n}: throughput {cell.median(lambda s: s.throughput) / other.median(lambda s: s.throughput):.2f}, "
            f"p50 {cell.p50 / other.p50:.2f}, "
            f"statements {per(cell, 'statements') / max(per(other, 'statements'), 1e-9):.2f}"
        )
    print("ratios ours/naive (medians): " + "; ".join(parts))
    for kind in (OURS, NAIVE):
        if not any(k[0] == kind for k in cells):
            continue
        key = max((k for k in cells if k[0] == kind), key=lambda k: (k[2], k[1]))
        step = cells[key].steps[-1]
        tables = [
            f"{name} +{ins / step.parents:.1f}/~{upd / step.parents:.1f} (HOT {hot / step.parents:.1f})"
            + (f"/-{dele / step.parents:.1f}" if dele else "")
            for name, (ins, upd, hot, dele) in sorted(step.tables.items())
            if ins or upd or dele
        ]
        print(
            f"rows per parent by table, {kind} (w{key[1]} N{key[2]}; +inserted/~updated/-deleted): " + ", ".join(tables)
        )
    where = (
        "WAL kB = WAL of the kind's database (pg_stat_statements)"
        if per_database
        else "WAL kB = WAL written cluster-wide (other writers count too)"
    )
    print(
        "columns: cpu ms = CPU time of the kind's worker processes (main and pool), stmts = SQL statements the "
        "workers sent (SQLAlchemy), srv = statements the server ran "
        "(pg_stat_statements, BEGIN/COMMIT left out; - without it), tx = transactions committed (each worker's boot "
        f"scan included: a few per worker), rows = rows inserted + updated + deleted, {where}, all per parent; "
        "main/pool MB = the largest VmHWM of a worker's main / pool process in the step (no pool process on "
        "threads), all MB = the sum of every worker process's VmHWM; flying = peak of loops holding a live "
        "lease (ours; sampled every 0.2 s); conns = peak of "
        "PostgreSQL connections the kind's workers held open"
    )


if __name__ == "__main__":
    raise SystemExit(main())
