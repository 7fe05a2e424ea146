"""Ours beside DBOS Transact: ``python bench/peer_dbos.py [--parents P] [--children K] [--modes ...]``.

Three figures (``--modes crash,restart,normal``, all by default), each on our stack and on DBOS
Transact (the optional ``bench`` extra: ``pip install -e ".[bench]"``) against the same
PostgreSQL server, each run in its own throwaway database, with the same scripted model.

crash — the crash-and-recover fan-out/fan-in workload of ``bench/recovery.py``:

- ours: ``bench.recovery.run_recovery`` (SIGKILLed prefork worker, broker flushed, a fresh
  worker's scan until every parent resumed);
- DBOS (``bench/_dbos_app.py``): a process starts P parent workflows; each asks the model,
  enqueues K child workflows (queue concurrency per process = our pool size), waits for them
  and writes the round in one datasource transaction. While the children hang in their model
  call, the process is SIGKILLed; a new process launches DBOS, whose startup recovery resumes
  every pending workflow; timed from just before ``DBOS.launch()`` until every parent
  workflow is SUCCESS.

Prints both throughputs (child results delivered to their parents per second, until every
parent finished) and the ratio ours/DBOS.

restart — restart to recovered, the figure users feel. The same crash, but ours runs as it
would in production: the crashed worker has a stable name (``-n w1@%h``, ``WORKER_ID`` the
same) and an embedded beat, default ``LEASE_SECONDS`` and ``SCAN_INTERVAL_SECONDS`` (30 s
each, ``--lease-seconds`` / ``--scan-interval-seconds``), and nobody expires a lease by hand.
Only the worker dies: the broker keeps the children still queued (``--restart-broker flush``
loses them too, as the crash figure does). Timed from the moment the crashed worker is
started again (its process spawned) until every parent resumed; DBOS from the moment its new
process is spawned until every parent workflow is done (the same DBOS run as the crash
figure).

normal — no crash: P parents x K children with a model that answers at once (or after
``--model-latency`` seconds a reply, both sides), parents per second from the first enqueue
until every parent answered. Ours: one worker, ``--pool`` (prefork; threads is the Procfile's
for the agent loops) of ``--concurrency``; the bench creates each session and sends
``agent.run``. DBOS: as many processes as our pool (``--dbos-processes``), each running at most
``--concurrency`` / processes child workflows at once, its workflows and steps on DBOS's
default executor (its thread pool); the bench enqueues each parent workflow with ``DBOSClient``
on a queue the processes share. For a model with latency, compare the Procfile's workers with
one DBOS process: ``--modes normal --model-latency 2 --topology procfile --concurrency 256
--dbos-processes 1`` (``--topology procfile``: ours as the Procfile's lines, read from it, its
threads line at ``-c --concurrency``, with its prefork ``recovery`` worker and its beat). Each
side's line also says where the window's CPU went a parent: its worker processes, the bench's
PostgreSQL and Redis (when they are local processes with their port on their command line), and
this process (the scripted model, the submissions, the polling). ``--dbos-pool-size`` sizes
DBOS's two connection pools (its defaults, 20 and 5 + 10, ran out at 2,000 parent workflows in
one process with the 0.05 s polling).

Every figure is the median of ``--trials`` alternating runs; the ratios are ours/DBOS (higher
is better for us on throughput, lower on seconds). DBOS's queue and result polling intervals
are set to ``--dbos-poll-seconds`` (DBOS's default is 1 s). Exits 0 with a message when DBOS is
not installed; 1 when either side loses or duplicates a delivery.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

#: ``bench._dbos_app.PARENTS_QUEUE`` (that module runs only in its own processes).
PARENTS_QUEUE = "parents"
INSTALL_HINT = 'DBOS Transact is not installed: install with pip install -e ".[bench]"'


@dataclass
class DbosFigures:
    parents: int
    children: int
    first_delivery_s: float
    all_resumed_s: float  #: from just before DBOS.launch()
    problems: list[str]
    #: from the moment the recovering process was spawned
    from_spawn_s: float = 0.0

    @property
    def deliveries_per_second(self) -> float:
        return self.parents * self.children / self.all_resumed_s


@dataclass
class NormalFigures:
    parents: int
    seconds: float  #: the first enqueue -> every parent answered
    problems: list[str]
    cpu_s: float = 0.0  #: CPU time of the side's worker processes in that window (/proc)
    all_mb: float = 0.0  #: the sum of the side's worker processes' peak resident memory (VmHWM)
    #: CPU time in that window of the bench's PostgreSQL and Redis (None: not local processes)
    server_cpu_s: float | None = None
    #: CPU time in that window of this process: the scripted model's server, the submissions, the polling
    bench_cpu_s: float = 0.0

    @property
    def parents_per_second(self) -> float:
        return self.parents / self.seconds

    @property
    def cpu_ms_per_parent(self) -> float:
        return self.cpu_s * 1000 / self.parents

    def cpu_note(self) -> str:
        """Where the window's CPU went, in ms a parent."""
        servers = "-" if self.server_cpu_s is None else f"{self.server_cpu_s * 1000 / self.parents:.0f}"
        return (
            f"CPU ms a parent: workers {self.cpu_ms_per_parent:.0f}, PostgreSQL+Redis {servers}, bench "
            f"(model stand-in, submission, polling) {self.bench_cpu_s * 1000 / self.parents:.0f}"
        )


