"""`agent-recovery` entry point. Each command family registers its subcommands here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from settings import SettingsError

#: The exit code of a command whose row another operation held through every attempt (a lock
#: timeout): nothing was done, the database is fine, and trying again shortly is the answer. Distinct
#: from every other command's codes (3 is `submit`'s unsent message and `approvals show`'s unknown request).
EXIT_BUSY = 5

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
    "cli.usage",
    "cli.release",
    "cli.budget",
)

#: Commands that run no tool and read no agent definition: they work without the workers'
#: TOOL_MODULES, AGENTS_FILE or PYTHONPATH (an operator lists or denies approvals, reads a
#: session, cancels one, from any shell). Every other command loads and checks the tools first,
#: as a worker does: `submit` checks the agent, `status` reads the queues through the Celery app
#: (which loads them at import), `approve --arguments` checks the edited
#: arguments against the tool's schema, `scan` and `redeliver` may run a delivered parent's
#: round in this process, the console's actions are those of `approve` and `redeliver`.
WITHOUT_TOOLS = frozenset(
    {
        "db",
        "session",
        "cancel",
        "approvals",
        "deny",
        "metrics",
        "field",
        "scripted-model",
        "superagent-stub",
        "local-client",
        "usage",
        "health",
        "releases",
        "budget",
        "sessions",  # `sessions upgrade --to current` loads them itself: it needs this configuration's release
    }
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
    from harness.errors import AgentConfigError, RowBusy, is_lock_timeout

    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        if args.command not in WITHOUT_TOOLS and not getattr(args, "without_tools", False):
            load_at_start()  # TOOL_MODULES and entry points; every agent's tools checked
        return int(handler(args) or 0)
    except AgentConfigError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 2
    except SettingsError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr)
        return 2
    except RowBusy as exc:
        print(f"agent-recovery: {args.command}: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except Exception as exc:
        if is_lock_timeout(exc):  # a command that does not try again: the same plain answer
            print(f"agent-recovery: {args.command}: {RowBusy()}", file=sys.stderr)
            return EXIT_BUSY
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
