"""What the loops, the scan and delivery ask of the task layer: ONE protocol.

Celery implements it in production (tasks.scheduler.CeleryScheduler); tests record instead
(tests.helpers.RecordingScheduler). Domain code never imports Celery (docs/architecture.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

from logfmt import log_event

log = logging.getLogger(__name__)
R = TypeVar("R")


class Handed(NamedTuple):
    """An execution and the epoch its next owner is handed (it takes epoch + 1)."""

    execution_id: int
    epoch: int


#: (execution_id, epoch) pairs of one parent.
Children = Sequence[tuple[int, int]]  # Handed values, or plain pairs


class Scheduler(Protocol):
    """Everything domain code enqueues. Each method only sends messages: a broker error
    propagates to the caller, which decides whether it loses anything (it never does: the
    database holds the state and the scan re-sends)."""

    def start_children(self, parent_id: int, parent_epoch: int, children: Children) -> None:
        """Run each child in parallel (the last to end delivers the round: harness.child.after_end)."""

    def recover_many(self, rounds: Sequence[tuple[int, int, Children]]) -> None:
        """For each (parent_id, parent_epoch, children): recover_child(eid, epoch) per child."""

    def deliver_many(self, parents: Sequence[tuple[int, int]]) -> None:
        """deliver_round(parent_id, epoch) for each."""

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        """Run the parent's loop with the epoch it was handed."""


#: (id, epoch) pairs a batch runs or passes on.
Pair = tuple[int, int]


class SerialBatch(Generic[R]):
    """Work items of one message (``(id, epoch)`` pairs: a round's executions, the parents a
    delivery handed over), run one after another by one process instead of a task hop each.

    A batch still running ``pass_on_after`` seconds after its first step began (a slow model
    call, or several steps) passes the items not yet started on to ``pass_on`` (messages: other
    pool processes run them side by side, so none waits longer than that for the ones before
    it), from a timer thread and under the batch's lock: each item is run here or passed on,
    never both. A pass-on that raises (the broker is down) leaves them to run here.
    ``between`` is called before every step but the first (a crash point)."""

    def __init__(
        self,
        items: Sequence[Pair],
        pass_on: Callable[[list[Pair]], object],
        pass_on_after: float,
        *,
        between: Callable[[], None] | None = None,
    ) -> None:
        self._rest = list(items)
        self._lock = threading.Lock()
        self._pass_on = pass_on
        self._after = pass_on_after
        self._between = between
        self.passed_on = 0

    def next(self) -> Pair | None:
        """The next item to run here, None when none is left (run or passed on)."""
        with self._lock:
            return self._rest.pop(0) if self._rest else None

    def pass_on_rest(self) -> None:
        """Pass the items not yet started on (the timer's action)."""
        with self._lock:
            rest, self._rest = self._rest, []
            if not rest:
                return
            try:
                self._pass_on(rest)
            except Exception as exc:
                self._rest = rest  # run here after all
                log_event(log, "batch_pass_on_failed", logging.WARNING, error=type(exc).__name__)
                return
            self.passed_on += len(rest)
        log_event(log, "batch_passed_on", items=len(rest), first_id=rest[0][0])

    def run(self, step: Callable[[int, int], R]) -> list[R]:
        """``step(id, epoch)`` for each item in turn; their results. One timer for the whole
        batch, from its first step: several steps each shorter than ``pass_on_after`` hold the
        last item back no longer than one slow step would."""
        results: list[R] = []
        timer: threading.Timer | None = None
        try:
            while (pair := self.next()) is not None:
                if results and self._between is not None:
                    self._between()
                if timer is None and self._rest:
                    timer = threading.Timer(self._after, self.pass_on_rest)
                    timer.daemon = True
                    timer.start()
                results.append(step(*pair))
        finally:
            if timer is not None:
                timer.cancel()
        return results
