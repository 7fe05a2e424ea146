"""What the loops, the scan and delivery ask of the task layer: ONE protocol.

Celery implements it in production (tasks.scheduler.CeleryScheduler); tests record instead
(tests.helpers.RecordingScheduler). Domain code never imports Celery (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


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
        """Run each child in parallel, then deliver_round(parent_id, parent_epoch) (a chord)."""

    def recover_many(self, rounds: Sequence[tuple[int, int, Children]]) -> None:
        """For each (parent_id, parent_epoch, children): recover_child(eid, epoch) per child."""

    def deliver_many(self, parents: Sequence[tuple[int, int]]) -> None:
        """deliver_round(parent_id, epoch) for each."""

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        """Run the parent's loop with the epoch it was handed."""
