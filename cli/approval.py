"""`agent-recovery approvals [show SESSION CALL] | approve | deny`: the pending approval
requests, one request whole, and a human's decision on one (a compare-and-set: the first
decision wins). Exit codes (docs/console.md, "Approval commands"): EXIT_* below."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

#: Exit codes of the approval commands: done (or the same decision stood already) is 0.
EXIT_CONFLICT = 1  #: another decision (an expiry, a cancel) stands: nothing done
EXIT_BAD_ARGUMENTS = 2  #: the command line or the edited arguments were refused: nothing done
EXIT_NOT_FOUND = 3  #: no approval request for that session and call
EXIT_UNREACHABLE = 4  #: the database could not be reached: nothing known, nothing done


def register(sub: Any) -> None:
    ls = sub.add_parser("approvals", help="pending approval requests, oldest first (show: one request whole)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=_list)
    lsub = ls.add_subparsers(dest="approvals_command")
    show = lsub.add_parser("show", help="one approval request whole: every argument, its decision")
    show.add_argument("session", type=int, help="session id (the list's session_id)")
    show.add_argument("call", help="call id (the list's call_id)")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=_show)

    ap = sub.add_parser("approve", help="approve a pending tool call (the first decision wins)")
    ap.add_argument("session", type=int, help="session id (the list's session_id)")
    ap.add_argument("call", help="call id (the list's call_id)")
    ap.add_argument("--by", default=None, help="who decides (default: the OS user)")
    ap.add_argument("--note", default="", help="why, kept with the decision")
    ap.add_argument("--arguments", default=None, help="edited arguments (JSON object) the tool runs with instead")
    ap.set_defaults(handler=_decide, approve=True)

    dn = sub.add_parser("deny", help="deny a pending tool call: the model gets 'denied by NAME: REASON'")
    dn.add_argument("session", type=int)
    dn.add_argument("call")
    dn.add_argument("--reason", required=True)
    dn.add_argument("--by", default=None)
    dn.set_defaults(handler=_decide, approve=False)


def _list(args: argparse.Namespace) -> int:
    from models import transaction
    from models.approval import listing

    with transaction() as s:
        rows = listing(s)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no pending approvals")
        return 0
    for r in rows:
        print(
            f"session {r['session_id']} call {r['call_id']} {r['agent_type']}: {r['tool']} {r['summary']}"
            f"  (waiting {r['age_seconds']:g} s, expires {r['expires_at']})"
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    from cli.agent import fail
    from models import transaction
    from models.approval import described, request_of

    with transaction() as s:
        row = request_of(s, args.session, args.call)
        shown = None if row is None else described(row)
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
    print("  arguments:")
    print(_indented(shown["arguments"]))
    if shown["approved_arguments"] is not None:
        print("  edited to (the tool ran with these):")
        print(_indented(shown["approved_arguments"]))
    return 0


def _indented(value: Any) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False)
    return "\n".join("    " + line for line in text.splitlines())


def _decide(args: argparse.Namespace) -> int:
    from harness.approval import DecisionRefused
    from harness.errors import retry_while_busy
    from models.approval import DecisionOutcome
    from tasks.approval import approve, deny

    by = args.by or getpass.getuser()

    def decision() -> Any:
        if args.approve:
            return approve(args.session, args.call, by=by, note=args.note, arguments=args.arguments)
        return deny(args.session, args.call, reason=args.reason, by=by)

    try:
        result = retry_while_busy(decision, what=f"the approval of call {args.call} (session {args.session})")
    except DecisionRefused as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 2
    message = result.describe()
    if result.outcome in (DecisionOutcome.DECIDED, DecisionOutcome.REPEATED):
        print(message)
        return 0
    print(f"agent-recovery: {message}", file=sys.stderr)
    return 1
