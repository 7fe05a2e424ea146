"""`agent-recovery console [--host 127.0.0.1] [--port 8089]`: the operator console (pages and
the JSON API) in this process, reading PostgreSQL."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("console", help="serve the operator console (web pages and a JSON API)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback needs CONSOLE_TOKEN)")
    p.add_argument("--port", type=int, default=8089)
    p.add_argument(
        "--secure-cookies", action="store_true", help="mark cookies Secure (the console is served over HTTPS)"
    )
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from cli.agent import fail
    from settings import get_settings

    try:
        import uvicorn

        from console.app import create_app
        from console.auth import ConsoleConfigError, load_config
    except ImportError as exc:
        return fail(f"console: {exc.name} is missing: pip install 'agent-recovery[console]'", 2)
    try:
        config = load_config(get_settings(), args.host, secure_cookies=args.secure_cookies)
    except ConsoleConfigError as exc:
        return fail(f"console: {exc}", 2)
    from tasks.signals import setup_logging

    # Our own lines (console.app: one per request, action and refused sign-in) go to stderr at
    # LOG_LEVEL; no access log: the request line names the path without its query.
    setup_logging(get_settings().LOG_LEVEL)
    uvicorn.run(create_app(config), host=args.host, port=args.port, access_log=False, log_level="info")
    return 0
