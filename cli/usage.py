"""`agent-recovery usage [--since ISO] [--by agent|user|model] [--json]`: token totals of the
recorded model calls, grouped (docs/usage.md)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any


def register(sub: Any) -> None:
    from models.usage import UsageGroup

    p = sub.add_parser("usage", help="token totals of the recorded model calls, grouped by agent, user or model")
    p.add_argument("--since", type=_iso_time, metavar="ISO", help="only calls recorded at or after (UTC when naive)")
    p.add_argument("--by", choices=[g.value for g in UsageGroup], default=UsageGroup.AGENT.value)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_usage)


def _iso_time(value: str) -> datetime:
    try:
        at = datetime.fromisoformat(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from exc
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _usage(args: argparse.Namespace) -> int:
    from models import transaction
    from models.prices import load_prices
    from models.usage import UsageGroup, UsageTotals, usage_by

    with transaction() as s:
        groups = usage_by(s, by=UsageGroup(args.by), since=args.since)
    total = UsageTotals(usd=None if load_prices() is None else 0.0)
    for group in groups:
        total = total + group.totals
    if args.json:
        shown = {
            "by": args.by,
            "since": args.since.isoformat() if args.since else None,
            "groups": [{"key": g.key, **g.totals.as_dict()} for g in groups],
            "total": total.as_dict(),
        }
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    for g in [*groups, None]:
        key, t = ("(total)", total) if g is None else (g.key or "(unnamed)", g.totals)
        print(
            f"{key:<24} prompt={t.prompt_tokens} completion={t.completion_tokens} cached={t.cached_tokens} "
            f"reasoning={t.reasoning_tokens} calls={t.model_calls}"
            + (f" estimated={t.estimated_tokens}" if t.estimated_tokens else "")
            + (f" usd={t.usd:.6f}" if t.usd is not None else "")
        )
    return 0
