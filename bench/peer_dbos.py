"""Ours beside DBOS Transact: ``python bench/peer_dbos.py [--parents P] [--children K]``.

The crash-and-recover fan-out/fan-in workload of ``bench/recovery.py``, run on our stack and
then on DBOS Transact (the optional ``bench`` extra: ``pip install -e ".[bench]"``) against the
same PostgreSQL server, each in its own throwaway database, with the same scripted model:

- ours: ``bench.recovery.run_recovery`` (SIGKILLed prefork worker, broker flushed, a fresh
  worker's scan until every parent resumed);
- DBOS (``bench/_dbos_app.py``): a process starts P parent workflows; each asks the model,
  enqueues K child workflows (queue concurrency per process = our pool size), waits for them
  and writes the round in one datasource transaction. While the children hang in their model
  call, the process is SIGKILLed; a new process launches DBOS, whose startup recovery resumes
  every pending workflow; timed from just before ``DBOS.launch()`` until every parent
  workflow is SUCCESS.

Prints both throughputs (child results delivered to their parents per second, until every
parent finished; the median of ``--trials`` alternating runs) and the ratio ours/DBOS. DBOS's
queue and result polling intervals are set to ``--dbos-poll-seconds`` (DBOS's default is 1 s).
Exits 0 with a message when DBOS is not installed; 1 when either side loses or duplicates a
delivery.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

INSTALL_HINT = 'DBOS Transact is not installed: install with pip install -e ".[bench]"'


@dataclass
class DbosFigures:
    parents: int
    children: int
    first_delivery_s: float
    all_resumed_s: float
    problems: list[str]

    @property
    def deliveries_per_second(self) -> float:
        return self.parents * self.children / self.all_resumed_s


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


def _dbos_process(env: dict[str, str], log_dir: Path, *args: str) -> Any:
    from demo.stack import Service

    cmd = [sys.executable, "-m", "bench._dbos_app", *args]
    return Service(cmd, env, log_dir / f"dbos-{args[0]}.log", "event=launched")


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
    from sqlalchemy import make_url, text

    from bench._common import Stack, point_settings_at, progress, wait_for
    from bench.recovery import RECOVERY_SCRIPT, crash_script
    from models import get_engine

    point_settings_at(url)  # our engine only reads DBOS's tables here
    dbos_url = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    expected = parents * children
    with Stack("bench-peer-dbos") as stack:

        def env(model_url: str) -> dict[str, str]:
            import os

            from bench._common import ROOT

            out = {k: v for k, v in os.environ.items() if not k.startswith("DBOS__")}
            out.update(
                BENCH_DBOS_DATABASE_URL=dbos_url,
                BENCH_MODEL_URL=model_url,
                BENCH_DBOS_CONCURRENCY=str(concurrency),
                BENCH_DBOS_POLL_SECONDS=str(poll_seconds),
                PYTHONPATH=str(ROOT),
            )
            return out

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
        fresh = stack.add_worker(_dbos_process(env(instant.base_url), stack.log_dir, "recover"))
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
    return DbosFigures(parents, children, float(first) - t0, done_ms / 1000.0 - t0, problems)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/peer_dbos.py", description=__doc__.split("\n")[0])
    parser.add_argument("--parents", type=int, default=20, help="parents crashed mid-flight (default 20)")
    parser.add_argument("--children", type=int, default=3, help="children delegated by each parent (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="our pool size = DBOS queue concurrency (2)")
    parser.add_argument("--trials", type=int, default=3, help="alternating trials of each, medians (default 3)")
    parser.add_argument(
        "--dbos-poll-seconds", type=float, default=0.05, help="DBOS queue and result polling interval (0.05)"
    )
    args = parser.parse_args(argv)
    if min(args.parents, args.children, args.concurrency, args.trials) < 1 or args.dbos_poll_seconds <= 0:
        parser.error("--parents, --children, --concurrency and --trials must be >= 1, --dbos-poll-seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import dbos  # noqa: F401 - only whether it imports
    except ImportError:
        print(f"peer_dbos: {INSTALL_HINT}; nothing measured.")
        return 0
    from importlib.metadata import version

    from bench._common import bench_database
    from bench.recovery import run_recovery

    print(
        f"peer_dbos: {args.parents} parents x {args.children} children crashed mid-flight and recovered, "
        f"pool/queue concurrency {args.concurrency}; {args.trials} trial(s) of ours then DBOS Transact "
        f"{version('dbos')}, alternating",
        flush=True,
    )
    ours_rates: list[float] = []
    dbos_rates: list[float] = []
    problems: list[str] = []
    for trial in range(1, args.trials + 1):
        with bench_database("bench_peer_ours") as url:
            ours = run_recovery(
                url, parents=args.parents, children=args.children, workers=1, concurrency=args.concurrency
            )
        with bench_database("bench_peer_dbos", migrate=False) as url:
            theirs = run_dbos(
                url,
                parents=args.parents,
                children=args.children,
                concurrency=args.concurrency,
                poll_seconds=args.dbos_poll_seconds,
            )
        ours_rates.append(ours.deliveries_per_second)
        dbos_rates.append(theirs.deliveries_per_second)
        problems += [f"trial {trial} ours: {p}" for p in ours.invariants]
        problems += [f"trial {trial} {p}" for p in theirs.problems]
        print(
            f"  trial {trial}: ours {ours.deliveries_per_second:.1f} deliveries/s (every parent resumed "
            f"{ours.all_resumed_s:.3f} s after the scan); DBOS {theirs.deliveries_per_second:.1f} deliveries/s "
            f"(every parent workflow done {theirs.all_resumed_s:.3f} s after DBOS.launch())",
            flush=True,
        )
    ours_rate, dbos_rate = statistics.median(ours_rates), statistics.median(dbos_rates)
    print(f"ours: {ours_rate:.1f} deliveries/s (median of {args.trials})")
    print(f"DBOS: {dbos_rate:.1f} deliveries/s (median of {args.trials})")
    print(f"ratio ours/DBOS: {ours_rate / dbos_rate:.2f}")
    if problems:
        print(f"exactly-once checks: VIOLATED ({len(problems)})")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print("exactly-once checks: ok (ours: invariants I1-I5; DBOS: one child per call, one round per parent)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
