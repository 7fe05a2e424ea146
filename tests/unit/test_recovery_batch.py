"""recovery.child.RecoveryBatch: a recovery message's executions run one after another; a
slow step passes the ones not yet started on to a message of their own, each exactly once."""

from __future__ import annotations

import threading

import pytest

from crashpoints import InjectedFault, armed_fault
from recovery.child import RecoveryBatch

PAIRS = [(1, 2), (3, 4), (5, 6)]


def test_each_execution_runs_in_turn_and_nothing_is_passed_on() -> None:
    passed: list[list[tuple[int, int]]] = []
    ran: list[tuple[int, int]] = []
    batch = RecoveryBatch(PAIRS, passed.append)
    outcomes = batch.run(lambda eid, epoch: ran.append((eid, epoch)) or "completed")  # type: ignore[func-returns-value]
    assert ran == PAIRS and outcomes == ["completed"] * 3
    assert passed == [] and batch.passed_on == 0


def test_a_pass_on_during_a_step_sends_the_rest_once_and_they_do_not_run_here() -> None:
    passed: list[list[tuple[int, int]]] = []
    ran: list[tuple[int, int]] = []
    batch = RecoveryBatch(PAIRS, passed.append)

    def step(eid: int, epoch: int) -> str:
        ran.append((eid, epoch))
        batch.pass_on_rest()  # what the timer does while the first step runs long
        batch.pass_on_rest()  # a second time: nothing left to send
        return "completed"

    assert batch.run(step) == ["completed"]
    assert ran == [(1, 2)] and passed == [[(3, 4), (5, 6)]] and batch.passed_on == 2


def test_the_timer_passes_the_rest_on_while_a_step_outlasts_it() -> None:
    passed: list[list[tuple[int, int]]] = []
    sent = threading.Event()

    def pass_on(rest: list[tuple[int, int]]) -> None:
        passed.append(rest)
        sent.set()

    batch = RecoveryBatch(PAIRS, pass_on, pass_on_after=0.0)
    ran: list[tuple[int, int]] = []

    def step(eid: int, epoch: int) -> str:
        ran.append((eid, epoch))
        assert sent.wait(30)  # a slow child: the timer fires meanwhile
        return "completed"

    batch.run(step)
    assert ran == [(1, 2)] and passed == [[(3, 4), (5, 6)]]


def test_a_pass_on_that_cannot_be_sent_leaves_the_rest_to_run_here() -> None:
    def broker_down(rest: list[tuple[int, int]]) -> None:
        raise ConnectionError("broker down")

    batch = RecoveryBatch(PAIRS, broker_down)
    ran: list[tuple[int, int]] = []

    def step(eid: int, epoch: int) -> str:
        ran.append((eid, epoch))
        batch.pass_on_rest()
        return "completed"

    batch.run(step)
    assert ran == PAIRS and batch.passed_on == 0


def test_the_crash_point_between_children_is_reached_after_the_first_child_only() -> None:
    ran: list[tuple[int, int]] = []
    batch = RecoveryBatch(PAIRS, lambda rest: None)
    with armed_fault("recover.between_children"), pytest.raises(InjectedFault):
        batch.run(lambda eid, epoch: ran.append((eid, epoch)) or "completed")  # type: ignore[func-returns-value]
    assert ran == [(1, 2)]


def test_one_timer_covers_the_whole_batch_so_short_steps_cannot_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.scheduler as scheduler_module

    started: list[float] = []
    cancelled: list[bool] = []

    class RecordingTimer:
        def __init__(self, interval: float, function: object) -> None:
            started.append(interval)
            self.daemon = False

        def start(self) -> None:
            pass

        def cancel(self) -> None:
            cancelled.append(True)

    monkeypatch.setattr(scheduler_module.threading, "Timer", RecordingTimer)
    batch = RecoveryBatch([*PAIRS, (7, 8)], lambda rest: None, pass_on_after=0.25)
    ran: list[tuple[int, int]] = []
    batch.run(lambda eid, epoch: ran.append((eid, epoch)) or "completed")  # type: ignore[func-returns-value]
    assert ran == [*PAIRS, (7, 8)]
    assert started == [0.25], "one timer from the first step, not one a step"
    assert cancelled == [True]
