"""Agent tasks: thin adapters over harness.parent, harness.child and harness.delivery."""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import lru_cache
from typing import Any

from celeryconfig import DEFAULT_QUEUE
from harness.child import ChildOutcome, start_child
from harness.delivery import DeliveryKind, deliver_and_resume
from harness.delivery_batch import deliver_rounds_and_resume
from harness.loop import LoopDeps
from harness.model import ModelClient
from harness.parent import run_agent
from logfmt import log_event
from tasks import app
from tasks.scheduler import RUN_HERE_SECONDS, CeleryScheduler, ResumeHere

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _model() -> ModelClient:
    # One client (one HTTP session) per worker process; created after the fork.
    return ModelClient.from_settings()


def deps() -> LoopDeps:
    return LoopDeps(scheduler=CeleryScheduler(app), model=_model())


@app.task(name="agent.run", ignore_result=True)  # nobody reads it: no result-backend write
def run(session_id: int, epoch: int) -> str:
    return run_parent(int(session_id), int(epoch))


def run_parent(parent_id: int, epoch: int) -> str:
    """A parent's loop run in this process (what ``agent.run`` runs): the parents a task kept
    (tasks.scheduler.ResumeHere.run_kept)."""
    return run_agent(parent_id, epoch, deps())


def child_deps() -> tuple[LoopDeps, ResumeHere]:
    """A child task's dependencies: the parent whose round its end delivers is run by the same
    task afterwards (tasks.scheduler.ResumeHere)."""
    here = ResumeHere(CeleryScheduler(app))
    return replace(deps(), scheduler=here), here


@app.task(name="agent.run_child", ignore_result=True)  # nobody reads it: no result-backend write
def run_child_task(execution_id: int, epoch: int) -> str:
    """A child of the normal path: never raises (a failure becomes a FAILED execution). The
    last child of a round delivers it and then runs its parent here."""
    child, here = child_deps()
    try:
        outcome = start_child(int(execution_id), int(epoch), child)
    except Exception:
        log_event(log, "run_child_error", logging.ERROR, exc_info=True, execution_id=execution_id)
        outcome = ChildOutcome.ERROR
    here.run_kept(run_parent)
    return outcome


@app.task(name="agent.deliver_round", ignore_result=True)
def deliver_round_task(_header_results: Any, parent_id: int, epoch: int) -> str:
    """One parent's delivery: sent by the scan (and by a child whose in-process delivery
    failed), the first argument None. (It was the normal path's chord callback: the argument
    stays for messages still queued from before.)"""
    return deliver_and_resume(int(parent_id), int(epoch), CeleryScheduler(app)).kind


def serves_loops() -> bool:
    """Whether this worker consumes the queue of agent loops (a ``-Q recovery`` worker does not)."""
    return DEFAULT_QUEUE in app.amqp.queues.consume_from


@app.task(name="agent.deliver_rounds", ignore_result=True)
def deliver_rounds_task(parents: list[list[int]]) -> int:
    """Several parents' deliveries in one message ([[parent_id, epoch], ...]: the scan's
    batches); returns how many parents were handed a new epoch. The parents handed over are
    then run here, one after the other, with no ``agent.run`` hop, until those runs have taken
    RUN_HERE_SECONDS (the rest are sent); a worker that does not serve agent loops (``-Q
    recovery``) sends them all. A parent whose own delivery raised holds back none of them:
    they run first, then the error is raised."""
    scheduler = CeleryScheduler(app)
    here = ResumeHere(scheduler) if serves_loops() else None
    try:
        outcomes = deliver_rounds_and_resume([(int(pid), int(epoch)) for pid, epoch in parents], here or scheduler)
    finally:
        if here is not None:
            here.run_kept(run_parent, budget_seconds=RUN_HERE_SECONDS)
    return sum(1 for outcome in outcomes.values() if outcome.kind == DeliveryKind.RESUME)


__all__ = ["deliver_round_task", "deliver_rounds_task", "run", "run_child_task"]