class _WindowCpu:
    """The servers' and this process's CPU from its start to :meth:`stop` (NormalFigures)."""

    def __init__(self) -> None:
        import time

        self._servers, self._bench = self._read(), time.process_time()

    @staticmethod
    def _read() -> float | None:
        from bench._common import PG_ADMIN_URL, REDIS_BASE
        from bench._scale_probes import server_cpu_seconds

        return server_cpu_seconds(PG_ADMIN_URL, REDIS_BASE)

    def stop(self) -> tuple[float | None, float]:
        import time

        servers = self._read()
        spent = None if servers is None or self._servers is None else servers - self._servers
        return spent, time.process_time() - self._bench


@dataclass
class RestartFigures:
    seconds: float  #: the restarted worker spawned -> every parent resumed
    ready_s: float  #: the restarted worker spawned -> its worker_ready line
    problems: list[str]
    #: ``--cpu``: the window's CPU by process class (bench._cpu), and the worker's main
    #: process's CPU when it was ready (its boot)
    cpu: Any = None
    boot_cpu_s: float = 0.0


def _status() -> dict[str, int]:
    from sqlalchemy import text

    from models import get_engine

    with get_engine().connect() as conn:
        row = conn.execute(
            text(
                "SELECT"
                " count(*) FILTER (WHERE name = 'parent_workflow') AS parents,"
                " count(*) FILTER (WHERE name = 'parent_workflow' AND status = 'SUCCESS') AS parents_done,"
                " count(*) FILTER (WHERE name = 'parent_workflow' AND status IN ('ERROR', 'CANCELLED',"
                "   'MAX_RECOVERY_ATTEMPTS_EXCEEDED')) AS parents_failed,"
                " count(*) FILTER (WHERE name = 'child_workflow') AS children,"
                " count(*) FILTER (WHERE name = 'child_workflow' AND status = 'PENDING') AS children_running"
                " FROM dbos.workflow_status"
            )
        ).one()
    return dict(row._mapping)


def _dbos_process(env: dict[str, str], log_dir: Path, *args: str, name: str = "") -> Any:
    from devstack.processes import Service

    cmd = [sys.executable, "-m", "bench._dbos_app", *args]
    return Service(cmd, env, log_dir / f"dbos-{name or args[0]}.log", "event=launched")


