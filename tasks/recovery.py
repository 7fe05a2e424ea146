"""Recovery tasks: thin adapters over recovery.scan / child / ops."""

from __future__ import annotations

import logging

from celery.signals import worker_ready
from kombu.exceptions import ChannelError

from crashpoints import crash_point
from harness.child import ChildOutcome
from harness.loop import LoopDeps
from logfmt import log_event
from models import lease
from recovery.child import RecoveryBatch, recover_child
from recovery.ops import redeliver, redeliver_parent
from recovery.scan import scan
from tasks import app
from tasks.agent import child_deps, run_parent
from tasks.scheduler import CeleryScheduler, ResumeHere

log = logging.getLogger(__name__)


@app.task(name="recovery.scan")
def scan_task(boot: bool = False, behind_queue: bool = False) -> dict[str, int]:
    """A beat's pass, or (``boot``) a worker's boot scan: that one is never dropped for a pass
    in flight, it runs right after it (waiting at most one scan right), and it leaves first
    runs of a restarted creator to their messages still queued (recovery.scan; as many as the
    children's queue holds): when it left some, it sends a pass ``behind_queue``, queued behind
    them, which re-sends those still untaken when it runs (waiting for the right as a boot
    scan does)."""
    wait = lease.scan_right_seconds() if boot or behind_queue else 0.0
    queued = (queued_children() or 0) if boot else 0
    report = scan(CeleryScheduler(app), wait_for_right=wait, leave_first_runs=queued)
    if report.left_to_queue:
        crash_point("scan.before_pass_behind_queue")
        _send_pass_behind_queue()
    return {
        "parents": len(report.parents),
        "suppressed": len(report.suppressed),
        "resumed": len(report.resumed_sessions),
        "left_to_queue": report.left_to_queue,
    }


def queued_children() -> int | None:
    """How many messages the broker holds in the queue ``agent.run_child`` is routed to (a
    passive declare on a connection of its own, which Redis and RabbitMQ both answer; a queue
    the broker does not know holds none); None when it cannot tell."""
    try:
        queue = app.amqp.router.route({}, "agent.run_child")["queue"]
        with app.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(queue=queue.name, passive=True).message_count)
    except ChannelError as exc:
        if str(getattr(exc, "reply_code", "")) == "404":  # a broker restarted empty knows no queue yet
            return 0
        log_event(log, "queue_depth_unknown", logging.WARNING, exc_info=True)
        return None
    except Exception:
        log_event(log, "queue_depth_unknown", logging.WARNING, exc_info=True)
        return None


def _send_pass_behind_queue() -> None:
    """``recovery.scan(behind_queue=True)`` at the back of the queue ``agent.run_child`` is
    routed to. Not sent (the broker is down): the beat's next pass does its work."""
    queue = app.amqp.router.route({}, "agent.run_child")["queue"]
    try:
        scan_task.apply_async(kwargs={"behind_queue": True}, queue=queue)
    except Exception:
        log_event(log, "pass_behind_queue_not_enqueued", logging.WARNING, exc_info=True)


@app.task(name="recovery.recover_child", ignore_result=True)
def recover_child_task(execution_id: int, epoch: int) -> str:
    """One execution: a round's lone one, each of a large pass (recovery.fan_out), an
    operator's (no chord: the last recovered execution of a round delivers it, and then runs
    its parent here). Never raises: every failure becomes a FAILED execution."""
    child, here = child_deps()
    return _recover_then_run_parent(int(execution_id), int(epoch), child, here)


def _recover_then_run_parent(execution_id: int, epoch: int, child: LoopDeps, here: ResumeHere) -> ChildOutcome:
    """One execution recovered, then the parent its end delivered (if any) run here."""
    outcome = recover_child(execution_id, epoch, child)
    here.run_kept(run_parent)
    return outcome


@app.task(name="recovery.recover_children", ignore_result=True)
def recover_children_task(children: list[list[int]]) -> list[str]:
    """A round's reserved executions (``[[execution_id, epoch], ...]``, the scan's message per
    round), run one after another here as ``recovery.recover_child`` runs one; the parent
    whose round an end delivered runs right after that child. A slow step passes the rest on,
    one ``recovery.recover_child`` each (recovery.child.RecoveryBatch). Never raises."""
    child, here = child_deps()
    batch = RecoveryBatch([(int(eid), int(epoch)) for eid, epoch in children], CeleryScheduler(app).fan_out)
    outcomes = batch.run(lambda execution_id, epoch: _recover_then_run_parent(execution_id, epoch, child, here))
    return [str(outcome) for outcome in outcomes]


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
