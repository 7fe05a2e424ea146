"""`agent-recovery audit [--json] [--limit N]`: what operators asked for, newest first (the
``operator_action`` rows: decisions from every path, the console's cancels, redeliveries and
sign-ins)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "audit", help="operator actions (decisions, console cancels, redeliveries, sign-ins), newest first"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    p.set_defaults(handler=_audit)


def _audit(args: argparse.Namespace) -> int:
    from models import transaction
    from models.operator_action import latest

    with transaction() as s:
        rows = latest(s, limit=max(1, args.limit))
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    for r in rows:
        on = (
            f"execution {r['execution_id']}"
            if r["execution_id"]
            else f"session {r['session_id']}" + (f" call {r['call_id']}" if r["call_id"] else "")
            if r["session_id"]
            else "-"
        )
        print(f"{r['at']} {r['actor']} {r['action']} {on}: {r['outcome']}")
    return 0
