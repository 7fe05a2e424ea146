"""`agent-recovery releases`: the agent releases stored and their live sessions (docs/releases.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("releases", help="agent releases, oldest first, with their live sessions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_releases)


def release_report() -> list[dict[str, Any]]:
    """The ``releases --json`` shape: one object per release, oldest first."""
    from models import transaction
    from models.release import release_rows

    with transaction() as s:
        rows = release_rows(s)
    return [
        {
            "id": int(r.id),
            "content_hash": str(r.content_hash),
            "created_at": r.created_at.isoformat(),
            "agents": sorted((r.definition or {}).get("agents", {})),
            "live_sessions": int(r.live),
        }
        for r in rows
    ]


def _releases(args: argparse.Namespace) -> int:
    report = release_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for r in report:
        print(
            f"release {r['id']}  {r['content_hash'][:12]}  created {r['created_at']}  "
            f"live sessions {r['live_sessions']}  agents {', '.join(r['agents'])}"
        )
    return 0
