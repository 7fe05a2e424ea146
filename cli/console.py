"""`agent-recovery console [--host 127.0.0.1] [--port 8089]`: the operator console (pages and
the JSON API) in this process, reading PostgreSQL; `agent-recovery console hash-token`: the
token_hash of an operator's token (read from stdin) for CONSOLE_OPERATORS_FILE."""

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
    sub_console = p.add_subparsers(dest="console_command", required=False)
    h = sub_console.add_parser(
        "hash-token",
        help="read an operator's token from stdin, print its token_hash for CONSOLE_OPERATORS_FILE",
    )
    h.add_argument("--pbkdf2", action="store_true", help="PBKDF2-SHA256 instead of scrypt")
    h.set_defaults(handler=_hash_token, without_tools=True)


def _hash_token(args: argparse.Namespace) -> int:
    """The token is read from stdin (its first line), never from the command line, where other
    users of the machine and the shell's history would see it."""
    import sys

    from cli.agent import fail
    from console.operators import hash_token, hash_token_pbkdf2

    if sys.stdin.isatty():
        import getpass

        token = getpass.getpass("token: ")
    else:
        token = sys.stdin.readline().rstrip("\r\n")
    if not token.strip():
        return fail("console hash-token: no token on stdin", 2)
    print(hash_token_pbkdf2(token) if args.pbkdf2 else hash_token(token))
    return 0


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
