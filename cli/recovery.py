"""`agent-recovery status | health | redeliver | scan | local-client`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    st = sub.add_parser("status", help="executions by status/delivery, parents waiting, expired leases")
    st.add_argument("--json", action="store_true")
    st.set_defaults(handler=_status)

    hl = sub.add_parser(
        "health", help="is anything alive: workers, the last scan, approvals waiting, queues (exit 1 when red)"
    )
    hl.add_argument("--json", action="store_true")
    hl.set_defaults(handler=_health)

    rd = sub.add_parser("redeliver", help="re-run delivery for one execution (idempotent)")
    rd.add_argument("id", type=int, help="execution id (or a parent session id with --parent)")
    rd.add_argument("--parent", action="store_true", help="ID is a parent session: deliver all its results")
    rd.add_argument("--by", default=None, help="who redelivers, recorded in the audit (default: the OS user)")
    rd.set_defaults(handler=_redeliver)

    sc = sub.add_parser("scan", help="run one recovery scan now (sends the recoveries, deliveries, resumes it finds)")
    sc.set_defaults(handler=_scan)

    lc = sub.add_parser("local-client", help="LOCAL client presence, as a gateway would set it")
    lsub = lc.add_subparsers(dest="local_command", required=True)
    for name in ("connect", "disconnect"):
        p = lsub.add_parser(name)
        p.add_argument("user_id")
        p.set_defaults(handler=_local, local_action=name)


def _status(args: argparse.Namespace) -> int:
    from recovery.ops import status_report
    from tasks.queues import queue_waits

    report = status_report()
    report["queues"] = queue_waits()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for row in report["executions"]:
        print(f"{row['status']:<11} {row['delivery_status']:<11} {row['count']}")
    print(f"parents waiting: {report['parents_waiting']}")
    print(f"oldest pending age: {report['oldest_pending_age_seconds']} s")
    print(
        f"expired leases: executions={report['expired_execution_leases']} sessions={report['expired_session_leases']}"
        f" not picked up after a scan interval={report['expired_leases_not_picked_up']}"
    )
    print(f"stale field keys: {report['stale_field_keys']}")
    print(
        f"approvals pending: {report['approvals_pending']}"
        f" (oldest waiting {report['oldest_pending_approval_age_seconds']} s)"
    )
    print(f"sessions waiting for the model: {report['sessions_waiting_for_model']}")
    for c in report["worker_name_conflicts"]:
        state = "NOW: two live processes share this name" if c["live"] else "seen before"
        print(
            f"worker name conflict {c['worker']}: generation {c['older_generation']} ran beside generation "
            f"{c['generation']} (last seen {c['seen_at']}; {state})"
        )
    for q in report["queues"]:
        print(f"queue {q['queue']}: {q['messages']} waiting, oldest {q['oldest_wait_seconds']} s")
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when health is green, 1 when red (recovery.health names each reason)."""
    from models import transaction
    from recovery.health import verdict
    from tasks.queues import queue_waits

    with transaction() as s:
        report = verdict(s, queues=queue_waits())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    print("health: " + ("ok" if report["ok"] else "RED"))
    for p in report["problems"]:
        print(f"  {p['code']}: {p['message']}")
    seen = report["presence"]
    after = seen["silent_after_seconds"]
    print(f"workers: {seen['alive']} alive, {seen['silent']} silent (silent after {after:.0f} s)")
    for w in seen["workers"]:
        state = "alive" if w["alive"] else "silent"
        release = f", release {w['release_id']}" if w["release_id"] is not None else ""
        print(f"  {w['name']}: {state}, seen {w['seen_seconds_ago']} s ago ({w['hostname']} pid {w['pid']}{release})")
    age = report["scan_age_seconds"]
    print("last scan: " + ("never" if age is None else f"{age} s ago"))
    a = report["approvals"]
    oldest = "" if a["oldest_age_seconds"] is None else f" (oldest waiting {a['oldest_age_seconds']} s)"
    print(f"approvals pending: {a['pending']}{oldest}")
    for q in report["queues"]:
        depth = "unknown" if q["messages"] is None else q["messages"]
        print(f"queue {q['queue']}: {depth} waiting")
    return 0 if report["ok"] else 1


def _redeliver(args: argparse.Namespace) -> int:
    from cli.agent import MAX_BY_CHARS, cli_actor, cli_audit, fail
    from recovery.errors import ExecutionNotFound
    from recovery.ops import redeliver, redeliver_parent
    from tasks import app
    from tasks.scheduler import CeleryScheduler

    actor = cli_actor(args.by)
    if actor is None:
        return fail(f"redeliver: --by is longer than {MAX_BY_CHARS} characters", 2)
    target = {"session_id": args.id} if args.parent else {"execution_id": args.id}
    try:
        fn = redeliver_parent if args.parent else redeliver
        outcome = str(fn(args.id, CeleryScheduler(app), actor=actor))
    except ExecutionNotFound as exc:
        cli_audit(actor, action="redeliver", outcome="not_found", **target)
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 1
    cli_audit(actor, action="redeliver", outcome=outcome, **target)
    print(outcome)
    return 0


def _scan(args: argparse.Namespace) -> int:
    from cli.agent import fail
    from recovery.scan import scan
    from tasks import app
    from tasks.scheduler import CeleryScheduler

    # A pass reserves work and sends it: with no broker it would only reserve (the reservations
    # lapse and a later scan sends them), so say so before touching anything.
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        return fail(
            f"scan: the broker is unreachable ({type(exc).__name__}; CELERY_BROKER_URL); nothing was scanned", 2
        )
    report = scan(CeleryScheduler(app))
    print(
        json.dumps(
            {
                "ran": report.ran,
                "parents": report.parents,
                "suppressed": report.suppressed,
                "resumed_sessions": report.resumed_sessions,
                "waiting": report.waiting,
            }
        )
    )
    return 0


def _local(args: argparse.Namespace) -> int:
    from cli.agent import fail
    from harness import presence

    if not args.user_id.strip():
        return fail(f"local-client {args.local_action}: the user id is empty")

    if args.local_action == "connect":
        presence.connect(args.user_id)
    else:
        presence.disconnect(args.user_id)
    print(f"local client {args.user_id}: {args.local_action}ed")
    return 0
