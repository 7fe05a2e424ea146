"""`agent-recovery approvals [show SESSION CALL] | approve | deny`: the pending approval
requests, one request whole, and a human's decision on one (a compare-and-set: the first
decision wins). Exit codes (docs/console.md, "Approval commands"): EXIT_* below."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable
from typing import Any

#: Exit codes of the approval commands: done (or the same decision stood already) is 0.
EXIT_CONFLICT = 1  #: another decision (an expiry, a cancel) stands: nothing done
EXIT_BAD_ARGUMENTS = 2  #: the command line or the edited arguments were refused: nothing done
EXIT_NOT_FOUND = 3  #: no approval request for that session and call
EXIT_UNREACHABLE = 4  #: the database could not be reached: nothing known, nothing done


def register(sub: Any) -> None:
    ls = sub.add_parser("approvals", help="pending approval requests, oldest first (show: one request whole)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=_reaching(_list))
    lsub = ls.add_subparsers(dest="approvals_command")
    show = lsub.add_parser("show", help="one approval request whole: every argument, its decision")
    show.add_argument("session", type=int, help="session id (the list's session_id)")
    show.add_argument("call", help="call id (the list's call_id)")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=_reaching(_show))

    ap = sub.add_parser("approve", help="approve pending tool calls (the first decision wins, per call)")
    ap.add_argument("session", type=int, help="session id (the list's session_id)")
    ap.add_argument("call", nargs="*", help="call ids (the list's call_id); several: each decided on its own")
    ap.add_argument("--all", action="store_true", help="every pending call of the session")
    ap.add_argument("--by", default=None, help="who decides (default: the OS user)")
    ap.add_argument("--note", default="", help="why, kept with the decision")
    ap.add_argument("--arguments", default=None, help="edited arguments (JSON object) the tool runs with instead")
    ap.add_argument(
        "--for-session",
        action="store_true",
        help="also approve every later call of the same tool in this session (and its other pending ones)",
    )
    ap.set_defaults(handler=_reaching(_decide), approve=True)

    dn = sub.add_parser("deny", help="deny pending tool calls: the model gets 'denied by ...: REASON'")
    dn.add_argument("session", type=int)
    dn.add_argument("call", nargs="*", help="call ids; several: each decided on its own")
    dn.add_argument("--all", action="store_true", help="every pending call of the session")
    dn.add_argument("--reason", required=True)
    dn.add_argument("--by", default=None)
    dn.set_defaults(handler=_reaching(_decide), approve=False, for_session=False, arguments=None)


#: Longest decider's name a request records (``approval_request.decided_by``).
MAX_BY_CHARS = 128


def _reaching(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``handler``, ending in one line and EXIT_UNREACHABLE when the database (or the broker)
    cannot be reached, and quietly when its reader stopped reading (``| head``)."""

    def run(args: argparse.Namespace) -> int:
        from cli.main import unreachable

        try:
            return handler(args)
        except BrokenPipeError:
            # The reader is gone: nothing more can be said to it, and Python's own flush at
            # exit must not say it either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except Exception as exc:
            problem = unreachable(exc)
            if problem is None:
                raise
            print(f"agent-recovery: {args.command}: {problem}", file=sys.stderr)
            return EXIT_UNREACHABLE

    return run


def _list(args: argparse.Namespace) -> int:
    from models import transaction
    from models.approval import listing

    with transaction() as s:
        rows = listing(s)
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    if not rows:
        print("no pending approvals")
        return 0
    for r in rows:
        print(
            f"session {r['session_id']} call {r['call_id']} {r['agent_type']}: {r['tool']} {r['summary']}"
            f"  (waiting {r['age_seconds']:g} s, expires {r['expires_at']})"
        )
    sys.stdout.flush()  # a closed pipe is seen here, inside the handler
    return 0


