"""`agent-recovery budget raise SESSION --tokens N [--by NAME]`: raise a running tree's token
budget, recorded with who did it (docs/usage.md, "Raising a budget")."""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from cli.agent import _positive_int, fail

#: Exit status of a raise that changed nothing (no such session, or its tree has no token budget).
EXIT_NOT_RAISED = 1


def register(sub: Any) -> None:
    p = sub.add_parser("budget", help="a tree's budget")
    bsub = p.add_subparsers(dest="budget_command", required=True)
    r = bsub.add_parser("raise", help="raise the token budget of the tree a session belongs to")
    r.add_argument("session", type=int, help="any session of the tree (its root's budget is raised)")
    r.add_argument("--tokens", type=_positive_int, required=True, metavar="N", help="tokens to add")
    r.add_argument("--by", default=None, help="who raises it (default: the OS user)")
    r.set_defaults(handler=_raise)


def _raise(args: argparse.Namespace) -> int:
    from models import transaction
    from models.budget import RaiseOutcome, raise_budget
    from models.operator_action import record

    by = (args.by or getpass.getuser())[:128]
    with transaction() as s:
        outcome = raise_budget(s, args.session, args.tokens)
        # In the raise's own transaction: the audit row and the raise commit together.
        record(s, actor=by, action="budget_raise", outcome=str(outcome), session_id=args.session, amount=args.tokens)
    if outcome is not RaiseOutcome.RAISED:
        return fail(f"budget raise: session {args.session}: {outcome}", EXIT_NOT_RAISED)
    print(f"session {args.session}: tree budget raised by {args.tokens} tokens ({outcome})")
    return 0
