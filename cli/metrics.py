"""`agent-recovery metrics serve --port N`: Prometheus metrics read from the database at scrape time."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any


def register(sub: Any) -> None:
    metrics = sub.add_parser("metrics", help="Prometheus metrics (recovery/metrics.py)")
    metricssub = metrics.add_subparsers(dest="metrics_command", required=True)
    serve = metricssub.add_parser("serve", help="serve /metrics until SIGINT/SIGTERM")
    serve.add_argument("--port", type=int, required=True, metavar="N", help="port to listen on (0 picks a free one)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)"
    )
    serve.add_argument(
        "--settled-refresh-seconds",
        type=float,
        default=None,
        metavar="S",
        help="recount settled executions (an O(history) index-only scan) at most every S seconds (default 60)",
    )
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from recovery.metrics import DEFAULT_SETTLED_REFRESH_SECONDS, RecoveryCollector, build_registry

    refresh = args.settled_refresh_seconds
    collector = RecoveryCollector(
        settled_refresh_seconds=DEFAULT_SETTLED_REFRESH_SECONDS if refresh is None else refresh
    )
    try:
        httpd, thread = start_http_server(args.port, addr=args.host, registry=build_registry(collector))
    except OSError as exc:
        reason = exc.strerror or exc
        print(f"agent-recovery metrics: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"metrics listening on http://{args.host}:{httpd.server_port}/metrics", flush=True)
    try:
        while not stopping.wait(0.5):
            pass
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
    return 0
