"""bench/_cpu.py: the CPU split of ``bench/recovery.py --cpu`` charges a window's CPU to the
process class that spent it (a pool process is a child of a worker's main process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench._cpu import CpuMeter, available

pytestmark = pytest.mark.skipif(not available(), reason="per-process CPU times come from Linux /proc")

#: A "worker": its main process forks one "pool process" that, told to go, burns CPU for a
#: while and says so; then both sleep (a process that exits inside the window is not counted).
WORKER = """
import os, sys, time
pid = os.fork()
if pid == 0:
    sys.stdout.write("forked\\n"); sys.stdout.flush()
    sys.stdin.readline()
    end = time.process_time() + float(sys.argv[1])
    while time.process_time() < end:
        pass
    sys.stdout.write("burnt\\n"); sys.stdout.flush()
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def test_a_pool_process_burning_cpu_is_charged_to_the_pool_not_to_the_main_process(db: str) -> None:
    burn = 0.4
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(burn)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "forked"
        meter = CpuMeter([proc.pid], database=db.rsplit("/", 1)[-1])
        meter.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "burnt"
        split = meter.stop()
    finally:
        proc.kill()
        proc.wait(10)
    pool = split.seconds["worker pool processes (the tasks' work)"]
    main = split.seconds["worker main processes (Celery's consumer)"]
    assert abs(pool - burn) < 0.1, split.seconds  # CPU times in clock ticks (10 ms)
    assert main < 0.1, split.seconds
    assert split.wall_s >= burn
    lines = split.lines(per=4, unit="delivery")
    assert lines[0].startswith("CPU during the timed window")
    assert any("worker pool processes" in line and "ms per delivery" in line for line in lines[1:])


#: Burns CPU until killed.
HOG = "while True:\n    pass\n"


def test_settle_checkpoints_and_waits_while_every_core_is_busy(db: str) -> None:
    import os

    from bench._cpu import QUIET_SHARE, settle

    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        settled = settle(db, at_most=1.5)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert settled.checkpointed
    assert settled.busy_share is not None and settled.busy_share >= QUIET_SHARE
    assert settled.seconds >= 1.5  # it waited its longest: never quiet
    assert "CHECKPOINT" in settled.note()


def test_settle_never_waits_past_its_cap() -> None:
    import os

    from bench._cpu import settle

    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        settled = settle("postgresql+psycopg2://postgres@127.0.0.1:1/none", at_most=30.0, cap=1.0)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert 1.0 <= settled.seconds < 5.0


def test_settle_can_be_turned_off_for_an_a_b(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench._cpu import settle

    monkeypatch.setenv("BENCH_SETTLE_SECONDS", "-1")
    settled = settle("postgresql+psycopg2://postgres@127.0.0.1:1/none")
    assert settled.off and not settled.checkpointed and settled.seconds == 0.0
    assert "off" in settled.note()


def test_settle_says_when_it_may_not_checkpoint() -> None:
    from bench._cpu import settle

    settled = settle("postgresql+psycopg2://postgres@127.0.0.1:1/none", at_most=0.0)
    assert not settled.checkpointed
    assert settled.busy_share is not None  # one window measured, however busy
    assert "CHECKPOINT" not in settled.note()
