"""The benchmarks run with tiny sizes and print their figure lines, so they cannot rot.

Each one is a real subprocess (`python bench/NAME.py ...`) on its own throwaway database and
the benchmarks' own Redis databases; no figure is asserted, only that it is printed. A bench
whose optional extra (``bench``: DBOS Transact, ``profile``: pyinstrument) is not installed
must say so instead of printing figures; with the extra, it must print them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]

#: id -> (script, arguments, lines it must print, the extra's module or None)
CASES: dict[str, tuple[str, list[str], list[str], str | None]] = {
    "recovery": (
        "recovery",
        ["--parents", "3", "--children", "2", "--ceiling-seconds", "0.5", "--runs", "1", "--cpu"],
        [
            "settled: CHECKPOINT",
            "CPU during the timed window",
            "ms per delivery  worker pool processes",
            "scan -> every parent resumed:",
            "deliveries/s:",
            "commit ceiling:",
            "ratio ours/ceiling:",
            "invariants I1-I5: ok",
        ],
        None,
    ),
    "recovery-delivered-only": (
        "recovery",
        ["--delivered-only", "--parents", "3", "--children", "2", "--ceiling-seconds", "0.5", "--runs", "1"],
        [
            "delivery only (R16), deliveries/s:",
            "commit ceiling:",
            "delivery only (R16), ratio ours/ceiling:",
            "invariants I1-I5: ok",
        ],
        None,
    ),
    "recovery-delivered-only-warm": (
        "recovery",
        ["--delivered-only", "--warm", "--parents", "2", "--children", "2", "--ceiling-seconds", "0.5", "--runs", "1"],
        [
            "warm-up: 2 parents delivered and resumed by the same workers (untimed)",
            "timed: 2 parents delegated 4 children",
            "delivery only (R16, warm pools), deliveries/s:",
            "delivery only (R16, warm pools), ratio ours/ceiling:",
            "invariants I1-I5: ok (4 executions, 2 parents, each run)",
        ],
        None,
    ),
    "recovery-by-load": (
        "recovery",
        ["--delivered-only", "--parents", "2,3", "--children", "2", "--ceiling-seconds", "0.5", "--runs", "1"],
        [
            "invariants I1-I5: ok (4 executions, 2 parents, each run)",
            "invariants I1-I5: ok (6 executions, 3 parents, each run)",
            "by load (ours / the commit ceiling;",
            "  delivery only (R16), ratio ours/ceiling: 2: ",
            "  delivery only (R16), deliveries/s: 2: ",
        ],
        None,
    ),
    "scan": (
        "scan",
        ["--pending", "40", "--history", "5000", "--repeat", "1"],
        [
            "scan over 0 historic rows:",
            "scan over 5000 historic rows:",
            "ratio history/empty:",
            "plan uses idx_sae_pending: yes",
            "most rows a join of the scan compared and dropped:",
        ],
        None,
    ),
    "scan-parents": (
        "scan",
        ["--parents", "100", "--repeat", "1"],
        [
            "scan start -> every parent's recovery enqueued:",
            "parents taken per second:",
            "the scan without the broker",
        ],
        None,
    ),
    "scan-steps": (
        "scan",
        ["--steps", "3", "--per-parent", "2", "--repeat", "2"],
        ["scan start -> first hand-over:", "scan start -> end of the pass:", "  step deliver", "median of 2 passes"],
        None,
    ),
    "delegation": (
        "delegation",
        ["--runs", "1", "--rounds", "2", "--warmup", "0"],
        [
            "ours, round commit -> parent resumed:",
            "naive, delegation -> parent resumed:",
            "bare chord, enqueue -> follow-up:",
            "ratio ours/naive p50:",
            "ratio ours/bare",
            "invariants I1-I5: ok",
        ],
        None,
    ),
    "peer_dbos-normal": (
        "peer_dbos",
        ["--modes", "normal", "--parents", "2", "--children", "2", "--trials", "1"],
        ["normal path, ours:", "normal path, DBOS:", "normal path ratio ours/DBOS", "exactly-once checks: ok"],
        "dbos",
    ),
    "peer_dbos-restart": (
        "peer_dbos",
        [
            "--modes",
            "restart",
            "--parents",
            "2",
            "--children",
            "2",
            "--trials",
            "1",
            "--lease-seconds",
            "3",
            "--scan-interval-seconds",
            "1",
            "--cpu",
        ],
        [
            "was ready (its boot)",
            "ms per child  worker pool processes",
            "restart -> every parent resumed, ours:",
            "process start -> every workflow done, DBOS:",
            "restart ratio ours/DBOS",
            "exactly-once checks: ok",
        ],
        "dbos",
    ),
    "field": (
        "field",
        ["--runs", "1", "--replays", "5", "--calls", "3", "--deadline-seconds", "0.2", "--stalls", "slow,slow_drip"],
        [
            "replay of a finished key:",
            "our overhead per call beyond the stand-in's own time:",
            "return after the deadline, slow:",
            "return after the deadline, slow_drip:",
            "SSE: one budget-sized event",
            "fail-closed checks: ok",
        ],
        None,
    ),
    "profile": (
        "profile",
        ["--repeat", "2", "--top", "3"],
        ["normal delegating round:", "recovery (scan", "time by kind", "top 3 of our functions by total time"],
        "pyinstrument",
    ),
    "profile-timed": (
        "profile",
        ["--timed", "--repeat", "2"],
        [
            "normal delegating round, no profiler, 2 rounds in alternating blocks of 1:",
            "  plain rows on the Connection: wall ",
            "  every statement through the Session: wall ",
            "  ratio plain/ORM path: CPU ",
            "recovery, no profiler",
        ],
        None,
    ),
    "run_overhead": (
        "run_overhead",
        ["--runs", "5", "--rounds", "1", "--pause-ms", "1", "--model-calls", "5"],
        [
            "heartbeat, a thread per run (baseline): wall ",
            "heartbeat, a kept renewer (ours): wall ",
            "status event, synchronous PUBLISH (baseline): wall ",
            "status event, the publisher thread (ours): wall ",
            "model call, a connection per call (baseline): wall ",
            "model call, kept alive (ours): wall ",
            "heartbeat ratio ours/baseline, the run's wall per run: ",
            "status event ratio ours/baseline, the run's wall per event: ",
            "model call ratio ours/baseline: wall ",
        ],
        None,
    ),
    "boot": (
        "boot",
        ["--boots", "1", "--imports", "--top", "3"],
        [
            "spawn -> ready, plain celery: ",
            "spawn -> ready, through the marks: ",
            ")  cli: Celery's command line",
            ")  app: the app:",
            ")  ready: the banner, the pool's fork",
            "first pool process initialized ",
            "main process CPU at ready: ",
            "imports under -X importtime (self time, ",
            "  ours",
            "  dependency",
            "  top 3 packages:",
        ],
        None,
    ),
    "mcp_calls": (
        "mcp_calls",
        ["--calls", "3", "--threads", "2"],
        ["mcp_calls calls=3 threads=2 ok=3 seconds=", "mcp_calls calls_per_second=", "server_starts=1"],
        "mcp",
    ),
}

#: What a bench prints instead of figures when its extra is missing.
MISSING_EXTRA = "is not installed: install with pip install"


@pytest.mark.parametrize("case", sorted(CASES))
def test_benchmark_runs_with_tiny_sizes_and_prints_its_figures(case: str, pg_url: str, redis_url: str) -> None:
    script, args, lines, extra = CASES[case]
    # The benches' own Redis databases (4,5,6 of 6379 by default) are one set per server: two
    # xdist workers running two benches would consume each other's messages. This test process's
    # databases instead (tests/conftest.py), on the tests' server.
    env = {
        **os.environ,
        "BENCH_REDIS_URL": os.environ["STACK_REDIS_URL"],
        "BENCH_REDIS_DBS": os.environ["STACK_REDIS_DBS"],
        "BENCH_SETTLE_SECONDS": "0",  # the suite keeps the machine busy: no wait for quiet
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a bound on a hung bench under a loaded CI, not a speed figure
    )
    out = done.stdout
    assert done.returncode == 0, f"bench/{script}.py exited {done.returncode}\n{out}\n{done.stderr[-4000:]}"
    if extra is not None and importlib.util.find_spec(extra) is None:
        lines = [MISSING_EXTRA]
    missing = [line for line in lines if line not in out]
    assert not missing, f"bench/{script}.py did not print {missing}\n{out}"


#: What bench/scale.py --quick must print: its table, the ratios, the scan against history, a
#: line about the plot (written, or skipped without matplotlib) and the invariants.
SCALE_LINES = [
    "kind   w     N | parents/s   p50 ms   p99 ms | cpu ms  stmts    srv    tx  rows  WAL kB | main MB pool MB",
    "on disk per parent (tables and their indexes, kB): ours ",
    "ours   1    10 |",
    "naive  2    30 |",
    "ratios ours/naive (medians): w1 N10: throughput",
    "scan per pass (",
    "2000 historic rows",
    "plot: ",
    "invariants I1-I5: ok",
]


@pytest.mark.timeout(330)
def test_scale_bench_quick_prints_its_table_plot_line_and_invariants(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Four steps of each kind on fresh workers (1 and 2 of each, 10 and 30 parents): a longer
    # bound than the other benches' (boots, not speed), and nothing about the figures asserted.
    env = {
        **os.environ,
        "BENCH_REDIS_URL": os.environ["STACK_REDIS_URL"],
        "BENCH_REDIS_DBS": os.environ["STACK_REDIS_DBS"],
    }
    out_png = tmp_path / "scale.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--out", str(out_png)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a bound on a hung bench under a loaded CI, not a speed figure
    )
    out = done.stdout
    assert done.returncode == 0, f"bench/scale.py exited {done.returncode}\n{out}\n{done.stderr[-4000:]}"
    missing = [line for line in SCALE_LINES if line not in out]
    assert not missing, f"bench/scale.py did not print {missing}\n{out}"
    if importlib.util.find_spec("matplotlib") is None:
        assert "plot: skipped (matplotlib is not installed" in out
    else:
        assert f"plot: written to {out_png}" in out and out_png.stat().st_size > 0
