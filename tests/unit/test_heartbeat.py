"""The heartbeat's renewer threads (harness.fence): when a fence is renewed, when it is no more
(a renewal lost, or the holder's database call in flight past half a lease: progress, not
presence), and that one thread serves the runs of a process one after another."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from sqlalchemy.orm import Session

from harness.fence import Fence, Heartbeat, _Renewer
from models import lease
from models.db import CallClock, call_clock, call_in_flight

#: renewal_seconds(1.5) = 0.5 s: the shortest interval a lease gets.
LEASE = 1.5
INTERVAL = lease.renewal_seconds(LEASE)


@dataclass
class CountingFence(Fence):
    """A fence whose renewals are counted; ``answers`` says what each one does (the last one
    repeats): True lands, False is lost, an exception is a fault, a float sleeps first."""

    answers: list[object] = field(default_factory=lambda: [True])
    renewals: list[float] = field(default_factory=list)
    in_flight: threading.Event = field(default_factory=threading.Event)

    def check(self, s: Session, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        raise AssertionError("not used here")

    def renew(self) -> bool:
        answer = self.answers[min(len(self.renewals), len(self.answers) - 1)]
        self.renewals.append(time.monotonic())
        if isinstance(answer, float):
            self.in_flight.set()
            time.sleep(answer)
            self.in_flight.clear()
            return True
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    def _still_owned(self, s: Session) -> bool:
        return True


def fence(*answers: object) -> CountingFence:
    return CountingFence(session_id=1, epoch=1, lease_seconds=LEASE, answers=list(answers) or [True])


def renewer_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "heartbeat")


def test_a_held_fence_is_renewed_every_third_of_its_lease_and_never_after_the_exit() -> None:
    f = fence()
    began = time.monotonic()
    with Heartbeat(f):
        time.sleep(INTERVAL * 2.6)
    assert len(f.renewals) == 2, f.renewals
    assert INTERVAL * 0.9 <= f.renewals[0] - began < INTERVAL * 1.9
    assert f.renewals[1] - f.renewals[0] >= INTERVAL * 0.9
    time.sleep(INTERVAL * 1.6)
    assert len(f.renewals) == 2 and not f.lost


def test_a_renewal_that_does_not_land_marks_the_fence_lost_and_is_the_last() -> None:
    f = fence(False)
    with Heartbeat(f):
        time.sleep(INTERVAL * 2.6)
        assert f.lost
    assert len(f.renewals) == 1


def test_a_renewal_that_raises_is_tried_again_at_the_next_beat() -> None:
    f = fence(ConnectionError("a blip"), True)
    with Heartbeat(f):
        time.sleep(INTERVAL * 2.6)
    assert len(f.renewals) == 2 and not f.lost


def test_the_exit_waits_for_a_renewal_in_flight() -> None:
    f = fence(0.6)
    with Heartbeat(f):
        assert f.in_flight.wait(INTERVAL * 3)
    # The exit came while the renewal slept: it returned only once that renewal had ended.
    assert not f.in_flight.is_set()
    assert time.monotonic() - f.renewals[0] >= 0.55


def test_runs_one_after_another_are_renewed_by_one_kept_thread() -> None:
    with Heartbeat(fence()):
        pass
    before = renewer_threads()
    assert before >= 1
    fences = [fence() for _ in range(4)]
    for f in fences:
        with Heartbeat(f):
            time.sleep(INTERVAL * 1.3)
    assert renewer_threads() == before
    assert all(len(f.renewals) == 1 for f in fences), [len(f.renewals) for f in fences]


def test_a_renewal_that_hangs_never_delays_another_fences() -> None:
    hanging, other = fence(INTERVAL * 3), fence()
    done = threading.Event()

    def hold_hanging() -> None:
        with Heartbeat(hanging):
            done.wait(10)

    t = threading.Thread(target=hold_hanging)
    t.start()
    try:
        assert hanging.in_flight.wait(INTERVAL * 3)
        with Heartbeat(other):
            time.sleep(INTERVAL * 2.6)
        assert len(other.renewals) == 2
    finally:
        done.set()
        t.join(10)


def test_a_renewer_let_go_during_a_renewal_that_outlasts_the_wait_ends_after_it() -> None:
    f = fence(1.0)
    renewer = _Renewer()
    renewer.hold(f, CallClock())
    assert f.in_flight.wait(INTERVAL * 3)
    threads = renewer_threads()
    assert renewer.let_go(timeout=0.1) is False  # still renewing: not kept
    deadline = time.monotonic() + 3
    while renewer_threads() >= threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert renewer_threads() == threads - 1
    assert len(f.renewals) == 1


def test_a_fence_whose_holder_has_a_database_call_in_flight_past_half_a_lease_is_not_renewed_until_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f = fence()
    stalled = lease.stalled_call_seconds(LEASE)
    assert stalled == LEASE / 2
    with Heartbeat(f), caplog.at_level("WARNING", logger="harness.fence"):
        with call_in_flight():  # a statement that does not come back (a frozen connection)
            began = time.monotonic()
            time.sleep(INTERVAL * 4)
            ended = time.monotonic()
        time.sleep(INTERVAL * 2.6)
    assert not f.lost
    assert any(t - began <= stalled for t in f.renewals), f.renewals  # renewed while the call was young
    assert not [t for t in f.renewals if began + stalled + 0.05 < t < ended - 0.05], (began, ended, f.renewals)
    assert [t for t in f.renewals if t > ended], "renewed again once the call ended"
    skipped = [r.getMessage() for r in caplog.records if "event=lease_not_renewed" in r.getMessage()]
    assert len(skipped) == 1 and "reason=call_in_flight" in skipped[0], skipped  # logged once per stalled call


def test_a_call_in_flight_on_another_thread_never_stops_this_fences_renewals() -> None:
    f = fence()
    release = threading.Event()

    def stuck_elsewhere() -> None:
        with call_in_flight():
            release.wait(10)

    other = threading.Thread(target=stuck_elsewhere)
    other.start()
    try:
        with Heartbeat(f):
            time.sleep(INTERVAL * 4.6)
    finally:
        release.set()
        other.join(10)
    assert len(f.renewals) == 4, f.renewals


def test_a_nested_call_keeps_the_outer_calls_start_and_the_clock_is_clear_after_both() -> None:
    clock = call_clock()
    assert clock.in_flight_seconds() == 0.0
    with call_in_flight():
        outer = clock.since
        time.sleep(0.02)
        with call_in_flight():
            assert clock.since == outer
        assert clock.since == outer and clock.in_flight_seconds() >= 0.02
    assert clock.since == 0.0 and clock.in_flight_seconds() == 0.0
