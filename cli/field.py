"""`agent-recovery field recover|stale|release` and `agent-recovery superagent-stub serve`.

``field recover`` runs one EML through the MANUAL_EML pipeline with the environment's settings
(BOOKING_FIELD_RECOVERY__*). ``--json`` prints ONE JSON object (a public interface)::

    {"status": "SUCCEEDED" | "FAILED" | "NO_TASKS" | "SKIPPED", "needs_review": bool,
     "replayed": bool, "provider_calls": int, "effective_view": {"facts": [{"path", "value",
     "status", "provenance"}, ...]}, "rejected": [{"task_id", "reason"}, ...],
     "error_code": str | null, "idempotency_key": str | null}

Exit status: 0 when the pipeline continued with a recovered or baseline view, 1 when the
recovery failed closed (or the EML/database could not be used), 2 on invalid settings, 3 when
it succeeded but needs review (the validator rejected at least one patch).

``field stale [--json]`` lists the invocations IN_PROGRESS past their lease (a dead owner), with
their age; ``field release KEY [--reason TEXT] [--epoch N]`` fails one of them (fenced by its
epoch) so that its redeliveries stop waiting and a new attempt can run, then cancels the dead
owner's platform run when its id was recorded (``run RUN: cancelled``). Exit 0 when released,
1 when not (not found, finished, lease still live, or a newer owner).

An EML that passes a parser limit (``BOOKING_FIELD_RECOVERY__EML__*``) or cannot be parsed ends
``field recover`` with ONE line on stderr (``[eml_too_large]`` / ``[eml_invalid]``) and exit 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

#: Exit status of `field recover` when the recovery succeeded but needs review.
EXIT_NEEDS_REVIEW = 3
#: The largest attempt number (an ``integer`` column).
MAX_ATTEMPT = 2**31 - 1


def _attempt(text: str) -> int:
    """``--attempt``: an integer from 1 to MAX_ATTEMPT (argparse turns the error into exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= MAX_ATTEMPT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_ATTEMPT}")
    return value


def register(sub: Any) -> None:
    field = sub.add_parser("field", help="SuperAgent field recovery")
    fsub = field.add_subparsers(dest="field_command", required=True)
    rec = fsub.add_parser("recover", help="recover the unresolved fields of one booking EML")
    rec.add_argument("file", metavar="FILE.eml", type=Path)
    rec.add_argument("--json", action="store_true", help="print one JSON object")
    rec.add_argument(
        "--attempt", type=_attempt, default=1, help="attempt number, 1 or more (part of the idempotency key)"
    )
    rec.add_argument("--source", choices=("MANUAL_EML", "AGENTBUS"), default="MANUAL_EML")
    rec.set_defaults(handler=_recover)
    stale = fsub.add_parser("stale", help="list invocations IN_PROGRESS past their lease (a dead owner)")
    stale.add_argument("--json", action="store_true", help="print one JSON object")
    stale.add_argument("--limit", type=int, default=100)
    stale.set_defaults(handler=_stale)
    release = fsub.add_parser("release", help="fail a stale invocation so its key stops blocking")
    release.add_argument("key", metavar="KEY", help="the idempotency key (from `field stale`)")
    release.add_argument("--reason", default="owner gone", help="recorded in error_summary")
    release.add_argument("--epoch", type=int, default=None, help="the epoch seen in `field stale` (fencing)")
    release.set_defaults(handler=_release)

    stub = sub.add_parser("superagent-stub", help="the SuperAgent Open API stand-in (tests, demo)")
    ssub = stub.add_subparsers(dest="stub_command", required=True)
    serve = ssub.add_parser("serve", help="serve the stand-in on loopback until interrupted")
    serve.add_argument("--port", type=int, default=8799)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--api-key", default="df_open_test", help="the Bearer key it accepts")
    serve.add_argument(
        "--behaviour",
        default="normal",
        help="normal, slow, cut_replayable, slow_headers, gzip, heartbeat, ... (doubles/superagent.py)",
    )
    serve.add_argument("--no-chunked", action="store_true", help="close-delimited SSE bodies")
    serve.set_defaults(handler=_serve)


