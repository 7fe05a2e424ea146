"""`agent-recovery approvals | approve | deny`: the pending approval requests, and a human's
decision on one (a compare-and-set: the first decision wins; exit 1 when another stands; exit 3
when its row stayed busy through every attempt: cli.main.EXIT_BUSY)."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    ls = sub.add_parser("approvals", help="pending approval requests, oldest first")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=_list)

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
            f"session {r['session_id']} call {r['call_id']} {r['agent_type']}: {r['tool']} {r['arguments']}"
            f"  (waiting {r['age_seconds']:g} s, expires {r['expires_at']})"
        )
    return 0


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
