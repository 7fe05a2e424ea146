"""`agent-recovery submit | session show | session list | cancel`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

#: Phases at which a turn has ended, as a client sees them (a session waiting for a person's
#: decision on a tool call has ended its turn too: somebody must act before it goes on).
TERMINAL_VIEW = ("WAITING_USER", "WAITING_APPROVAL", "COMPLETED", "FAILED", "CANCELLED")
#: Phases `session wait` answers with exit 0; FAILED and CANCELLED exit 1.
SETTLED_OK = ("WAITING_USER", "WAITING_APPROVAL", "COMPLETED")
#: Exit status of `session wait` when the turn has not ended within its timeout.
EXIT_STILL_RUNNING = 4


def fail(problem: str, status: int = 1) -> int:
    """One line naming the problem on stderr; returns the exit status."""
    print(f"agent-recovery: {problem}", file=sys.stderr)
    return status


def register(sub: Any) -> None:
    p = sub.add_parser("submit", help="start a session: new session, USER message, enqueue agent.run")
    p.add_argument("--agent", default="main", help="agent name (AGENTS_FILE or the built-in default)")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait for the turn to end")
    p.add_argument(
        "--budget-tokens", type=_positive_int, metavar="N", help="the token budget of the session's whole agent tree"
    )
    p.add_argument(
        "--budget-usd", type=_positive_float, metavar="X", help="the USD budget of the tree (MODEL_PRICES_FILE)"
    )
    p.add_argument(
        "--budget-model-calls", type=_positive_int, metavar="M", help="the model calls the whole tree may make"
    )
    p.add_argument("text")
    p.set_defaults(handler=_submit)

    sess = sub.add_parser("session", help="read sessions")
    ssub = sess.add_subparsers(dest="session_command", required=True)
    show = ssub.add_parser("show", help="one session with its messages and executions")
    show.add_argument("id", type=int)
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=_show)
    wait = ssub.add_parser(
        "wait",
        help="wait until the session's turn ends (exit 0 answered or waiting for a person, 1 failed or "
        "cancelled, 4 still running at the timeout)",
    )
    wait.add_argument("id", type=int)
    wait.add_argument("--timeout", type=float, default=60, metavar="SECONDS", help="give up after this long (60)")
    wait.set_defaults(handler=_wait)
    lst = ssub.add_parser("list", help="latest sessions")
    lst.add_argument("--json", action="store_true")
    lst.add_argument("--limit", type=_positive_int, default=50)
    lst.set_defaults(handler=_list)

    c = sub.add_parser("cancel", help="cancel a session (its pending child results are suppressed)")
    c.add_argument("id", type=int)
    c.add_argument("--by", default=None, help="who cancels, recorded in the audit (default: the OS user)")
    c.set_defaults(handler=_cancel)


#: Exit status of a submit whose session is saved but whose message could not be sent.
EXIT_NOT_ENQUEUED = 3


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _submit(args: argparse.Namespace) -> int:
    from harness.errors import UnknownAgent, is_infrastructure_error
    from harness.views import create_session
    from models.budget import BudgetLimits
    from tasks import app

    if not args.text.strip():
        return fail("submit: the text is empty")
    try:
        limits = BudgetLimits(args.budget_tokens, args.budget_usd, args.budget_model_calls)
        sid = create_session(args.agent, args.text, budget=limits or None)
    except UnknownAgent as exc:
        return fail(f"submit: {exc}")
    try:
        app.signature("agent.run", args=(sid, 0)).apply_async()
    except Exception as exc:
        if not is_infrastructure_error(exc):
            raise
        # The session is committed: say which one, and that the scan starts it (its reservation
        # lapses after a lease, then the recovery scan sends agent.run once a worker runs).
        print(sid)
        fail(
            f"submit: session {sid} is saved but the broker did not take its message "
            f"({type(exc).__name__}); the recovery scan will start it once the broker and a worker are up"
        )
        return EXIT_NOT_ENQUEUED
    if args.wait > 0:
        phase = wait_for_turn(sid, args.wait)
        say_where_it_stands(sid, phase)
    print(sid)
    return 0


def _wait(args: argparse.Namespace) -> int:
    phase = wait_for_turn(args.id, args.timeout)
    if phase is None:
        return fail(f"session wait: no session {args.id}")
    say_where_it_stands(args.id, phase)
    if phase in SETTLED_OK:
        return 0
    return 1 if phase in TERMINAL_VIEW else EXIT_STILL_RUNNING


def say_where_it_stands(sid: int, phase: str | None) -> None:
    """One line with the phase on stderr; for a session waiting for a person's decision, each
    pending call and the commands that decide it."""
    print(f"session {sid} phase={phase}", file=sys.stderr)
    if phase != "WAITING_APPROVAL":
        return
    from harness.views import snapshot
    from models import transaction

    with transaction() as s:
        snap = snapshot(s, sid)
    for a in (snap or {}).get("approvals", []):
        if a["status"] != "PENDING":
            continue
        print(
            f"  waits for approval: call {a['call_id']} tool {a['tool']} (until {a['expires_at']}); "
            f"see it with: agent-recovery approvals; decide with: agent-recovery approve {sid} {a['call_id']} "
            f"--by NAME  or  agent-recovery deny {sid} {a['call_id']} --reason TEXT",
            file=sys.stderr,
        )


def wait_for_turn(sid: int, timeout: float) -> str | None:
    from harness.views import snapshot
    from models import transaction

    end = time.monotonic() + timeout
    last = 0.0
    while True:
        with transaction() as s:
            snap = snapshot(s, sid)
        phase = snap["phase"] if snap else None
        if phase in TERMINAL_VIEW or time.monotonic() > end:
            return phase
        if time.monotonic() - last > 5:
            print(f"waiting for session {sid}: phase={phase}", file=sys.stderr)
            last = time.monotonic()
        time.sleep(0.2)


def _show(args: argparse.Namespace) -> int:
    from harness.views import snapshot
    from models import transaction
    from models.budget import budget_of, spent_line
    from models.usage import session_usage, tree_usage

    with transaction() as s:
        snap = snapshot(s, args.id)
        if snap is not None:
            own, tree = session_usage(s, args.id), tree_usage(s, args.id)
            snap["usage"] = {"session": own.as_dict(), "tree": tree.as_dict()}
            snap["budget"] = budget_of(s, args.id)
    if snap is None:
        return fail(f"session show: no session {args.id}")
    if args.json:
        print(json.dumps(snap, ensure_ascii=False, indent=2))
        return 0
    print(f"session {snap['id']} {snap['session_type']} agent={snap['agent_type']} phase={snap['phase']}")
    if snap.get("failure_code"):
        print(f"  {str(snap['phase']).lower()}: {snap['failure_code']} ({snap['failure_message'] or ''})")
    print(f"  usage: session {_totals(snap['usage']['session'])}; tree {_totals(snap['usage']['tree'])}")
    if (r := snap["release"])["id"] is not None:
        target = f", moving to release {r['target_id']} at its next round" if r["target_id"] else ""
        print(f"  release: {r['id']}{target}")
        if r["waiting_for_worker_since"]:
            print(f"  waiting for a worker of release {r['id']} since {r['waiting_for_worker_since']}")
        for m in r["moves"]:
            print(f"  moved: release {m['from_release_id']} -> {m['to_release_id']} ({m['reason']}) at {m['at']}")
    if (b := snap["budget"]) is not None:
        print(f"  budget: tree of session {b['root_session_id']}: {spent_line(b)}")
    for m in snap["messages"]:
        head = f"  [{m['id']}] {m['role']:<9}"
        if m["tool_calls"]:
            names = ", ".join(f"{c['function']['name']}#{c['id']}" for c in m["tool_calls"])
            print(f"{head} calls {names}")
        elif m["role"] == "TOOL":
            src = f" from session {m['source_session_id']}" if m["source_session_id"] else ""
            print(f"{head} result for {m['tool_call_id']}{src}: {_short(m['content'])}")
        else:
            mark = f"[{m['incomplete']}] " if m.get("incomplete") else ""
            print(f"{head} {mark}{_short(m['content'])}")
    for e in snap["executions"]:
        print(
            f"  execution {e['id']}: {e['invocation_type']} child={e['child_session_id']} "
            f"status={e['status']} delivery={e['delivery_status']} call={e['parent_tool_call_id']}"
        )
    for a in snap.get("approvals", []):
        decided = f" by {a['decided_by']} at {a['decided_at']}" if a["decided_by"] else f" until {a['expires_at']}"
        why = f": {_short(a['reason'], 80)}" if a["reason"] else ""
        print(f"  approval {a['call_id']} {a['tool']}: {a['status']}{decided}{why}")
        # Whole, on one line each: what the model asked, and what an approver edited it to.
        print(f"    arguments: {json.dumps(a['arguments'], ensure_ascii=False)}")
        if a["approved_arguments"] is not None:
            print(f"    edited to: {json.dumps(a['approved_arguments'], ensure_ascii=False)}")
    return 0


def _totals(t: dict[str, int]) -> str:
    return (
        f"prompt={t['prompt_tokens']} completion={t['completion_tokens']} cached={t['cached_tokens']} "
        f"reasoning={t['reasoning_tokens']} calls={t['model_calls']}"
        + (f" estimated={t['estimated_tokens']}" if t["estimated_tokens"] else "")
        + (f" usd={t['usd']:.6f}" if t.get("usd") is not None else "")
    )


def _short(text: str | None, n: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _list(args: argparse.Namespace) -> int:
    from harness.views import session_list
    from models import transaction

    with transaction() as s:
        rows = session_list(s, args.limit)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['id']:>6} {r['session_type']:<9} {r['agent_type']:<10} {r['phase']}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from harness.cancel import CancelOutcome, cancel
    from harness.errors import retry_while_busy

    actor = cli_actor(args.by)
    if actor is None:
        return fail(f"cancel: --by is longer than {MAX_BY_CHARS} characters", 2)
    result = retry_while_busy(lambda: cancel(args.id, actor=actor), what=f"session {args.id}")
    cli_audit(actor, action="cancel", session_id=args.id, outcome=str(result.outcome))
    if result.outcome == CancelOutcome.NOT_FOUND:
        return fail(f"cancel: no session {args.id}")
    done = "cancelled" if result.outcome == CancelOutcome.CANCELLED else "already stopped"
    print(f"session {args.id}: {done}; suppressed executions {result.suppressed}")
    return 0


#: The longest name ``--by`` may give (the audit's ``actor`` column, with its ``cli:``).
MAX_BY_CHARS = 124


def cli_actor(by: str | None = None) -> str | None:
    """Who runs an operator command from the CLI, for the action's log line and its audit row:
    ``cli:<by>``, else ``cli:<login>``; None when ``by`` is too long to record whole."""
    import getpass

    if by:
        return f"cli:{by}" if len(by) <= MAX_BY_CHARS else None
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return "cli"


def cli_audit(actor: str, **fields: Any) -> None:
    """The ``operator_action`` row of a cancel or a redelivery from the CLI, after it ran. One
    that cannot be written is said on stderr; the action landed or not already."""
    from sqlalchemy.exc import SQLAlchemyError

    from models.operator_action import record_now

    try:
        record_now(actor=actor, **fields)
    except SQLAlchemyError as exc:
        print(f"agent-recovery: the audit row was not written ({type(exc).__name__})", file=sys.stderr)
