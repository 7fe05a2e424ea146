"""`agent-recovery releases`: the agent releases stored and their live sessions; `agent-recovery
sessions upgrade`: move session trees to another release at their next round boundary
(docs/releases.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("releases", help="agent releases, oldest first, with their live sessions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_releases)

    sessions = sub.add_parser("sessions", help="act on many sessions at once")
    ssub = sessions.add_subparsers(dest="sessions_command", required=True)
    up = ssub.add_parser(
        "upgrade",
        help="move live session trees to another release at their next round boundary (exit 1: pending "
        "approvals of tools the target lacks, without --deny-missing; 2: no such release)",
    )
    up.add_argument("--to", required=True, metavar="current|ID", help="current: this configuration's release")
    up.add_argument("--agent", default=None, help="only sessions of this agent (the top-level session's)")
    up.add_argument("--from", dest="from_release", type=int, default=None, metavar="R", help="only sessions of R")
    up.add_argument("--dry-run", action="store_true", help="list what would move and the approvals in the way")
    up.add_argument(
        "--deny-missing",
        action="store_true",
        help="deny the pending approvals whose tool the target lacks (else the command refuses)",
    )
    up.add_argument("--by", default=None, help="who moves them (default: the OS user)")
    up.add_argument("--json", action="store_true")
    up.set_defaults(handler=_upgrade)


def release_report() -> list[dict[str, Any]]:
    """The ``releases --json`` shape: one object per release, oldest first."""
    from harness.views import release_list
    from models import transaction

    with transaction() as s:
        return release_list(s)


def _releases(args: argparse.Namespace) -> int:
    report = release_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for r in report:
        print(
            f"release {r['id']}  {r['content_hash'][:12]}  created {r['created_at']}  "
            f"live sessions {r['live_sessions']}  agents {', '.join(r['agents'])}"
            + (f"  waiting for a worker of it {r['waiting_for_worker']}" if r["waiting_for_worker"] else "")
            + (f"  workers {', '.join(r['workers'])}" if r["workers"] else "  no worker alive")
        )
    return 0


#: Exit codes of ``sessions upgrade``.
EXIT_ORPHANS = 1  #: pending approvals of tools the target lacks, and no --deny-missing: nothing done
EXIT_NO_RELEASE = 2  #: --to names no release


def _upgrade(args: argparse.Namespace) -> int:
    import getpass

    from cli.agent import fail
    from harness import upgrade
    from harness.agents import load_at_start
    from models import transaction

    if args.to == "current":
        load_at_start()  # the release of this configuration: TOOL_MODULES and AGENTS_FILE, as a worker's
    with transaction() as s:
        to = upgrade.target_release(s, args.to)
        plan = None if to is None else upgrade.plan(s, to_release=to, agent=args.agent, from_release=args.from_release)
    if plan is None:
        return fail(f"sessions upgrade: no release {args.to!r}", EXIT_NO_RELEASE)
    refused = bool(plan.orphans) and not args.deny_missing and not args.dry_run
    done: dict[int, upgrade.MarkOutcome] = {}
    if not args.dry_run and not refused:
        done = upgrade.apply(plan, by=args.by or getpass.getuser())
    report = {
        "to_release": plan.to_release,
        "dry_run": bool(args.dry_run),
        "refused": refused,
        "sessions": [
            {
                "session_id": t.session_id,
                "agent": t.agent_type,
                "from_release": t.release_id,
                "outcome": str(done[t.session_id]) if t.session_id in done else None,
            }
            for t in plan.trees
        ],
        "agent_missing": list(plan.agent_missing),
        "orphaned_approvals": [
            {
                "session_id": o.session_id,
                "call_id": o.call_id,
                "tool": o.tool,
                "reason": upgrade.orphan_reason(o, plan.to_release),
                "denied": bool(done),
            }
            for o in plan.orphans
        ],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_upgrade(report)
    if refused:
        return fail(
            f"sessions upgrade: {len(plan.orphans)} pending approval(s) of tools release {plan.to_release} lacks: "
            "decide them first, or pass --deny-missing; nothing moved",
            EXIT_ORPHANS,
        )
    return 0


def _print_upgrade(report: dict[str, Any]) -> None:
    to = report["to_release"]
    verb = "would move" if report["dry_run"] or report["refused"] else "moves"
    for r in report["sessions"]:
        state = f" ({r['outcome']})" if r["outcome"] else ""
        print(f"session {r['session_id']} {r['agent']}: release {r['from_release']} {verb} to {to}{state}")
    for o in report["orphaned_approvals"]:
        done = "denied" if o["denied"] else "pending"
        print(f"approval session {o['session_id']} call {o['call_id']} {o['tool']}: {done}: {o['reason']}")
    for sid in report["agent_missing"]:
        print(f"session {sid}: not moved: release {to} has no such agent")
    if not report["sessions"]:
        print(f"no live session to move to release {to}")
