"""`agent-recovery db upgrade`: runs `alembic upgrade head` on DATABASE_URL."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    db = sub.add_parser("db", help="database schema")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="alembic upgrade head")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(handler=_upgrade)


def _upgrade(args: argparse.Namespace) -> int:
    from migrations import upgrade
    from settings import get_settings

    get_settings()  # fail early, naming the variable, on a bad environment
    upgrade(revision=args.revision)
    print(f"database upgraded to {args.revision}")
    return 0
