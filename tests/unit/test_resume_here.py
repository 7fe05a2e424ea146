"""tasks.scheduler.ResumeHere: a child's task keeps the run of the parent its end delivered and
runs it in-process; everything else goes out as CeleryScheduler sends it."""

from __future__ import annotations

from typing import Any

from tasks.scheduler import CeleryScheduler, ResumeHere


class _Sent(CeleryScheduler):
    """A CeleryScheduler that records what it would send."""

    def __init__(self) -> None:
        super().__init__(app=None)
        self.sent: list[tuple[str, Any]] = []

    def start_children(self, parent_id: int, parent_epoch: int, children: Any) -> None:
        self.sent.append(("children", (parent_id, parent_epoch, list(children))))

    def deliver_many(self, parents: Any) -> None:
        self.sent.append(("deliver", list(parents)))

    def recover_many(self, rounds: Any) -> None:
        self.sent.append(("recover", list(rounds)))

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        self.sent.append(("run", (parent_id, epoch)))


def test_the_parent_run_a_child_asks_for_is_run_in_process_and_never_sent() -> None:
    inner = _Sent()
    here = ResumeHere(inner)
    here.start_children(1, 2, [(3, 0)])
    here.deliver_many([(4, 5)])
    here.recover_many([(6, 7, [(8, 1)])])
    here.resume_parent(9, 10)
    assert inner.sent == [("children", (1, 2, [(3, 0)])), ("deliver", [(4, 5)]), ("recover", [(6, 7, [(8, 1)])])]
    ran: list[tuple[int, int]] = []
    here.run_kept(lambda pid, epoch: ran.append((pid, epoch)))
    assert ran == [(9, 10)]
    here.run_kept(lambda pid, epoch: ran.append((pid, epoch)))  # kept once, run once
    assert ran == [(9, 10)] and ("run", (9, 10)) not in inner.sent


def test_a_parent_run_that_raises_in_process_is_sent_as_agent_run_instead() -> None:
    inner = _Sent()
    here = ResumeHere(inner)
    here.resume_parent(9, 10)
    here.resume_parent(11, 12)

    def run(pid: int, epoch: int) -> None:
        if pid == 9:
            raise RuntimeError("unexpected")

    here.run_kept(run)
    assert inner.sent == [("run", (9, 10))]


def test_once_the_runs_here_took_the_budget_the_parents_not_run_yet_are_sent() -> None:
    import threading

    inner = _Sent()
    here = ResumeHere(inner)
    for pid in (1, 2, 3):
        here.resume_parent(pid, 7)
    ran: list[int] = []
    passed_on = threading.Event()
    inner.resume_parent = lambda pid, epoch: (inner.sent.append(("run", (pid, epoch))), passed_on.set())  # type: ignore[method-assign]

    def slow_first(pid: int, epoch: int) -> None:
        ran.append(pid)
        assert passed_on.wait(30)  # the first parent's turn outlasts the budget: the timer fires

    here.run_kept(slow_first, budget_seconds=0.0)
    assert ran == [1]  # the first always runs here
    assert inner.sent == [("run", (2, 7)), ("run", (3, 7))]


def test_within_the_budget_every_kept_parent_runs_here_and_none_is_sent() -> None:
    inner = _Sent()
    here = ResumeHere(inner)
    for pid in (1, 2, 3):
        here.resume_parent(pid, 7)
    ran: list[int] = []
    here.run_kept(lambda pid, epoch: ran.append(pid), budget_seconds=3600.0)
    assert ran == [1, 2, 3] and inner.sent == []


def test_a_delivery_task_runs_its_parents_here_only_on_a_worker_that_serves_agent_loops() -> None:
    from celeryconfig import DEFAULT_QUEUE
    from settings import get_settings
    from tasks import app
    from tasks.agent import serves_loops

    queues = app.amqp.queues
    saved = queues._consume_from
    try:
        assert serves_loops()  # a bare worker serves every queue
        queues.select([get_settings().RECOVERY_QUEUE])  # -Q recovery
        assert not serves_loops()
        queues.select([DEFAULT_QUEUE, get_settings().RECOVERY_QUEUE])
        assert serves_loops()
    finally:
        queues._consume_from = saved
