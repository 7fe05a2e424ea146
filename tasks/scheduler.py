"""The Celery side of the loops' and the scan's Scheduler: children, deliveries, recoveries
and parent runs, sent by task name (no import cycle with the task modules).

Scans, recoveries and deliveries go to the recovery queue (celeryconfig routes them), so they
never wait behind hour-long children on the default queue.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from crashpoints import crash_point
from harness.scheduler import Children, SerialBatch
from logfmt import log_event

log = logging.getLogger(__name__)

#: Recoveries sent one message each up to this many executions in a pass; above, in batches.
FAN_OUT_ABOVE = 200
#: Executions per recovery.fan_out message: a worker publishes them in a second or two.
FAN_OUT_BATCH = 1000
#: Executions per recovery.recover_children message at most: a round's children (or a part of a
#: larger round), run one after another by one pool process (tasks.recovery).
RECOVER_BATCH = 8
#: Parents per agent.deliver_rounds message at most: its transaction holds their rows' locks.
DELIVER_BATCH = 25
#: A scan's deliveries go out in at least this many messages (when it has that many parents).
DELIVER_SPREAD = 4
#: An ``agent.deliver_rounds`` task runs the parents it handed over itself, one after the other,
#: until its runs have taken this long; the rest are sent as ``agent.run`` (any slot takes them).
RUN_HERE_SECONDS = 0.5


class CeleryScheduler:
    """harness.scheduler.Scheduler over Celery (plus ``fan_out``, the fan-out task's own step)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def _sig(self, name: str, *args: object) -> Any:
        return self.app.signature(name, args=args)

    def start_children(self, parent_id: int, parent_epoch: int, children: Children) -> None:
        """One ``agent.run_child`` per execution, and nothing after them: the round's last
        child to end delivers it (harness.child.after_end), the scan is its backstop. No chord:
        its counter and header results cost a result-backend write per child and a callback
        task per round that, on the normal path, always found the parent handed over already."""
        self._send_each("agent.run_child", children)

    def deliver_many(self, parents: Sequence[tuple[int, int]]) -> None:
        """One ``agent.deliver_round`` for a single parent; otherwise ``agent.deliver_rounds``
        messages of several parents each (one transaction delivers a message's parents), spread
        over at least DELIVER_SPREAD messages so that several pool processes share the work."""
        with self.app.producer_or_acquire() as producer:
            if len(parents) == 1:
                parent_id, epoch = parents[0]
                self._sig("agent.deliver_round", None, parent_id, epoch).apply_async(producer=producer)
                return
            size = min(DELIVER_BATCH, max(1, math.ceil(len(parents) / DELIVER_SPREAD)))
            for i in range(0, len(parents), size):
                batch = [[int(pid), int(epoch)] for pid, epoch in parents[i : i + size]]
                self._sig("agent.deliver_rounds", batch).apply_async(
                    producer=producer, argsrepr=f"({len(batch)} parents)"
                )

    def recover_many(self, rounds: Sequence[tuple[int, int, Children]]) -> None:
        """One ``recovery.recover_children`` message per round (at most RECOVER_BATCH executions
        each; a lone execution goes as ``recovery.recover_child``): the last of a round to end
        asks for its delivery (harness.child after_end), so no chord has to survive the next
        crash. A message per round rather than per execution: a third of the hops, and the
        round's last child runs its parent in the same task.

        A large pass (after a big crash) sends ``recovery.fan_out`` batches instead: the scan
        hands them over at once and the workers publish the per-execution messages in parallel."""
        # NOTE: the rounds' own (id, epoch) pairs, sent as they are (JSON writes a tuple as an
        # array): a pass of 10,000 parents x 3 made 60,000 new tuples and lists here, and the
        # collector ran 114 times a pass instead of 37 (0.30 against 0.17 s of CPU a pass).
        children = [pair for _parent, _epoch, kids in rounds for pair in kids]
        with self.app.producer_or_acquire() as producer:
            if len(children) <= FAN_OUT_ABOVE:
                for _parent, _epoch, kids in rounds:
                    for i in range(0, len(kids), RECOVER_BATCH):
                        self.recover_children(kids[i : i + RECOVER_BATCH], producer=producer)
                return
            for i in range(0, len(children), FAN_OUT_BATCH):
                batch = children[i : i + FAN_OUT_BATCH]
                # NOTE: without argsrepr Celery writes saferepr(args) into every message's
                # headers: for a batch, most of the cost of publishing it.
                self._sig("recovery.fan_out", batch).apply_async(
                    producer=producer, argsrepr=f"({len(batch)} executions)"
                )

    def recover_children(self, children: Children, producer: Any = None) -> None:
        """One message for ``children`` (reserved executions, each with the epoch the scan gave
        it): ``recovery.recover_child`` for one, else ``recovery.recover_children``."""
        if not children:
            return
        with self.app.producer_or_acquire(producer) as producer:
            if len(children) == 1:
                eid, epoch = children[0]
                self._sig("recovery.recover_child", eid, epoch).apply_async(producer=producer)
                return
            batch = [[int(eid), int(epoch)] for eid, epoch in children]
            self._sig("recovery.recover_children", batch).apply_async(
                producer=producer, argsrepr=f"({len(batch)} executions)"
            )

    def fan_out(self, children: Children) -> None:
        """One ``recovery.recover_child`` per execution (a fan-out batch, a recovery batch's rest
        passed on)."""
        self._send_each("recovery.recover_child", children)

    def _send_each(self, name: str, children: Children) -> None:
        """One ``name(execution_id, epoch)`` message per execution, on one producer."""
        with self.app.producer_or_acquire() as producer:
            for eid, epoch in children:
                self._sig(name, eid, epoch).apply_async(producer=producer)

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        self._sig("agent.run", parent_id, epoch).apply_async()


class ResumeHere:
    """The scheduler of a child's task (``agent.run_child``, ``recovery.recover_child``,
    ``recovery.recover_children``) and of ``agent.deliver_rounds``: what the run sends goes out
    as CeleryScheduler sends it, except the run of the parent whose round was delivered: that
    one is kept, and the task runs the parent's loop right after, in the same process
    (:meth:`run_kept`), with no task hop.

    NOTE: nothing is lost when that process dies: the delivery committed the parent's hand-over
    (a new epoch under a reservation) before the run was asked for, so a parent never taken
    is resumed by the scan once the reservation lapses (R18), as when an ``agent.run`` message
    is lost; one taken holds a lease that lapses the same way."""

    def __init__(self, inner: CeleryScheduler) -> None:
        self.inner = inner
        self.kept: list[tuple[int, int]] = []

    def start_children(self, parent_id: int, parent_epoch: int, children: Children) -> None:
        self.inner.start_children(parent_id, parent_epoch, children)

    def recover_many(self, rounds: Sequence[tuple[int, int, Children]]) -> None:
        self.inner.recover_many(rounds)

    def deliver_many(self, parents: Sequence[tuple[int, int]]) -> None:
        self.inner.deliver_many(parents)

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        self.kept.append((parent_id, epoch))

    def run_kept(self, run: Callable[[int, int], object], *, budget_seconds: float | None = None) -> None:
        """Run each kept parent with ``run(parent_id, epoch)``; one whose run raises (it never
        should: the loop turns every fault into its outcome) is sent as ``agent.run`` instead,
        where a run that took the epoch meanwhile makes that message stale. With
        ``budget_seconds``, the runs here are a harness.scheduler.SerialBatch: once they have
        run that long, the parents not started yet are sent as ``agent.run`` (from a timer, so a
        slow parent holds the next ones back no longer than that)."""
        kept, self.kept = self.kept, []

        def step(parent_id: int, epoch: int) -> None:
            crash_point("deliver.before_run_here")
            try:
                run(parent_id, epoch)
            except Exception:
                log_event(log, "parent_run_here_failed", logging.ERROR, exc_info=True, parent_id=parent_id)
                self._send([(parent_id, epoch)])

        if budget_seconds is None:
            for parent_id, epoch in kept:
                step(parent_id, epoch)
            return
        SerialBatch(kept, self._send, budget_seconds).run(step)

    def _send(self, parents: Sequence[tuple[int, int]]) -> None:
        for parent_id, epoch in parents:
            try:
                self.inner.resume_parent(parent_id, epoch)
            except Exception as exc:  # committed: the scan resumes it once its reservation lapses
                log_event(
                    log, "parent_resume_not_enqueued", logging.WARNING, parent_id=parent_id, error=type(exc).__name__
                )
