"""Recovery tasks: thin adapters over recovery.scan / child / ops."""

from __future__ import annotations

import logging

from celery.signals import worker_ready

from harness.child import ChildOutcome
from harness.parent import run_agent
from logfmt import log_event
from models import lease
from recovery.child import RecoveryBatch, recover_child
from recovery.ops import redeliver, redeliver_parent
from recovery.scan import scan
from tasks import app
from tasks.agent import child_deps, deps
from tasks.scheduler import CeleryScheduler

log = logging.getLogger(__name__)


@app.task(name="recovery.scan")
def scan_task(boot: bool = False) -> dict[str, int]:
    """A beat's pass, or (``boot``) a worker's boot scan: that one is never dropped for a pass
    in flight, it runs right after it (waiting at most one scan right)."""
    report = scan(CeleryScheduler(app), wait_for_right=lease.scan_right_seconds() if boot else 0.0)
    return {
        "parents": len(report.parents),
        "suppressed": len(report.suppressed),
        "resumed": len(report.resumed_sessions),
    }


@app.task(name="recovery.recover_child", ignore_result=True)
def recover_child_task(execution_id: int, epoch: int) -> str:
    """One execution: a round's lone one, each of a large pass (recovery.fan_out), an
    operator's (no chord: the last recovered execution of a round delivers it, and then runs
    its parent here). Never raises: every failure becomes a FAILED execution."""
    child, here = child_deps()
    outcome = recover_child(int(execution_id), int(epoch), child)
    here.run_kept(lambda parent_id, parent_epoch: run_agent(parent_id, parent_epoch, deps()))
    return outcome


@app.task(name="recovery.recover_children", ignore_result=True)
def recover_children_task(children: list[list[int]]) -> list[str]:
    """A round's reserved executions (``[[execution_id, epoch], ...]``, the scan's message per
    round), run one after another here as ``recovery.recover_child`` runs one; the parent
    whose round an end delivered runs right after that child. A slow step passes the rest on,
    one ``recovery.recover_child`` each (recovery.child.RecoveryBatch). Never raises."""
    child, here = child_deps()

    def step(execution_id: int, epoch: int) -> ChildOutcome:
        outcome = recover_child(execution_id, epoch, child)
        here.run_kept(lambda parent_id, parent_epoch: run_agent(parent_id, parent_epoch, deps()))
        return outcome

    batch = RecoveryBatch([(int(eid), int(epoch)) for eid, epoch in children], CeleryScheduler(app).fan_out)
    return [str(outcome) for outcome in batch.run(step)]


@app.task(name="recovery.fan_out", ignore_result=True)
def fan_out_task(children: list[list[int]]) -> int:
    """A batch of a large scan pass: one recovery.recover_child message per execution."""
    CeleryScheduler(app).fan_out([(int(eid), int(epoch)) for eid, epoch in children])
    return len(children)


@app.task(name="recovery.redeliver")
def redeliver_task(execution_id: int) -> str:
    """`celery -A tasks call recovery.redeliver --args='[EXECUTION_ID]'`: idempotent."""
    return redeliver(int(execution_id), CeleryScheduler(app))


@app.task(name="recovery.redeliver_parent")
def redeliver_parent_task(parent_session_id: int) -> str:
    return redeliver_parent(int(parent_session_id), CeleryScheduler(app))


@worker_ready.connect
def _boot_scan(sender: object = None, **_: object) -> None:
    # N workers -> N boot scans: the right to scan and the compare-and-sets serialize them.
    try:
        scan_task.apply_async(kwargs={"boot": True})
    except Exception:
        log_event(log, "boot_scan_not_enqueued", logging.ERROR, exc_info=True)
