"""Process-wide state that a threads pool shares between many agent loops at once
(docs/scaling.md, "Per-process state under a threads pool"): each piece is driven from several
threads here, as a worker's pool threads drive it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

import crashpoints
from models import warmup


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch as often as the interpreter allows: an unlocked read-modify-write loses
    updates within a few thousand tries."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_a_crash_points_count_is_exact_when_many_threads_reach_it(
    monkeypatch: pytest.MonkeyPatch, fast_switching: None
) -> None:
    # CRASH_POINT_AFTER=N counts the N-th time the PROCESS reaches the point: with many loops
    # per process, a lost count would fire late, and in stop mode twice (a second SIGSTOP after
    # the test's SIGCONT).
    monkeypatch.setenv("CRASH_POINT", "child.mid_tool")
    monkeypatch.setenv("CRASH_POINT_AFTER", str(10**9))
    crashpoints.rearm_from_env()
    threads, hits = 8, 20_000
    start = threading.Barrier(threads)

    def reach() -> None:
        start.wait()
        for _ in range(hits):
            crashpoints.crash_point("child.mid_tool")

    try:
        runners = [threading.Thread(target=reach) for _ in range(threads)]
        for t in runners:
            t.start()
        for t in runners:
            t.join(timeout=60)
        assert crashpoints._hits["child.mid_tool"] == threads * hits
    finally:
        monkeypatch.delenv("CRASH_POINT")
        monkeypatch.delenv("CRASH_POINT_AFTER")
        crashpoints.rearm_from_env()


def test_the_warm_up_stays_paused_while_any_task_of_the_process_runs() -> None:
    # Two loops of one process: the first ends, the second still runs. The process is not
    # quiet: the warm-up must not take the CPU from the running loop.
    spells = warmup.QuietSpells()
    spells.task_began()
    spells.task_began()
    spells.task_ended()
    waiter = threading.Thread(target=spells.wait, daemon=True)
    waiter.start()
    waiter.join(timeout=warmup.QUIET_SECONDS * 6)
    assert waiter.is_alive(), "the warm-up went on while a task ran"
    spells.task_ended()
    waiter.join(timeout=5)
    assert not waiter.is_alive(), "the warm-up stayed paused after the last task ended"


def test_the_quiet_spell_starts_when_the_last_task_ends() -> None:
    spells = warmup.QuietSpells()
    spells.task_began()
    spells.task_ended()
    started = time.monotonic()
    spells.wait()
    assert time.monotonic() - started >= warmup.QUIET_SECONDS * 0.9


def test_every_loop_of_a_threads_pool_finds_an_idle_heartbeat_thread_for_its_next_run() -> None:
    # A renewer thread is kept between runs (harness.fence): a process of 32 loops keeps 32, so
    # that no run pays a thread's start and stop.
    from harness import fence
    from models.db import size_for_loops

    loops = 32
    size_for_loops(loops)
    try:
        fence._renewers.forget()
        beats = [fence.Heartbeat(fence.SessionFence(session_id=i, epoch=1, lease_seconds=30.0)) for i in range(loops)]
        for beat in beats:
            beat.__enter__()
        for beat in beats:
            beat.__exit__(None, None, None)
        assert len(fence._renewers._idle) == loops
    finally:
        size_for_loops(1)
        for renewer in fence._renewers._idle:
            renewer.stop()
        fence._renewers.forget()
