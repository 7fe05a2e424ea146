"""Agent tasks: thin adapters over harness.loop and recovery.delivery."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from harness.loop import LoopDeps, execute_child, run_agent, run_child
from harness.model import ModelClient
from recovery.delivery import deliver_round
from tasks import app
from tasks.scheduler import CeleryScheduler

log = logging.getLogger("tasks.agent")


@lru_cache(maxsize=1)
def _model() -> ModelClient:
    # One client (one HTTP session) per worker process; created after the fork.
    return ModelClient.from_settings()


def deps() -> LoopDeps:
    return LoopDeps(scheduler=CeleryScheduler(app), model=_model())


@app.task(name="agent.run")
def run(session_id: int, epoch: int) -> str:
    return run_agent(int(session_id), int(epoch), deps())


@app.task(name="agent.run_child")
def run_child_task(execution_id: int, epoch: int) -> str:
    """Chord header: never raises (a failure becomes a FAILED execution)."""
    try:
        return run_child(int(execution_id), int(epoch), deps())
    except Exception:
        log.error("event=run_child_error execution=%s", execution_id, exc_info=True)
        return "error"


@app.task(name="agent.deliver_round")
def deliver_round_task(_header_results: Any, parent_id: int, epoch: int) -> str:
    """Chord callback (also sent alone by the scan): deliver, then resume the parent."""
    outcome = deliver_round(int(parent_id), int(epoch))
    if outcome.kind == "resume" and outcome.new_epoch is not None:
        CeleryScheduler(app).resume_parent(int(parent_id), outcome.new_epoch)
    return outcome.kind


__all__ = ["deliver_round_task", "execute_child", "run", "run_child_task"]