def _show(args: argparse.Namespace) -> int:
    from cli.agent import fail
    from models import transaction
    from models.approval import described, request_of
    from models.operator_action import attempts_on_call

    with transaction() as s:
        row = request_of(s, args.session, args.call)
        shown = None if row is None else {**described(row), "attempts": attempts_on_call(s, args.session, args.call)}
    if shown is None:
        return fail(f"approvals show: no approval request for session {args.session} call {args.call}", EXIT_NOT_FOUND)
    if args.json:
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    print(f"approval request {shown['id']}: session {shown['session_id']} call {shown['call_id']}")
    print(f"  tool:      {shown['tool']} (agent {shown['agent_type']})")
    print(f"  status:    {shown['status']}")
    print(f"  requested: {shown['requested_at']}, expires {shown['expires_at']}")
    if shown["decided_at"]:
        print(f"  decided:   {shown['decided_at']} by {shown['decided_by']}")
    if shown["reason"]:
        print(f"  reason:    {shown['reason']}")
    if shown["grant_id"] is not None:
        print(f"  grant:     {shown['grant_id']} (its tool approved for the rest of the session)")
    if shown["notified_at"]:
        print(f"  notified:  {shown['notified_at']} (APPROVAL_WEBHOOK_URL)")
    print("  arguments:")
    print(_indented(shown["arguments"]))
    if shown["approved_arguments"] is not None:
        print("  edited to (the tool ran with these):")
        print(_indented(shown["approved_arguments"]))
    for a in shown["attempts"]:
        print(f"  attempt:   {a['at']} {a['actor']} {a['action']}: {a['outcome']}")
    return 0


def _indented(value: Any) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False)
    return "\n".join("    " + line for line in text.splitlines())


def _decide(args: argparse.Namespace) -> int:
    """One call: its decision's line and exit code. Several (or ``--all``): a line per call, each
    its own compare-and-set, and the exit code of the first call that did not land (0 when each
    one landed or stood already)."""
    from cli.agent import fail

    by = args.by or getpass.getuser()
    if len(by) > MAX_BY_CHARS:
        return fail(f"{args.command}: --by is longer than {MAX_BY_CHARS} characters", EXIT_BAD_ARGUMENTS)
    if args.all == bool(args.call):
        return fail(f"{args.command}: name the calls, or --all (not both)", EXIT_BAD_ARGUMENTS)
    if args.arguments is not None and (args.all or len(args.call) != 1):
        return fail(f"{args.command}: --arguments goes with one call", EXIT_BAD_ARGUMENTS)
    calls = _pending_calls(args.session) if args.all else list(dict.fromkeys(args.call))
    if not calls:
        print(f"no pending approvals in session {args.session}")
        return 0
    if len(calls) == 1 and not args.all:
        return _decide_one(args, calls[0], by)
    codes = [_decide_one(args, call, by, prefix=f"call {call}: ") for call in calls]
    return next((c for c in codes if c != 0), 0)


def _pending_calls(session_id: int) -> list[str]:
    from models import transaction
    from models.approval import PendingFilter, pending

    with transaction() as s:
        return [r.call_id for r in pending(s, PendingFilter(session_id=session_id))]


def _decide_one(args: argparse.Namespace, call: str, by: str, *, prefix: str = "") -> int:
    from cli.agent import fail
    from harness.approval import DecisionRefused
    from harness.errors import retry_while_busy
    from models.approval import DecisionOutcome
    from tasks.approval import approve, deny

    def decision() -> Any:
        if args.approve:
            return approve(
                args.session, call, by=by, note=args.note, arguments=args.arguments, for_session=args.for_session
            )
        return deny(args.session, call, reason=args.reason, by=by)

    try:
        result = retry_while_busy(decision, what=f"the approval of call {call} (session {args.session})")
    except DecisionRefused as exc:
        return fail(prefix + str(exc), EXIT_BAD_ARGUMENTS)
    message = prefix + result.describe()
    if result.outcome in (DecisionOutcome.DECIDED, DecisionOutcome.REPEATED):
        print(message)
        return 0
    if result.outcome == DecisionOutcome.NOT_FOUND:
        return fail(message, EXIT_NOT_FOUND)
    return fail(message, EXIT_CONFLICT)
