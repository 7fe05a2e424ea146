"""`agent-recovery status | redeliver | scan | local-client`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    st = sub.add_parser("status", help="executions by status/delivery, parents waiting, expired leases")
    st.add_argument("--json", action="store_true")
    st.set_defaults(handler=_status)

    rd = sub.add_parser("redeliver", help="re-run delivery for one execution (idempotent)")
    rd.add_argument("id", type=int, help="execution id (or a parent session id with --parent)")
    rd.add_argument("--parent", action="store_true", help="ID is a parent session: deliver all its results")
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


def _redeliver(args: argparse.Namespace) -> int:
    from cli.agent import cli_actor
    from recovery.errors import ExecutionNotFound
    from recovery.ops import redeliver, redeliver_parent
    from tasks import app
    from tasks.scheduler import CeleryScheduler

    try:
        fn = redeliver_parent if args.parent else redeliver
        outcome = fn(args.id, CeleryScheduler(app), actor=cli_actor())
    except ExecutionNotFound as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 1
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