def _dbos_env(url: str, model_url: str, concurrency: int, poll_seconds: float, **extra: str) -> dict[str, str]:
    import os

    from bench._common import ROOT

    out = {k: v for k, v in os.environ.items() if not k.startswith("DBOS__")}
    out.update(
        BENCH_DBOS_DATABASE_URL=_dbos_url(url),
        BENCH_MODEL_URL=model_url,
        BENCH_DBOS_CONCURRENCY=str(concurrency),
        BENCH_DBOS_POLL_SECONDS=str(poll_seconds),
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return out


def _dbos_url(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _checks(parents: int, children: int) -> list[str]:
    """Exactly once on the DBOS side: every parent SUCCESS, one child workflow per delegate
    call, exactly one round (1 assistant + K TOOL rows) and one answer per parent."""
    from sqlalchemy import text

    from models import get_engine

    problems = []
    with get_engine().connect() as conn:
        st = _status()
        if st["parents_done"] != parents:
            problems.append(f"DBOS: {st['parents_done']}/{parents} parent workflows SUCCESS")
        if st["children"] != parents * children:
            problems.append(f"DBOS: {st['children']} child workflows, expected {parents * children}")
        rows = conn.execute(
            text(
                "SELECT job, count(*) FILTER (WHERE role = 'TOOL') AS tools,"
                " count(*) FILTER (WHERE role = 'ASSISTANT' AND tool_calls IS NOT NULL) AS rounds,"
                " count(*) FILTER (WHERE role = 'ASSISTANT' AND tool_calls IS NULL) AS answers"
                " FROM peer_message GROUP BY job"
            )
        ).all()
    if len(rows) != parents:
        problems.append(f"DBOS: {len(rows)} parents wrote messages, expected {parents}")
    for r in rows:
        if (r.tools, r.rounds, r.answers) != (children, 1, 1):
            problems.append(f"DBOS {r.job}: {r.tools} TOOL rows, {r.rounds} rounds, {r.answers} answers")
    return problems


def run_dbos(url: str, *, parents: int, children: int, concurrency: int, poll_seconds: float) -> DbosFigures:
    """Crash and recover the same workload on DBOS Transact in the (empty) database ``url``."""
    import time

    from sqlalchemy import text

    from bench._common import Stack, point_settings_at, progress, wait_for
    from bench._cpu import settle
    from bench.recovery import RECOVERY_SCRIPT, crash_script
    from models import get_engine

    point_settings_at(url)  # our engine only reads DBOS's tables here
    expected = parents * children
    with Stack("bench-peer-dbos") as stack:

        def env(model_url: str) -> dict[str, str]:
            return _dbos_env(url, model_url, concurrency, poll_seconds)

        hanging = stack.model(crash_script(children))
        doomed = stack.add_worker(_dbos_process(env(hanging.base_url), stack.log_dir, "start", str(parents)))
        doomed.start()
        progress(f"DBOS: {parents} parent workflows started (each enqueues {children} child workflows)")

        def crashed_state() -> bool:
            st = _status()
            return (
                st["parents"] == parents
                and st["children"] == expected
                and st["children_running"] >= min(expected, concurrency)
            )

        def crash_status() -> str:
            st = _status()
            return f"{st['children']}/{expected} child workflows, {st['children_running']} running"

        wait_for(crashed_state, timeout=60 + parents, what="every DBOS child enqueued", describe=crash_status)
        running = _status()["children_running"]
        doomed.kill()
        hanging.stop()
        progress(f"DBOS process SIGKILLed with {expected} child workflows ({running} running)")

        instant = stack.model(RECOVERY_SCRIPT)
        progress(settle().note())
        fresh = stack.add_worker(_dbos_process(env(instant.base_url), stack.log_dir, "recover"))
        spawned = time.time()
        fresh.start()
        match = re.search(r"^t0=([0-9.]+)$", fresh.log(), re.MULTILINE)
        if match is None:
            raise RuntimeError("the DBOS process did not print t0")
        t0 = float(match.group(1))

        def recovered() -> bool:
            st = _status()
            if st["parents_failed"]:
                raise RuntimeError(f"{st['parents_failed']} DBOS parent workflows failed (see {fresh.log_path})")
            return st["parents_done"] == parents

        def recovery_status() -> str:
            st = _status()
            return f"{st['parents_done']}/{parents} parent workflows done"

        try:
            wait_for(recovered, timeout=120 + 2 * expected, what="every DBOS parent done", describe=recovery_status)
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        with get_engine().connect() as conn:
            done_ms = conn.execute(
                text("SELECT max(updated_at) FROM dbos.workflow_status WHERE name = 'parent_workflow'")
            ).scalar_one()
            first = conn.execute(
                text("SELECT extract(epoch FROM min(created_at)) FROM peer_message WHERE role = 'TOOL'")
            ).scalar_one()
        problems = _checks(parents, children)
    return DbosFigures(
        parents, children, float(first) - t0, done_ms / 1000.0 - t0, problems, from_spawn_s=done_ms / 1000.0 - spawned
    )


def run_dbos_normal(
    url: str,
    *,
    parents: int,
    children: int,
    processes: int,
    concurrency: int,
    poll_seconds: float,
    model_latency: float = 0.0,
    pool_size: int = 0,
) -> NormalFigures:
    """No crash: ``processes`` DBOS processes share the queues (``pool_size``: their connection
    pools, 0 for DBOS's defaults); the bench enqueues P parent
    workflows with DBOSClient; timed from the first enqueue to the last parent SUCCESS."""
    import time

    from dbos import DBOSClient
    from sqlalchemy import text

    from bench._common import Stack, point_settings_at, progress, wait_for
    from bench._cpu import settle
    from bench._scale_probes import cpu_seconds, summed_peak_memory
    from bench.delegation import instant_script
    from models import get_engine

    point_settings_at(url)
    with Stack("bench-peer-dbos-normal") as stack:
        model = stack.model(delayed(instant_script(children), model_latency))
        per_process = max(1, concurrency // processes)
        served = []
        for n in range(processes):  # one after the other: the first creates DBOS's tables
            env = _dbos_env(url, model.base_url, per_process, poll_seconds, BENCH_DBOS_EXECUTOR_ID=f"bench-{n}")
            if pool_size:
                env["BENCH_DBOS_POOL_SIZE"] = str(pool_size)
            served.append(
                stack.add_worker(_dbos_process(env, stack.log_dir, "serve", name=f"serve-{n}")).start(timeout=60)
            )
        client = DBOSClient(system_database_url=_dbos_url(url))
        try:
            progress(settle().note())
            cpu_before, window = cpu_seconds(served), _WindowCpu()
            t0 = time.time()
            for n in range(parents):
                client.enqueue({"queue_name": PARENTS_QUEUE, "workflow_name": "parent_workflow"}, f"job {n}")

            def done() -> bool:
                st = _status()
                if st["parents_failed"]:
                    raise RuntimeError(f"{st['parents_failed']} DBOS parent workflows failed")
                return st["parents_done"] == parents

            try:
                wait_for(done, timeout=60 + 2 * parents * children, what="every DBOS parent done", interval=0.01)
            except Exception:
                stack.failed = True
                stack.dump_logs()
                raise
            cpu_s, all_mb = cpu_seconds(served) - cpu_before, summed_peak_memory(served)
            server_cpu_s, bench_cpu_s = window.stop()
        finally:
            client.destroy()
        with get_engine().connect() as conn:
            done_ms = conn.execute(
                text("SELECT max(updated_at) FROM dbos.workflow_status WHERE name = 'parent_workflow'")
            ).scalar_one()
        problems = _checks(parents, children)
    return NormalFigures(parents, done_ms / 1000.0 - t0, problems, cpu_s, all_mb, server_cpu_s, bench_cpu_s)


def run_ours_normal(
    url: str,
    *,
    parents: int,
    children: int,
    concurrency: int,
    pool: str = "prefork",
    model_latency: float = 0.0,
    topology: str = "bare",
) -> NormalFigures:
    """No crash: one worker (``-P pool -c concurrency``), or with ``topology="procfile"`` the
    Procfile's workers (its threads line at ``-c concurrency``, its prefork ``recovery`` line) and
    its beat; the bench creates P sessions and sends ``agent.run`` for each; timed from the first
    session created to the last parent's answer committed."""
    from sqlalchemy import text

    import tasks
    from bench._common import Stack, bench_env, flush_redis, progress, wait_for
    from bench._cpu import settle
    from bench._scale_probes import cpu_seconds, summed_peak_memory
    from bench.delegation import instant_script
    from bench.recovery import _counts, _db_times
    from devstack.processes import Beat, apply_env, procfile_workers
    from harness.views import create_session
    from models import transaction
    from models.base import utcnow
    from recovery.invariants import check_all

    flush_redis()
    with Stack("bench-peer-ours-normal") as stack:
        model = stack.model(delayed(instant_script(children), model_latency))
        env = bench_env(url, model.base_url)
        apply_env(env)
        if topology == "procfile":
            stack.add_worker(Beat(env, stack.log_dir)).start()
            workers = [
                stack.add_worker(w).start(timeout=60)
                for w in procfile_workers(env, stack.log_dir, concurrency=concurrency)
            ]
        else:
            workers = [stack.worker(env, "normal", concurrency=concurrency, pool=pool)]
        progress(settle().note())
        cpu_before, window = cpu_seconds(workers), _WindowCpu()
        t0 = utcnow()
        for n in range(parents):
            sid = create_session("main", f"job {n}: split the work")
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()

        def done() -> bool:
            c = _counts()
            if c["failed"]:
                raise RuntimeError(f"{c['failed']} parents FAILED (see the worker log)")
            return c["resumed"] == parents and c["delivered"] == parents * children

        try:
            wait_for(done, timeout=60 + 2 * parents * children, what="every parent answered", interval=0.01)
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        cpu_s, all_mb = cpu_seconds(workers) - cpu_before, summed_peak_memory(workers)
        server_cpu_s, bench_cpu_s = window.stop()
        _, _, answered = _db_times()
        with transaction() as s:
            # a starved bench may pass the workers' idle-in-transaction bound in one long check (bench/soak.py)
            s.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            problems = check_all(s, settled=True)
    return NormalFigures(parents, (answered - t0).total_seconds(), problems, cpu_s, all_mb, server_cpu_s, bench_cpu_s)


def run_ours_restart(
    url: str,
    *,
    parents: int,
    children: int,
    concurrency: int,
    lease_seconds: float,
    scan_interval_seconds: float,
    flush_broker: bool = False,
    cpu: bool = False,
) -> RestartFigures:
    """The crash of ``bench/recovery.py``, then the SAME worker name started again with
    production settings (no lease expired by hand, no scan sent by the bench): timed from the
    restarted worker's spawn until every parent resumed. The broker keeps its messages (only
    the worker died: the children still queued run when it is back, the ones it was running
    are lost with it) unless ``flush_broker`` (Redis lost too: everything from the database)."""
    import socket
    import time
    from datetime import UTC, datetime

    from sqlalchemy import text

    import tasks
    from bench._common import Stack, bench_env, flush_redis, progress, wait_for
    from bench._cpu import settle
    from bench.recovery import RECOVERY_SCRIPT, _counts, _db_times, crash_script
    from devstack.processes import Worker, apply_env
    from harness.views import create_session
    from models import transaction
    from recovery.invariants import check_all

    name = "w1"
    settings = {
        "LEASE_SECONDS": f"{lease_seconds:g}",
        "SCAN_INTERVAL_SECONDS": f"{scan_interval_seconds:g}",
        "WORKER_ID": f"{name}@{socket.gethostname()}",
    }
    expected = parents * children
    flush_redis()
    with Stack("bench-peer-ours-restart") as stack:
        hanging = stack.model(crash_script(children))
        env = bench_env(url, hanging.base_url, **settings)
        apply_env(env)
        for n in range(parents):
            sid = create_session("main", f"job {n}: split the work")
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        doomed = stack.add_worker(
            Worker(env, stack.log_dir, name=name, concurrency=concurrency, beat=True, pool="prefork")
        )
        doomed.start(timeout=60)

        def crashed_state() -> bool:
            c = _counts()
            return (
                c["open_rounds"] == parents and c["executions"] == expected and c["taken"] >= min(expected, concurrency)
            )

        wait_for(crashed_state, timeout=60 + parents, what="every round committed")
        doomed.kill()
        hanging.stop()
        if flush_broker:
            flush_redis()
        broker = "broker flushed" if flush_broker else "broker kept"
        progress(f"worker {name} SIGKILLed with {parents} open rounds; {broker}; starting {name} again")
        instant = stack.model(RECOVERY_SCRIPT)
        env = bench_env(url, instant.base_url, **settings)
        apply_env(env)
        again = stack.add_worker(
            Worker(env, stack.log_dir, name=name, concurrency=concurrency, beat=True, pool="prefork")
        )
        # The killed worker's leases must still be live when its name boots again (its boot
        # generation takes them back, not their expiry): a third of a lease at most.
        progress(settle(cap=lease_seconds / 3).note())
        meter = None
        if cpu:
            from bench._cpu import start_meter

            meter = start_meter([], url)  # the worker joins once spawned: its CPU counts from zero
        spawned = datetime.now(UTC)
        started = time.monotonic()
        again.start(timeout=60)
        ready_s = time.monotonic() - started
        boot_cpu_s = 0.0
        if meter is not None and again.proc is not None:
            from bench._cpu import process_cpu

            meter.add_worker(again.proc.pid)
            boot_cpu_s = process_cpu(again.proc.pid)

        def recovered() -> bool:
            c = _counts()
            if c["failed"]:
                raise RuntimeError(f"{c['failed']} parents FAILED during recovery (see the worker log)")
            return c["delivered"] == expected and c["resumed"] == parents

        def status() -> str:
            c = _counts()
            return f"{c['delivered']}/{expected} delivered, {c['resumed']}/{parents} parents resumed"

        try:
            wait_for(
                recovered,
                timeout=lease_seconds + 3 * scan_interval_seconds + 60 + 2 * expected,
                what="every parent resumed after the restart",
                describe=status,
                every=10,
            )
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        split = meter.stop() if meter is not None else None
        _, _, resumed = _db_times()
        with transaction() as s:
            # a starved bench may pass the workers' idle-in-transaction bound in one long check (bench/soak.py)
            s.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            problems = check_all(s, settled=True)
    return RestartFigures((resumed - spawned).total_seconds(), ready_s, problems, split, boot_cpu_s)


MODES = ("crash", "restart", "normal")


def delayed(script: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    """``script`` with every reply ``seconds`` late (the scripted model's ``delay_seconds``), as a
    real provider's latency (``--model-latency``)."""
    return [{**rule, "delay_seconds": seconds} for rule in script] if seconds else script


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench._cpu import add_cpu_option
    from bench._figures import loads

    parser = argparse.ArgumentParser(prog="bench/peer_dbos.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parents",
        type=loads,
        default=[20],
        help="parents per run (default 20); several, comma-separated (20,50,100): the whole bench at each "
        "count, then its ratios by load",
    )
    parser.add_argument("--children", type=int, default=3, help="children delegated by each parent (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="our pool size = DBOS queue concurrency (2)")
    parser.add_argument("--trials", type=int, default=3, help="alternating trials of each, medians (default 3)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default: all)"
    )
    parser.add_argument(
        "--dbos-poll-seconds", type=float, default=0.05, help="DBOS queue and result polling interval (0.05)"
    )
    parser.add_argument(
        "--dbos-processes", type=int, default=0, help="DBOS processes on the normal path (default: --concurrency)"
    )
    parser.add_argument(
        "--dbos-pool-size",
        type=int,
        default=0,
        help="normal: connections of each DBOS process's system-database pool and datasource pool (default "
        "0: DBOS's own, 20 and 5 + 10, which 2,000 parent workflows at once exhaust)",
    )
    parser.add_argument(
        "--lease-seconds", type=float, default=30.0, help="restart: LEASE_SECONDS of our workers (default 30)"
    )
    parser.add_argument(
        "--scan-interval-seconds",
        type=float,
        default=30.0,
        help="restart: SCAN_INTERVAL_SECONDS of our beat (default 30)",
    )
    parser.add_argument(
        "--restart-broker",
        choices=("keep", "flush"),
        default="keep",
        help="restart: the broker keeps its messages (only the worker died; default) or is flushed",
    )
    parser.add_argument(
        "--model-latency",
        type=float,
        default=0.0,
        help="normal: every model reply waits SECONDS, on both sides (default 0: an instant model)",
    )
    parser.add_argument(
        "--pool",
        choices=("prefork", "threads"),
        default=None,
        help="normal: Celery's -P of our worker (prefork; threads is the Procfile's for the agent loops)",
    )
    parser.add_argument(
        "--topology",
        choices=("bare", "procfile"),
        default="bare",
        help="normal: ours on one worker -P --pool -c --concurrency (bare, default), or on the Procfile's "
        "workers read from the Procfile (its threads line at -c --concurrency, its recovery line, a beat)",
    )
    add_cpu_option(parser, "also print where our side's CPU went in the crash and restart windows (Linux /proc)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.topology == "procfile" and args.pool is not None:
        parser.error("--topology procfile runs the Procfile's pools: no --pool")
    args.pool = "threads" if args.topology == "procfile" else args.pool or "prefork"
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    args.dbos_processes = args.dbos_processes or args.concurrency
    if min(args.children, args.concurrency, args.trials, args.dbos_processes) < 1:
        parser.error("--children, --concurrency, --trials and --dbos-processes must be >= 1")
    if args.model_latency < 0:
        parser.error("--model-latency must be >= 0")
    if args.dbos_poll_seconds <= 0 or args.lease_seconds < 3 or args.scan_interval_seconds <= 0:
        parser.error("--dbos-poll-seconds and --scan-interval-seconds must be > 0, --lease-seconds >= 3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import dbos  # noqa: F401 - only whether it imports
    except ImportError:
        print(f"peer_dbos: {INSTALL_HINT}; nothing measured.")
        return 0
    from bench._figures import run_by_load

    return run_by_load(args, _measure, "ours / DBOS")


def _measure(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
    """Every mode of ``args`` at ``args.parents`` parents, alternating trials; prints the
    figures; returns (exit status, the ratios by name)."""
    from importlib.metadata import version

    from bench._common import bench_database
    from bench._figures import median, system_load
    from bench.recovery import run_recovery

    print(
        f"peer_dbos: {args.parents} parents x {args.children} children, modes {','.join(args.modes)}; "
        f"pool/queue concurrency {args.concurrency}; normal path: -P {args.pool}, model latency "
        f"{args.model_latency:g} s; {args.trials} trial(s) of ours then DBOS Transact "
        f"{version('dbos')}, alternating; {system_load()}",
        flush=True,
    )
    crash = "crash" in args.modes or "restart" in args.modes  # DBOS: one run gives both figures
    ours_rates: list[float] = []
    dbos_rates: list[float] = []
    ours_restart: list[RestartFigures] = []
    dbos_restart: list[float] = []
    ours_normal: list[float] = []
    dbos_normal: list[float] = []
    ours_cpu: list[float] = []  #: ms of the workers' CPU a parent, per trial
    dbos_cpu: list[float] = []
    problems: list[str] = []
    for trial in range(1, args.trials + 1):
        if "crash" in args.modes:
            with bench_database("bench_peer_ours") as url:
                ours = run_recovery(
                    url,
                    parents=args.parents,
                    children=args.children,
                    workers=1,
                    concurrency=args.concurrency,
                    cpu=args.cpu,
                )
            ours_rates.append(ours.deliveries_per_second)
            problems += [f"trial {trial} ours crash: {p}" for p in ours.invariants]
        if crash:
            with bench_database("bench_peer_dbos", migrate=False) as url:
                theirs = run_dbos(
                    url,
                    parents=args.parents,
                    children=args.children,
                    concurrency=args.concurrency,
                    poll_seconds=args.dbos_poll_seconds,
                )
            dbos_rates.append(theirs.deliveries_per_second)
            dbos_restart.append(theirs.from_spawn_s)
            problems += [f"trial {trial} crash {p}" for p in theirs.problems]
        if "crash" in args.modes:
            print(
                f"  trial {trial} crash: ours {ours.deliveries_per_second:.1f} deliveries/s (every parent resumed "
                f"{ours.all_resumed_s:.3f} s after the scan); DBOS {theirs.deliveries_per_second:.1f} deliveries/s "
                f"(every parent workflow done {theirs.all_resumed_s:.3f} s after DBOS.launch()); {system_load()}",
                flush=True,
            )
            if ours.cpu is not None:
                print(ours.cpu.report(per=ours.executions, unit="delivery"))
        if "restart" in args.modes:
            with bench_database("bench_peer_restart") as url:
                restarted = run_ours_restart(
                    url,
                    parents=args.parents,
                    children=args.children,
                    concurrency=args.concurrency,
                    lease_seconds=args.lease_seconds,
                    scan_interval_seconds=args.scan_interval_seconds,
                    flush_broker=args.restart_broker == "flush",
                    cpu=args.cpu,
                )
            ours_restart.append(restarted)
            problems += [f"trial {trial} ours restart: {p}" for p in restarted.problems]
            print(
                f"  trial {trial} restart: ours {restarted.seconds:.2f} s from the restart to every parent resumed "
                f"(worker ready after {restarted.ready_s:.2f} s); DBOS {theirs.from_spawn_s:.2f} s from its process "
                f"start to every workflow done; {system_load()}",
                flush=True,
            )
            if restarted.cpu is not None:
                print(
                    f"    the restarted worker's main process spent {restarted.boot_cpu_s:.2f} s of CPU before it "
                    "was ready (its boot)"
                )
                expected = args.parents * args.children
                print(restarted.cpu.report(per=expected, unit="child"))
        if "normal" in args.modes:
            with bench_database("bench_peer_normal") as url:
                normal = run_ours_normal(
                    url,
                    parents=args.parents,
                    children=args.children,
                    concurrency=args.concurrency,
                    pool=args.pool,
                    model_latency=args.model_latency,
                    topology=args.topology,
                )
            with bench_database("bench_peer_dbos_normal", migrate=False) as url:
                theirs_normal = run_dbos_normal(
                    url,
                    parents=args.parents,
                    children=args.children,
                    processes=args.dbos_processes,
                    concurrency=args.concurrency,
                    poll_seconds=args.dbos_poll_seconds,
                    model_latency=args.model_latency,
                    pool_size=args.dbos_pool_size,
                )
            ours_normal.append(normal.parents_per_second)
            dbos_normal.append(theirs_normal.parents_per_second)
            ours_cpu.append(normal.cpu_ms_per_parent)
            dbos_cpu.append(theirs_normal.cpu_ms_per_parent)
            problems += [f"trial {trial} ours normal: {p}" for p in normal.problems]
            problems += [f"trial {trial} normal {p}" for p in theirs_normal.problems]
            print(
                f"  trial {trial} normal: ours {normal.parents_per_second:.1f} parents/s ({normal.seconds:.3f} s; "
                f"{normal.cpu_note()}; workers {normal.all_mb:.0f} MB); "
                f"DBOS {theirs_normal.parents_per_second:.1f} parents/s ({theirs_normal.seconds:.3f} s; "
                f"{theirs_normal.cpu_note()}; workers {theirs_normal.all_mb:.0f} MB); "
                f"{system_load()}",
                flush=True,
            )
    n = f"median of {args.trials}"

    def spread(values: list[float], digits: int = 1) -> str:
        return f"trials {min(values):.{digits}f} .. {max(values):.{digits}f}"

    def ratios(ours_values: list[float], theirs: list[float]) -> str:
        each = [o / t for o, t in zip(ours_values, theirs, strict=True) if t]
        return f"per trial {min(each):.2f} .. {max(each):.2f}" if each else "no trial"

    found: dict[str, float] = {}
    if "crash" in args.modes:
        ours_rate, dbos_rate = median(ours_rates), median(dbos_rates)
        found["crash, deliveries/s"] = ours_rate / dbos_rate
        print(f"ours: {ours_rate:.1f} deliveries/s ({n}; {spread(ours_rates)})")
        print(f"DBOS: {dbos_rate:.1f} deliveries/s ({n}; {spread(dbos_rates)})")
        print(
            f"ratio ours/DBOS: {ours_rate / dbos_rate:.2f} ({ratios(ours_rates, dbos_rates)}; crash and recover, "
            f"deliveries/s; {system_load()})"
        )
    if "restart" in args.modes:
        ours_seconds = [r.seconds for r in ours_restart]
        ours_s, dbos_s = median(ours_seconds), median(dbos_restart)
        found["restart, seconds (lower is better)"] = ours_s / dbos_s
        print(
            f"restart -> every parent resumed, ours: {ours_s:.2f} s ({n}; {spread(ours_seconds, 2)}; LEASE_SECONDS "
            f"{args.lease_seconds:g}, SCAN_INTERVAL_SECONDS {args.scan_interval_seconds:g}, broker "
            f"{args.restart_broker}, worker ready after {median([r.ready_s for r in ours_restart]):.2f} s)"
        )
        print(f"process start -> every workflow done, DBOS: {dbos_s:.2f} s ({n}; {spread(dbos_restart, 2)})")
        print(
            f"restart ratio ours/DBOS (seconds, lower is better): {ours_s / dbos_s:.2f} "
            f"({ratios(ours_seconds, dbos_restart)}; {system_load()})"
        )
    if "normal" in args.modes:
        ours_pps, dbos_pps = median(ours_normal), median(dbos_normal)
        found["normal path, parents/s"] = ours_pps / dbos_pps
        workers = (
            f"the Procfile's workers, its threads line at -c {args.concurrency}"
            if args.topology == "procfile"
            else f"1 worker -P {args.pool} -c {args.concurrency}"
        )
        print(
            f"normal path, ours: {ours_pps:.1f} parents/s ({n}; {spread(ours_normal)}; {workers}; model latency "
            f"{args.model_latency:g} s; {median(ours_cpu):.0f} ms of the workers' CPU a parent)"
        )
        print(
            f"normal path, DBOS: {dbos_pps:.1f} parents/s ({n}; {spread(dbos_normal)}; {args.dbos_processes} "
            f"processes x {max(1, args.concurrency // args.dbos_processes)} child workflows at once; "
            f"{median(dbos_cpu):.0f} ms of its processes' CPU a parent)"
        )
        print(
            f"normal path ratio ours/DBOS (parents/s): {ours_pps / dbos_pps:.2f} "
            f"({ratios(ours_normal, dbos_normal)}; {system_load()})"
        )
    if problems:
        print(f"exactly-once checks: VIOLATED ({len(problems)})")
        for problem in problems:
            print(f"  {problem}")
        return 1, found
    print("exactly-once checks: ok (ours: invariants I1-I5; DBOS: one child per call, one round per parent)")
    return 0, found


if __name__ == "__main__":
    raise SystemExit(main())
