"""Named crash points (docs/crash-points.md: every point, its commit boundary, its test).

``crash_point("deliver.mid_round")`` does nothing unless armed:
- by environment: ``CRASH_POINT=deliver.mid_round`` (optionally ``CRASH_POINT_AFTER=N``: die on
  the N-th time the point is reached in this process) -> the process exits with os._exit(137),
  exactly like a SIGKILL at that line (no cleanup, no commit, no ack); with
  ``CRASH_POINT_MODE=stop`` the process instead SIGSTOPs itself there (frozen, as a paused VM
  or a debugger would leave it; the test sends SIGCONT or SIGKILL);
- in-process, by a test: ``with armed_fault("round.after_assistant"): ...`` -> raises
  ``InjectedFault`` at that point (transaction rollback tests, docs/fault-model.md R25).

Unarmed it costs one dict lookup. This module imports nothing from the project.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Every point the code calls; tests check that each one is reachable.
POINTS = (
    "delegate.after_child_session",  # inside the round transaction: child session inserted
    "delegate.after_user_message",  # inside the round transaction: child USER inserted
    "delegate.after_create",  # parent round + children committed, no child sent yet
    "parent.mid_inline",  # between inline tools of a delegating round
    "parent.before_yield",  # inline results recorded, no child sent yet
    "child.after_take",  # child execution taken, nothing run yet
    "child.mid_tool",  # inside a child's tool call (the round is not committed)
    "child.after_round",  # a child's non-final round committed
    "child.after_final",  # the child's final ASSISTANT + terminal execution committed
    "round.after_assistant",  # inside a round transaction: assistant row inserted
    "round.after_some_tools",  # inside a round transaction: first TOOL row inserted
    "round.after_all_tools",  # inside a round transaction: all TOOL rows, markers not yet
    "deliver.mid_round",  # inside the delivery transaction
    "deliver.before_resume",  # delivery committed, parent run not yet enqueued
    "deliver.batch_mid_round",  # inside a batch delivery's transaction: every round written, nothing marked
    "deliver.before_run_here",  # a delivered parent kept to run in the delivering process; its run not started
    "parent.after_resume",  # the parent's loop took its session again
    "recover.after_take",  # recovery took the execution, child loop not yet started
    "recover.between_children",  # a recovery batch's child ended (its parent ran), the next not yet taken
    "scan.after_take_parent",  # scan reserved a batch of dead executions, their recoveries not yet sent
    "scan.holding_right",  # scan took the right to scan, nothing else done yet
    "scan.inside_batch",  # inside a scan batch's transaction: dead rows and their parents locked and reserved
    "scan.before_pass_behind_queue",  # a boot pass left first runs to their queued messages; its follow-up not sent
    "journal.after_reply",  # the model's reply of a round committed to the journal, no tool run yet
    "journal.after_tool_start",  # a tool not safe to repeat: its start committed, the tool not run yet
    "journal.after_tool_result",  # one tool's result committed to the journal, the round not yet
    "approval.after_request",  # the reply and its approval requests committed, no tool run yet
    "approval.after_park",  # the session (or child execution) parked in WAITING_APPROVAL, loop not returned
    "approval.after_decision",  # a decision committed (and the session handed back), its loop not enqueued
    "mcp.after_call",  # an MCP server answered a tools/call; its result not journaled yet
    "field.after_claim",  # field recovery: invocation claimed, provider not yet called
    "field.after_run_recorded",  # field recovery: the platform's run id committed on the invocation, mid-stream
    "approval.after_edited_call",  # an approver's edited arguments journaled as the call, the tool not run yet
    "parent.after_inline_start",  # a delegating round's inline call: its start committed under the fence, not run yet
    "budget.after_ask",  # a refused reservation's budget request written and the session parked
    "budget.after_reserve",  # a model call's budget reservation committed, the model not asked yet
    "approval.after_rule",  # a continued round: tools' approval callables' decisions journaled, no tool run yet
    "approval.after_notified",  # the approval webhook took a notification and it is recorded; the task not acked
    "model.after_reply",  # the provider answered a model call; its reply not stored yet (nor journaled)
    "release.after_move",  # a session tree's move to another release committed at a round boundary, model not asked
)

EXIT_CODE = 137


class InjectedFault(RuntimeError):
    """A fault injected by a test at a named crash point."""


class InjectedKill(BaseException):
    """A process killed at a named crash point, in-process (a test's): no handler of the code
    under test catches it (they catch Exception), so nothing after the point runs, as after a
    SIGKILL; an open transaction rolls back."""


_armed_env = os.environ.get("CRASH_POINT", "")
_after = int(os.environ.get("CRASH_POINT_AFTER", "1") or "1")
_mode = os.environ.get("CRASH_POINT_MODE", "")
_hits: dict[str, int] = {}
_faults: dict[str, int] = {}
_kills: set[str] = set()
_lock = threading.Lock()


def rearm_from_env() -> None:
    """Re-read CRASH_POINT (tests that set it after import)."""
    global _armed_env, _after, _mode
    _armed_env = os.environ.get("CRASH_POINT", "")
    _after = int(os.environ.get("CRASH_POINT_AFTER", "1") or "1")
    _mode = os.environ.get("CRASH_POINT_MODE", "")
    _hits.clear()


def crash_point(name: str) -> None:
    if _faults:
        with _lock:
            if name in _faults:
                _faults[name] -= 1
                if _faults[name] <= 0:
                    del _faults[name]
                    if name in _kills:
                        _kills.discard(name)
                        raise InjectedKill(name)
                    raise InjectedFault(name)
    if _armed_env and name == _armed_env:
        with _lock:  # counted per process: on a threads pool, many loops reach it at once
            hits = _hits[name] = _hits.get(name, 0) + 1
        if hits == _after and _mode == "stop":
            sys.stderr.write(f"crash_point={name} pid={os.getpid()} stopping\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif hits >= _after and _mode != "stop":
            sys.stderr.write(f"crash_point={name} pid={os.getpid()} exiting\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)


@contextmanager
def armed_fault(name: str, *, on_hit: int = 1, kill: bool = False) -> Iterator[None]:
    """Raise InjectedFault (InjectedKill with ``kill``) the ``on_hit``-th time ``name`` is
    reached inside the block."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    with _lock:
        _faults[name] = on_hit
        if kill:
            _kills.add(name)
    try:
        yield
    finally:
        with _lock:
            _faults.pop(name, None)
            _kills.discard(name)
