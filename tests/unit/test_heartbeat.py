"""The heartbeat's renewer threads (harness.fence): when a fence is renewed, when it is no more,
and that one thread serves the runs of a process one after another."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from harness.fence import Fence, Heartbeat, _Renewer
from models import lease

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
    renewer.hold(f)
    assert f.in_flight.wait(INTERVAL * 3)
    threads = renewer_threads()
    assert renewer.let_go(timeout=0.1) is False  # still renewing: not kept
    deadline = time.monotonic() + 3
    while renewer_threads() >= threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert renewer_threads() == threads - 1
    assert len(f.renewals) == 1