def _recover(args: argparse.Namespace) -> int:
    from fieldrecovery.errors import FieldRecoveryError
    from fieldrecovery.orchestrator import RecoveryStatus, recover_eml
    from fieldrecovery.schemas import SourceKind
    from settings import get_settings

    settings = get_settings()  # invalid settings stop here, naming the variable (exit 2)
    limit = settings.booking_field_recovery.eml.max_input_bytes
    try:
        with args.file.open("rb") as handle:
            raw = handle.read(limit + 1)  # one byte past the limit is enough to refuse the file
    except OSError as exc:
        print(f"agent-recovery: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        run = recover_eml(
            raw, source=SourceKind(args.source), attempt=args.attempt, settings=settings.booking_field_recovery
        )
    except FieldRecoveryError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 1
    result = run.to_json()
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        _print_table(result)
    if run.status == RecoveryStatus.FAILED:
        return 1
    return EXIT_NEEDS_REVIEW if run.needs_review else 0


def _stale(args: argparse.Namespace) -> int:
    from fieldrecovery.errors import FieldRecoveryError
    from fieldrecovery.store import list_stale

    try:
        stale = list_stale(limit=args.limit)
    except FieldRecoveryError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"stale": [s.to_json() for s in stale]}))
        return 0
    if not stale:
        print("no stale invocations")
        return 0
    rows = [("KEY", "EPOCH", "AGE", "OVERDUE", "OWNER")] + [
        (s.idempotency_key, str(s.epoch), f"{s.age_seconds:.0f}s", f"{s.overdue_seconds:.0f}s", s.owner_id)
        for s in stale
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _release(args: argparse.Namespace) -> int:
    from fieldrecovery.client import client_for
    from fieldrecovery.errors import FieldRecoveryError
    from fieldrecovery.store import ReleaseOutcome, store_from_settings
    from settings import get_settings

    try:
        outcome, run_id = store_from_settings().release_run(args.key, reason=args.reason, epoch=args.epoch)
    except FieldRecoveryError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 1
    print(f"{args.key}: {outcome.value}")
    if outcome == ReleaseOutcome.RELEASED and run_id is not None:
        # The dead owner's platform run may still be running (and paid for): cancel it now.
        settings = get_settings().booking_field_recovery
        if settings.open_api.api_key.get_secret_value():
            sent = client_for(settings).cancel(run_id)
            print(f"run {run_id}: {'cancelled' if sent else 'cancel failed'}")
    return 0 if outcome == ReleaseOutcome.RELEASED else 1


def _print_table(result: dict[str, Any]) -> None:
    replayed = "yes" if result["replayed"] else "no"
    review = "   NEEDS REVIEW" if result["needs_review"] else ""
    print(f"status: {result['status']}   replayed: {replayed}   provider calls: {result['provider_calls']}{review}")
    if result["error_code"]:
        print(f"error: {result['error_code']}")
    facts = result["effective_view"]["facts"]
    rows = [("PATH", "VALUE", "STATUS", "PROVENANCE")] + [
        (f["path"], "-" if f["value"] is None else str(f["value"]), f["status"], f["provenance"]) for f in facts
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if result["rejected"]:
        print("rejected patches:")
        for r in result["rejected"]:
            print(f"  {r['task_id']}: {r['reason']}")


def _serve(args: argparse.Namespace) -> int:
    from doubles.superagent import Behaviour, StubConfig, SuperAgentStub

    try:
        behaviour = Behaviour(args.behaviour)
    except ValueError:
        names = ", ".join(b.value for b in Behaviour)
        print(f"agent-recovery: unknown behaviour {args.behaviour!r}; one of: {names}", file=sys.stderr)
        return 2
    config = StubConfig(behaviour=behaviour, chunked=not args.no_chunked)
    stub = SuperAgentStub(api_key=args.api_key, host=args.host, port=args.port, config=config)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    print(f"superagent-stub listening on {stub.base_url} (behaviour {config.behaviour.value})", flush=True)
    stub.start()
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stub.stop()
    return 0
