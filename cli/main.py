"""`agent-recovery` entry point. Each command family registers its subcommands here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from settings import SettingsError

#: Modules that expose ``register(subparsers)``; each adds its own subcommands.
FAMILIES = (
    "cli.db",
    "cli.agent",
    "cli.recovery",
    "cli.model",
    "cli.field",
    "cli.metrics",
    "cli.approval",
    "cli.console",
    "cli.audit",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="agent-recovery", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in FAMILIES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from harness.agents import load_at_start
    from harness.errors import AgentConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        load_at_start()  # TOOL_MODULES and entry points; every agent's tools checked
        return int(handler(args) or 0)
    except AgentConfigError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 2
    except SettingsError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        problem = unreachable(exc)
        if problem is None:
            raise
        print(f"agent-recovery: {args.command}: {problem}", file=sys.stderr)
        return 2


def unreachable(exc: BaseException) -> str | None:
    """One line naming the service a command could not reach (no secrets: the database URL is
    shown without its password), or None for any other error."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        from sqlalchemy.engine import make_url

        from settings import get_settings

        where = make_url(get_settings().DATABASE_URL).render_as_string(hide_password=True)
        return f"the database is unreachable at {where} ({type(exc.orig).__name__})"
    module = type(exc).__module__
    if module.startswith(("kombu.", "amqp.")):
        return f"the broker is unreachable ({type(exc).__name__}; CELERY_BROKER_URL)"
    if module.startswith("redis."):
        return f"Redis is unreachable ({type(exc).__name__}; REDIS_URL or CELERY_BROKER_URL)"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
