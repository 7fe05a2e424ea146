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
