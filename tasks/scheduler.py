"""The Celery side of the loop's Scheduler: chords of children, then deliver_round."""

from __future__ import annotations

from collections.abc import Sequence

from celery import chord


class CeleryScheduler:
    """Enqueues by task name so this module does not import the task modules (no cycles)."""

    def __init__(self, app: object) -> None:
        self.app = app

    def _sig(self, name: str, *args: object) -> object:
        return self.app.signature(name, args=args)  # type: ignore[attr-defined]

    def start_children(self, parent_id: int, parent_epoch: int, children: Sequence[tuple[int, int]]) -> None:
        header = [self._sig("agent.run_child", eid, epoch) for eid, epoch in children]
        chord(header)(self._sig("agent.deliver_round", parent_id, parent_epoch))

    def recover_children(self, parent_id: int, parent_epoch: int, children: Sequence[tuple[int, int]]) -> None:
        if not children:
            self._sig("agent.deliver_round", None, parent_id, parent_epoch).apply_async()  # type: ignore[attr-defined]
            return
        header = [self._sig("recovery.recover_child", eid, epoch) for eid, epoch in children]
        chord(header)(self._sig("agent.deliver_round", parent_id, parent_epoch))

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        self._sig("agent.run", parent_id, epoch).apply_async()  # type: ignore[attr-defined]
